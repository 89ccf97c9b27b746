"""Session-wide settings: everything local, one thread per process, a private Prefect home."""

import os
import shutil
import tempfile

import tasks.cluster  # noqa: F401  (before Ray is imported: keeps local Rays on 127.0.0.1)
from tasks.config.environment import keep_local

# Set before Prefect, MLflow or torch are imported by any test module.
OWN_PREFECT_HOME = None if "PREFECT_HOME" in os.environ else tempfile.mkdtemp(prefix="rstar2-prefect-")
if OWN_PREFECT_HOME:
    os.environ["PREFECT_HOME"] = OWN_PREFECT_HOME
else:  # `make test`'s, under outputs/: Prefect makes its home folder, but not the parents
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
keep_local()
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


import pytest  # noqa: E402


def pytest_unconfigure(config) -> None:
    # After every fixture (the Prefect server among them) has stopped: nothing of the session's
    # Prefect home (settings, database, logs) is left in the temp folder.
    if OWN_PREFECT_HOME:
        shutil.rmtree(OWN_PREFECT_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def prefect_api() -> str:
    """One Prefect test server for the session, on 127.0.0.1, stopped (by its own process) at the
    end: every test that runs a flow, in this process or in a `rstar2 run` it starts (pass
    `PREFECT_API_URL` on), reports to it. A flow run without a server starts one of its own, which
    costs ~18 s on two cores; the suite's runs would pay that a dozen times. A test that reads
    what the server holds selects its own runs (by id, or those made since it began)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


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
def default_run(tmp_path_factory, request):
    """The default config's whole run at a fixed seed (tests/default_run.py), shared by the tests
    that only read its outputs."""
    from pathlib import Path

    from tests.default_run import finished_default, run_default

    if finished := os.environ.get("RSTAR2_DEFAULT_RUN"):
        return finished_default(Path(finished))
    return run_default(tmp_path_factory.mktemp("default-run"), request.getfixturevalue("prefect_api"))
