"""Two Ray nodes on one machine: a "GPU" node (custom resource gpu_node) holding 2 trainer ranks
and 2 engines, and a "CPU" node (cpu_node) holding 2 sandbox replicas. A short pipeline (one RL
stage of 2 steps) runs on them, on 127.0.0.1 only, with faults injected into the real processes at
seeded moments. Each run is checked against what its config implies (tables: the schemas the
store declares, every part once with all its rows, every group whole; MLflow step histories with
each step once); a one-node local Ray with 2 ranks is tests/test_resume_pipeline.py's, a dead
engine and sandbox replica tests/test_two_hosts.py's:
- a trainer rank SIGKILLed in step 1's update: the attempt fails naming the rank, and Prefect's
  retry goes on from step 0's checkpoint;
- nodes lost, in one run whose engines only an engine node can hold and whose sandboxes may live
  anywhere: the CPU node removed after step 0, its sandbox replicas come back on the node that is
  left within the attempt; the engine node removed after step 1, the run stops with the plan's
  error, and once a node is back, the same run id goes on from step 1's checkpoint.

Run: .venv/bin/python -m pytest tests/test_two_nodes.py -q   (about 5 minutes on 2 cores)
"""

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
from mlflow.tracking import MlflowClient
from prefect import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from ray.cluster_utils import Cluster

from flows.pipeline import pipeline
from tasks.store import tables as store
from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri
from tests.processes import alive, placed_pids, wait_busy, wait_for, wait_gone, wait_until
from tests.small_run import small_run, stage
from tests.test_resume_pipeline import step_histories, table_parts

pytestmark = pytest.mark.slow  # starts engines or trains

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
ACTORS = {
    "trainer.ranks": 2,
    "trainer.cpus": 1,
    "engines.count": 2,
    "engines.cpus": 0.5,
    "sandbox.replicas": 2,
    "sandbox.cpus": 0.5,
    "sandbox.workers": 1,
}
NODES_LOST_STEPS = 3  # the engine node goes after step 1: a step is left to fail
ON_NODES = {
    "trainer.resources": {"gpu_node": 1},
    "engines.resources": {"gpu_node": 1},
    "sandbox.resources": {"cpu_node": 1},
}


def overrides(output_dir: Path, steps: int = 2) -> dict:
    # The small run's policy solves nothing yet: groups without signal still make an update (of
    # zero advantages), so that every step trains, checkpoints and syncs.
    return {
        **small_run([stage("stage1", steps)]),
        "output_dir": str(output_dir),
        "eval.base": False,
        "rl.roc.drop_zero_signal": False,
        **ACTORS,
    }


def rows(run_dir: Path, table: str) -> list[dict]:
    return [row for part in sorted((run_dir / table).rglob("*.parquet")) for row in pq.read_table(part).to_pylist()]


def placed(run_dir: Path, role: str, index: int) -> dict:
    wait_for(run_dir / "placement.json")
    actors = json.loads((run_dir / "placement.json").read_text())["actors"]
    return next(a for a in actors if (a["role"], a["index"]) == (role, index))


def step_done(run_dir: Path, step: int) -> Path:
    return run_dir / "steps" / "stage=stage1" / f"step={step}" / "part-0.parquet"


def kill_rank(run_dir: Path, rng: random.Random, log: list) -> None:
    """Trainer rank 1 in step 1's update (once step 0 is recorded, the rank's next busy spell)."""
    rank = placed(run_dir, "trainer", 1)["pid"]
    wait_for(step_done(run_dir, 0))
    wait_busy(rank)
    time.sleep(rng.uniform(0, 0.3))
    os.kill(rank, signal.SIGKILL)
    log.append("trainer 1")


def run_with(fault, run_id: str, on_cluster: dict, root: Path, *args) -> tuple[Path, list]:
    """The pipeline, with `fault` (run_dir, rng, log, after *args) injected from a thread."""
    log: list = []
    run_dir = root / "runs" / run_id
    injector = threading.Thread(target=fault, args=(*args, run_dir, random.Random(run_id), log), daemon=True)
    injector.start()
    before = asyncio.run(retried())
    pipeline(config=str(CONFIG), run_id=run_id, overrides=on_cluster)
    attempts = attempts_since(before)
    injector.join(timeout=10)
    return run_dir, log + attempts


