"""Two Ray nodes on one machine: a "GPU" node (custom resource gpu_node) holding 2 trainer ranks
and 2 engines, and a "CPU" node (cpu_node) holding 2 sandbox replicas. A short pipeline (one RL
stage of 2 steps) runs on them, and then, as the reference, on a one-node local Ray the run starts
itself. Both on 127.0.0.1 only.

Run: .venv/bin/python -m pytest tests/test_two_nodes.py -q   (about 5 minutes on 2 cores)
"""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
from mlflow.tracking import MlflowClient
from prefect.testing.utilities import prefect_test_harness
from ray.cluster_utils import Cluster

from flows.pipeline import pipeline
from tasks.tracking.mlflow_log import EXPERIMENT, tracking_uri
from tests.processes import alive, placed_pids, wait_gone
from tests.small_run import small_run, stage

pytestmark = pytest.mark.slow  # starts engines or trains

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
ACTORS = {
    "cluster.trainer.ranks": 2,
    "cluster.trainer.cpus": 1,
    "cluster.engines.count": 2,
    "cluster.engines.cpus": 0.5,
    "cluster.sandbox.replicas": 2,
    "cluster.sandbox.cpus": 0.5,
    "sandbox.workers": 1,
}
ON_NODES = {
    "cluster.trainer.resources": {"gpu_node": 1},
    "cluster.engines.resources": {"gpu_node": 1},
    "cluster.sandbox.resources": {"cpu_node": 1},
}
TABLES = ["rollouts", "steps"]


def overrides(output_dir: Path) -> dict:
    # The small run's policy solves nothing yet: groups without signal still make an update (of
    # zero advantages), so that every step trains, checkpoints and syncs.
    return {
        **small_run([stage("stage1", 2)]),
        "output_dir": str(output_dir),
        "eval.base": False,
        "rl.roc.drop_zero_signal": False,
        **ACTORS,
    }


def rows(run_dir: Path, table: str) -> list[dict]:
    return [row for part in sorted((run_dir / table).rglob("*.parquet")) for row in pq.read_table(part).to_pylist()]


def tables(run_dir: Path) -> dict[str, tuple[object, int]]:
    """Each table's schema and row count."""
    out = {}
    for table in TABLES:
        parts = sorted((run_dir / table).rglob("*.parquet"))
        schema = pq.read_schema(parts[0]).remove_metadata()
        out[table] = (schema, sum(pq.read_metadata(p).num_rows for p in parts))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-nodes")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"gpu_node": 4}})
    cluster.add_node(num_cpus=2, resources={"cpu_node": 2})
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
        with prefect_test_harness():
            two = pipeline(config=str(CONFIG), run_id="two-nodes", overrides=on_cluster)
        assert not ray.is_initialized()  # the run disconnected; the cluster is still up
        assert all(alive(pid) for pid in ray_pids)
    finally:
        cluster.shutdown()
    with prefect_test_harness():
        # The run starts a local Ray itself; 4 logical CPUs for the same actors on 2 cores.
        one = pipeline(config=str(CONFIG), run_id="one-node", overrides={**overrides(root), "cluster.num_cpus": 4})
    return {
        "two": Path(two["run_dir"]),
        "one": Path(one["run_dir"]),
        "node_ids": node_ids,
        "addresses": addresses,
        "ray_pids": ray_pids,
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
        assert metrics[(step, "rank_weight_spread")] == 0.0, step
        assert metrics[(step, "sync_logprob_gap")] < 2e-3, step
    # SFT's steps move the weights (RL's zero advantages do not): the ranks agree after each one.
    client = MlflowClient(tracking_uri(runs["two"].parents[1]))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    sft = client.search_runs(
        [experiment.experiment_id], "tags.`rstar2.run_id` = 'two-nodes' and tags.`rstar2.stage` = 'sft'"
    )
    spread = client.get_metric_history(sft[0].info.run_id, "sft/rank_weight_spread")
    losses = client.get_metric_history(sft[0].info.run_id, "sft/loss")
    assert len(spread) == len(losses) >= 2 and {m.value for m in spread} == {0.0}


def test_tables_match_a_one_node_run_of_the_same_config(runs):
    two, one = tables(runs["two"]), tables(runs["one"])
    for table in TABLES:
        assert two[table][0] == one[table][0], table
    assert two["rollouts"][1] == one["rollouts"][1]
    assert two["steps"][1] == one["steps"][1]
    rl_rollouts = [r for r in rows(runs["two"], "rollouts") if r["stage"] == "stage1"]
    assert len(rl_rollouts) == 2 * 2 * 8  # steps x problems x 2G
    assert {r["metric"] for r in rows(runs["two"], "steps")} == {r["metric"] for r in rows(runs["one"], "steps")}


def test_nothing_it_started_is_left_running(runs):
    pids = placed_pids(runs["two"]) + placed_pids(runs["one"]) + runs["ray_pids"]
    assert wait_gone(pids) == []
