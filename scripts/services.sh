#!/usr/bin/env bash
# The services behind the Prefect UI workflow, all on 127.0.0.1: a Prefect server, the `local`
# process work pool and a worker polling it, the deployments of prefect.yaml, and the MLflow UI.
#
#   scripts/services.sh start     # idempotent; prints the two UI addresses
#   scripts/services.sh stop
#
# Ports: PREFECT_PORT (4200), MLFLOW_PORT (5000). Logs and pid files: outputs/services/.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STATE=${RSTAR2_SERVICES_DIR:-$PWD/outputs/services}
PREFECT_PORT=${PREFECT_PORT:-4200}
MLFLOW_PORT=${MLFLOW_PORT:-5000}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/outputs/prefect}
export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api
# Flow runs send a heartbeat every 30 s (Prefect's floor); the automation flows/automations.py
# creates marks one Crashed when they stop, so a killed driver's run can be retried from the UI.
export PREFECT_FLOWS_HEARTBEAT_FREQUENCY=${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30}
# Nothing leaves the machine; one thread per process on small machines.
eval "$("$VENV/bin/python" -m tasks.config.environment)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

running() { [ -f "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }

start_bg() {  # name command...: in its own session, so that stop ends its children too
    local name=$1; shift
    if running "$name"; then echo "$name already running (pid $(cat "$STATE/$name.pid"))"; return; fi
    setsid "$@" > "$STATE/$name.log" 2>&1 < /dev/null &
    echo $! > "$STATE/$name.pid"
}

wait_http() {
    for _ in $(seq 1 240); do
        if "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    echo "no answer from $1 (logs in $STATE)" >&2
    return 1
}

case "${1:-}" in
start)
    mkdir -p "$STATE" "$PREFECT_HOME" outputs
    start_bg prefect-server "$VENV/bin/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT"
    wait_http "$PREFECT_API_URL/health"
    "$VENV/bin/prefect" work-pool inspect local > /dev/null 2>&1 \
        || "$VENV/bin/prefect" work-pool create local --type process > /dev/null
    # The deployments that run here (the paper's needs a `gpu` pool on a cluster), in one command:
    # each `prefect deploy` costs ~20 s of imports on 2 cores.
    names=()
    for deployment in ${RSTAR2_DEPLOYMENTS:-tiny tiny-stage evaluate}; do names+=(--name "$deployment"); done
    "$VENV/bin/prefect" --no-prompt deploy "${names[@]}" > "$STATE/deploy.log" 2>&1 \
        || { cat "$STATE/deploy.log" >&2; exit 1; }
    "$VENV/bin/python" -m flows.automations > "$STATE/automations.log" 2>&1 \
        || { cat "$STATE/automations.log" >&2; exit 1; }
    start_bg prefect-worker "$VENV/bin/prefect" worker start --pool local
    start_bg mlflow-ui "$VENV/bin/mlflow" ui --host 127.0.0.1 --port "$MLFLOW_PORT" \
        --backend-store-uri "sqlite:///$PWD/outputs/mlflow.db"
    wait_http "http://127.0.0.1:$MLFLOW_PORT/"
    echo "Prefect UI: http://127.0.0.1:$PREFECT_PORT  (deployments: rstar2-pipeline/tiny, rstar2-pipeline/tiny-stage, rstar2-evaluate/evaluate)"
    echo "MLflow UI:  http://127.0.0.1:$MLFLOW_PORT"
    ;;
stop)
    for name in prefect-worker mlflow-ui prefect-server; do
        if running "$name"; then
            pid=$(cat "$STATE/$name.pid")
            kill -TERM -- "-$pid" 2>/dev/null || true
            for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
            kill -KILL -- "-$pid" 2>/dev/null || true
            echo "stopped $name"
        fi
        rm -f "$STATE/$name.pid"
    done
    ;;
*)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