def nodes_lost(cluster: Cluster, cpu_node, on_cluster: dict, root: Path) -> tuple[Path, list, list[int]]:
    """Sandboxes that may live on any node, engines that only an engine node can hold, 3 steps.
    Once step 0 is recorded the CPU node goes; once its sandbox replicas are back on the node
    that is left and step 1 is recorded, the engine node goes: the attempt fails (every engine
    gone), its retry cannot place them and the run stops with the plan's error. Run again with
    the same id once a node is back, it goes on from step 1's checkpoint. Returns the run folder,
    what happened, and the replicas that were on the CPU node."""
    settings = {**on_cluster, **overrides(root, NODES_LOST_STEPS), "sandbox.resources": {}}
    settings["engines.resources"] = {"engine_node": 1}
    run_dir, log, moved = root / "runs" / "nodes-lost", [], []
    engine_node = cluster.add_node(num_cpus=1, resources={"engine_node": 2})
    rng = random.Random("nodes-lost")

    def restarted(index: int) -> bool:
        return (run_dir / "logs" / f"sandbox-{index}.log").read_text().count("sandbox on http") == 2

    def remove_both() -> None:
        wait_for(step_done(run_dir, 0))
        time.sleep(rng.uniform(0, 1.0))
        cpu_id = cpu_node.node_id
        actors = json.loads((run_dir / "placement.json").read_text())["actors"]
        moved.extend(a["index"] for a in actors if a["role"] == "sandbox" and a["node_id"] == cpu_id)
        cluster.remove_node(cpu_node)
        log.append("CPU node removed")
        wait_until(lambda: all(restarted(index) for index in moved), "the lost replicas restarted", 300)
        wait_for(step_done(run_dir, 1))
        time.sleep(rng.uniform(0, 0.3))
        cluster.remove_node(engine_node)
        log.append("engine node removed")

    injector = threading.Thread(target=remove_both, daemon=True)
    injector.start()
    before = asyncio.run(retried())
    try:
        pipeline(config=str(CONFIG), run_id="nodes-lost", overrides=settings)
        stopped = "the run did not stop"
    except Exception as error:
        stopped = f"{type(error).__name__}: {error}"
    log += attempts_since(before)
    injector.join(timeout=10)
    cluster.add_node(num_cpus=1, resources={"engine_node": 2})
    pipeline(config=str(CONFIG), run_id="nodes-lost", overrides=settings)
    return run_dir, [*log, stopped], moved


async def retried() -> dict:
    """Each on-cluster subflow run so far -> why each of its attempts failed, as Prefect recorded
    it before retrying."""
    async with get_client() as client:
        runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["on-cluster"])))
        return {
            run.id: [
                state.message for state in await client.read_flow_run_states(run.id) if state.name == "AwaitingRetry"
            ]
            for run in runs
        }


def attempts_since(before: dict) -> list[str]:
    """The failed attempts of the on-cluster runs started since `before` (one run at a time here)."""
    return [message for run, messages in asyncio.run(retried()).items() if run not in before for message in messages]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prefect_api):
    root = tmp_path_factory.mktemp("two-nodes")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"gpu_node": 4}})
    cpu_node = cluster.add_node(num_cpus=2, resources={"cpu_node": 2})
    faults = {}
    try:
        ray.init(address=cluster.address)
        nodes = {("gpu" if "gpu_node" in n["Resources"] else "cpu"): n for n in ray.nodes() if n["Alive"]}
        ray.shutdown()  # the run connects by itself, through cluster.address, as on a real cluster
        node_ids = {role: node["NodeID"] for role, node in nodes.items()}
        addresses = {node["NodeManagerAddress"] for node in nodes.values()}
        ray_pids = [
            info.process.pid
            for node in cluster.list_all_nodes()
            for processes in node.all_processes.values()
            for info in processes
        ]
        on_cluster = {**overrides(root), **ON_NODES, "cluster.address": cluster.address}
        faults["rank"] = run_with(kill_rank, "two-nodes", on_cluster, root)
        assert not ray.is_initialized()  # the run disconnected; the cluster is still up
        assert all(alive(pid) for pid in ray_pids)
        faults["nodes"] = nodes_lost(cluster, cpu_node, on_cluster, root)
    finally:
        cluster.shutdown()
    return {
        "two": faults["rank"][0],
        "node_ids": node_ids,
        "addresses": addresses,
        "ray_pids": ray_pids,
        "faults": faults,
    }


def test_each_actor_ran_on_the_node_its_resources_name(runs):
    placement = json.loads((runs["two"] / "placement.json").read_text())["actors"]
    where = {(a["role"], a["index"]): a["node_id"] for a in placement}
    assert sorted(where) == sorted((role, i) for role in ("trainer", "engine", "sandbox") for i in range(2))
    for (role, _), node in where.items():
        assert node == runs["node_ids"]["cpu" if role == "sandbox" else "gpu"], (role, node)
    assert runs["addresses"] == {"127.0.0.1"}
    assert all(a["url"].startswith("http://127.0.0.1:") for a in placement if a["role"] == "sandbox")


def test_ranks_agree_and_engines_follow_the_trainer_after_every_step(runs):
    metrics = {(r["step"], r["metric"]): r["value"] for r in rows(runs["two"], "steps")}
    for step in (0, 1):
        # Exact: every rank applies the same all-reduced gradient with the same Adam arithmetic
        assert metrics[(step, "rank_weight_spread")] == 0.0, step
        assert metrics[(step, "sync_logprob_gap")] < 2e-3, step  # fp32 in vLLM vs torch: test_weight_sync's TOLERANCE
    # SFT's steps move the weights (RL's zero advantages do not): the ranks agree after each one.
    client = MlflowClient(tracking_uri(runs["two"].parents[1]))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    sft = client.search_runs(
        [experiment.experiment_id], "tags.`rstar2.run_id` = 'two-nodes' and tags.`rstar2.stage` = 'sft'"
    )
    spread = client.get_metric_history(sft[0].info.run_id, "sft/rank_weight_spread")
    losses = client.get_metric_history(sft[0].info.run_id, "sft/loss")
    assert len(spread) == len(losses) >= 2 and {m.value for m in spread} == {0.0}


