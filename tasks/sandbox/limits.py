"""What one call may use: the `Limits` a server is given, and the rlimits that enforce them.

Standard library only: a template cell works out its programs' rlimits once and each program
applies them after its fork (tasks/sandbox/cell.py); the fresh-process path applies them between
fork and exec.
"""

import resource
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    timeout_s: float = field(default=4.0, metadata={"help": "wall-clock limit per call (s)"})
    cpu_s: int = field(default=4, metadata={"help": "CPU-time limit per call (s), RLIMIT_CPU"})
    memory_mb: int = field(default=512, metadata={"help": "address-space limit (MiB), RLIMIT_AS"})
    output_bytes: int = field(default=4096, metadata={"help": "stdout + stderr kept; more kills the program"})
    file_size_mb: int = field(default=8, metadata={"help": "largest file the code may write (MiB)"})
    open_files: int = field(default=64, metadata={"help": "open file descriptors, RLIMIT_NOFILE"})
    processes: int = field(default=32, metadata={"help": "RLIMIT_NPROC for the uid (skipped when root)"})

    def rlimit_fields(self) -> dict[str, int]:
        """The limits the program's process applies to itself (the arguments of `rlimits`)."""
        return {
            "cpu_s": self.cpu_s,
            "memory_mb": self.memory_mb,
            "file_size_mb": self.file_size_mb,
            "open_files": self.open_files,
            "processes": self.processes,
        }


def rlimits(
    cpu_s: int, memory_mb: int, file_size_mb: int, open_files: int, processes: int, nproc: bool, address_base: int = 0
) -> list[tuple[int, tuple[int, int]]]:
    """The (resource, (soft, hard)) pairs to apply, clamped to the hard limits held now: asking
    for more than that fails setrlimit, and with it the whole call.

    `nproc`: whether to set RLIMIT_NPROC, which root ignores and which for other uids counts all
    their processes and threads. `address_base`: bytes already mapped that the program must not
    pay for (the template's numpy and sympy)."""
    memory = address_base + (memory_mb << 20)
    wanted = [
        # The soft CPU limit sends SIGXCPU (reported as a timeout); the hard one is the backstop.
        (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_FSIZE, file_size_mb << 20, file_size_mb << 20),
        (resource.RLIMIT_NOFILE, open_files, open_files),
    ]
    if nproc:
        wanted.append((resource.RLIMIT_NPROC, processes, processes))
    pairs = []
    for which, soft, hard in wanted:
        _, held = resource.getrlimit(which)
        if held != resource.RLIM_INFINITY:
            soft, hard = min(soft, held), min(hard, held)
        pairs.append((which, (soft, hard)))
    return pairs


def apply_rlimits(pairs: list[tuple[int, tuple[int, int]]]) -> None:
    for which, pair in pairs:
        resource.setrlimit(which, pair)
