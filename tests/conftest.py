"""Session-wide settings: everything local, one thread per process, a private Prefect home."""

import os
import tempfile

# Set before Prefect, MLflow or torch are imported by any test module.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="rstar2-prefect-"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
