"""The outcome of one tool call, shared by the sandbox service, its client and the RL code.

RoC's penalty counts failed tool calls from `ToolStatus.is_failure`, never from the response text:
the release's "the response contains 'error'" test misses timeouts and flags stdout that merely
mentions the word.
"""

import enum
from dataclasses import dataclass
from typing import Any


class ToolStatus(str, enum.Enum):
    OK = "ok"
    ERROR = "error"  # non-zero exit, usually an uncaught exception or a syntax error
    TIMEOUT = "timeout"  # wall-clock or CPU limit
    MEMORY = "memory"  # MemoryError under the address-space limit
    OUTPUT_LIMIT = "output_limit"  # stdout + stderr grew past the byte limit, program killed
    KILLED = "killed"  # died from a signal we did not send (segfault, abort, self-kill)
    PARSE_ERROR = "parse_error"  # the model's tool call did not parse; set by the agent loop
    INTERNAL = "internal"  # the service failed (unreachable, overloaded, bug)

    @property
    def is_failure(self) -> bool:
        """True when the model's code is to blame; an outage must not count against the model."""
        return self not in (ToolStatus.OK, ToolStatus.INTERNAL)


@dataclass
class ToolResult:
    status: ToolStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None  # negative: killed by that signal (subprocess convention)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "exit_code": self.exit_code,
            "wall_s": self.wall_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ToolResult":
        return cls(
            status=ToolStatus(d["status"]),
            stdout=d.get("stdout", ""),
            stderr=d.get("stderr", ""),
            exit_code=d.get("exit_code"),
            wall_s=float(d.get("wall_s", 0.0)),
        )
