#!/usr/bin/env bash
# Two RL steps of the tiny model on one GPU machine with colocated placement: the trainer rank
# and the vLLM engine share GPU 0 (half each), on a local Ray the run starts. Passes when every
# step's weight sync left the engine's prompt log-probs within 2e-3 of the trainer's.
#
#   scripts/gpu_smoke.sh            # needs: a CUDA GPU, `pip install -e '.[gpu,test]'` in .venv
#
# Output under outputs/gpu-smoke (the run, its tables and MLflow).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=${OUT:-outputs/gpu-smoke}
RUN_ID=${RUN_ID:-gpu-smoke-$(date +%Y%m%d-%H%M%S)}
eval "$("$VENV/bin/python" -m tasks.config.environment)"
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU here')"

"$VENV/bin/rstar2" run --config configs/tiny.yaml --run-id "$RUN_ID" \
  --set output_dir="$OUT" \
  --set cluster.placement=colocated \
  --set trainer.gpus=1 --set engines.gpus=1 \
  --set engines.gpu_memory_utilization=0.4 \
  --set 'rl.stages=[{name: stage1, steps: 2, max_response_tokens: 384, max_turns: 4, problems_per_step: 16}]' \
  --set rl.roc.drop_zero_signal=false

"$VENV/bin/python" - "$OUT/runs/$RUN_ID" <<'PY'
import sys
from pathlib import Path

import pyarrow.parquet as pq

run = Path(sys.argv[1])
rows = [r for p in sorted((run / "steps").rglob("*.parquet")) for r in pq.read_table(p).to_pylist()]
gaps = {r["step"]: r["value"] for r in rows if r["metric"] == "sync_logprob_gap"}
print(f"sync_logprob_gap per step: {gaps}")
if len(gaps) != 2 or max(gaps.values()) >= 2e-3:
    sys.exit("FAIL: the engine does not follow the trainer within 2e-3")
print("OK: the engine follows the trainer within 2e-3 after every step")
PY
