"""Config overrides shared by the end-to-end tests: the tiny config cut down to a run of a minute
or two on two cores, and the `rstar2 run` command line that runs it."""

import json
import sys
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def stage(name: str, steps: int, **fields) -> dict:
    """An RL stage with a short budget (96 response tokens, 2 turns, 2 problems a step)."""
    return {"name": name, "steps": steps, "max_response_tokens": 96, "max_turns": 2, "problems_per_step": 2, **fields}


def small_run(stages: list[dict]) -> dict:
    """Overrides (dotted keys) for a small run of `stages`; a test changes what it needs with
    `{**small_run(stages), key: value}`."""
    return {
        "data.n_train": 16,
        "data.n_heldout": 4,
        "model.tiny.pretrain_copy_steps": 0,
        "model.tiny.pretrain_steps": 2,
        "sft.n_examples": 64,
        "sft.epochs": 1,
        "rl.group_size": 4,
        "eval.k": 2,
        "eval.max_turns": 2,
        "eval.max_response_tokens": 96,
        "rl.stages": stages,
    }


def run_command(run_id: str, overrides: dict) -> list[str]:
    """`python -m flows.cli run` of the tiny config with these overrides (dotted keys)."""
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    return [sys.executable, "-m", "flows.cli", "run", "--config", str(TINY), "--run-id", run_id, *sets]
