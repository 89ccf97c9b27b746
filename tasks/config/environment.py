"""The environment every entry point sets before Prefect, MLflow or transformers load: nothing
leaves the machine (no telemetry, no model-hub look-ups). The CLI and the tests call `keep_local`;
scripts/services.sh exports the same values from `python -m tasks.config.environment`."""

from __future__ import annotations

import os

LOCAL_ONLY = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}


def keep_local() -> None:
    """Set the values above where the environment does not already (a user may override one)."""
    for key, value in LOCAL_ONLY.items():
        os.environ.setdefault(key, value)


if __name__ == "__main__":
    print("\n".join(f"export {key}=${{{key}:-{value}}}" for key, value in LOCAL_ONLY.items()))