def test_tables_have_the_declared_schemas(runs):
    for table, schema in (("rollouts", store.ROLLOUTS), ("steps", store.STEPS)):
        parts = sorted((runs["two"] / table).rglob("*.parquet"))
        assert parts and all(pq.read_schema(p).remove_metadata().equals(schema) for p in parts), table


def group_sizes(run_dir: Path) -> Counter:
    return Counter((r["stage"], r["step"], r["problem_id"]) for r in rows(run_dir, "rollouts"))


def step_metric(run_dir: Path, metric: str) -> dict[int, float]:
    return {r["step"]: r["value"] for r in rows(run_dir, "steps") if r["metric"] == metric}


def assert_as_config_implies(run_dir: Path, steps: int = 2) -> None:
    """Every part an uninterrupted run of `steps` RL steps writes, once, with all its rows and
    every group whole: problems x 2G per RL step, the held-out problems x k per evaluated
    checkpoint; each RL step recorded, and in MLflow once."""
    small = overrides(run_dir.parents[1])
    heldout = pq.read_metadata(run_dir / "data" / "heldout.parquet").num_rows
    group, k = 2 * small["rl.group_size"], small["eval.k"]
    parts = {
        **{("stage1", step): 2 * group for step in range(steps)},
        ("eval-sft", 0): heldout * k,
        ("eval-stage1", 0): heldout * k,
    }
    assert table_parts(run_dir, "rollouts") == {part: (n, n) for part, n in parts.items()}  # rows = unique keys
    sizes = {name: {size for (stage, _, _), size in group_sizes(run_dir).items() if stage == name} for name, _ in parts}
    assert sizes == {"stage1": {group}, "eval-sft": {k}, "eval-stage1": {k}}
    recorded = table_parts(run_dir, "steps")
    assert recorded.keys() == {("stage1", step) for step in range(steps)}
    assert all(rows == keys for rows, keys in recorded.values())
    rewards = {(step, "reward_mean") for step in range(steps)}
    assert {(r["step"], r["metric"]) for r in rows(run_dir, "steps")} >= rewards
    evaluations = sorted(p.parent.parent.name for p in (run_dir / "evaluations").rglob("*.parquet"))
    assert evaluations == ["checkpoint=sft", "checkpoint=stage1"]
    histories = step_histories(run_dir.parents[1], run_dir.name)
    assert histories == [("base", []), ("parent", []), ("sft", []), ("stage1", list(range(steps)))]


def test_a_dead_trainer_rank_costs_a_retry_from_the_last_checkpoint(runs):
    run_dir, log = runs["faults"]["rank"]
    assert log[0] == "trainer 1" and len(log) == 2, log  # one failed attempt, then a retry that finished
    assert "RankDied: trainer rank 1 on node " in log[1] and "(127.0.0.1)" in log[1], log[1]
    assert_as_config_implies(run_dir)


def test_a_lost_node_costs_its_actors_a_move(runs):
    run_dir, log, moved = runs["faults"]["nodes"]
    assert log[0] == "CPU node removed" and log[1] == "engine node removed", log  # no failed attempt between
    assert moved, "no replica was on the node that went"
    for index in range(2):  # the moved ones came back within the attempt; the run again started each
        restarts = (run_dir / "logs" / f"sandbox-{index}.log").read_text().count("sandbox on http")
        assert restarts == (3 if index in moved else 2), (index, moved, restarts)
    actors = json.loads((run_dir / "placement.json").read_text())["actors"]
    where = {(a["role"], a["index"]): a["node_id"] for a in actors}
    assert all(where[("sandbox", i)] == runs["node_ids"]["gpu"] for i in range(2)), where  # the node that is left
    assert all(where[("engine", i)] not in runs["node_ids"].values() for i in range(2)), where  # the new engine node


def test_a_node_lost_for_good_stops_the_run_until_it_is_back(runs):
    run_dir, log, _ = runs["faults"]["nodes"]
    assert len(log) == 4, log
    assert "every engine is gone" in log[2], log[2]  # the attempt that lost them; its retry:
    assert log[3].startswith("PlanError: ") and "engine_node" in log[3], log[3]
    assert_as_config_implies(run_dir, NODES_LOST_STEPS)


def test_nothing_it_started_is_left_running(runs):
    runs_dirs = [run_dir for run_dir, *_ in runs["faults"].values()]
    pids = [pid for run_dir in runs_dirs for pid in placed_pids(run_dir)] + runs["ray_pids"]
    assert wait_gone(pids) == []
