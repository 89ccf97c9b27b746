"""Session-wide settings: everything local, one thread per process, a private Prefect home."""

import os
import tempfile

import tasks.cluster  # noqa: F401  (before Ray is imported: keeps local Rays on 127.0.0.1)
from tasks.config.environment import keep_local

# Set before Prefect, MLflow or torch are imported by any test module.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="rstar2-prefect-"))
keep_local()
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """An untrained tiny model (tokenizer fitted on generated problems), shared by the engine tests."""
    from tasks.config import TinyModelConfig
    from tasks.data.problems import generate_problems
    from tasks.train.tiny_model import build_tiny_model

    problems = generate_problems(64, [1, 2], seed=0)
    corpus = [p.question + "\n" + p.solution_code for p in problems]
    cfg = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256)
    return build_tiny_model(cfg, corpus, seed=0, out_dir=tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The default config's whole run at a fixed seed (tests/default_run.py), shared by the tests
    that only read its outputs."""
    from pathlib import Path

    from tests.default_run import finished_default, run_default

    if finished := os.environ.get("RSTAR2_DEFAULT_RUN"):
        return finished_default(Path(finished))
    return run_default(tmp_path_factory.mktemp("default-run"))
