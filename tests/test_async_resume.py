"""Nothing in flight is lost or drawn twice: a run under rl.async one_step, its driver SIGKILLed at
seeded points and resumed with the same run id after each.

Each rollout is kept as it finishes (tasks/store/inflight.py). A kill point is the k-th rollout
an attempt keeps (k seeded), then a seeded moment more, so kills land in a step's own rollouts,
in the rollouts drawn ahead during an update, in the update, the checkpoint and the weight push.
After every kill the test reads what the dead attempt had kept; the finished run must hold each
of those rollouts unchanged (the same response, drawn by the same policy version: not drawn
again), and every step all its (problem, sample) rollouts once (none lost). The run uses split
placement: the engine and the trainer rank on cores of their own.

Three kill points are part of `make test` (about 3 minutes on two cores); ten under the soak
marker:

    .venv/bin/python -m pytest -m soak tests/test_async_resume.py -q -s
"""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import duckdb
import pytest

from tasks.store import inflight
from tests.processes import placed_pids, wait_gone
from tests.small_run import run_command, small_run, stage
from tests.test_driver_kill import descendants

ROOT = Path(__file__).resolve().parents[1]
ROLLOUTS_PER_STEP = 16  # 2 problems x 2G, G = 4
STEPS = {3: 4, 10: 10}  # kill points -> stage steps: enough rollouts for every kill to land
RUN = {
    "rl.async": {"mode": "one_step"},
    "rl.loss.is_cap": 2.0,
    "rl.roc.drop_zero_signal": False,  # every step updates, so every step draws the next ahead
    # the engine and the trainer rank on cores of their own, as rl.async means to run
    "cluster.placement": "split",
    "trainer.threads": 1,
}


def kept_rollouts(run_dir: Path) -> dict[tuple[int, str, int], tuple[str, int]]:
    """(step, problem, sample) -> (response, version) of every rollout kept in flight now."""
    kept = {}
    for folder in (run_dir / "inflight" / "stage1").glob("step=*"):
        step = int(folder.name.split("=")[1])
        for trajectory in inflight.finished(folder).values():
            kept[(step, trajectory.problem_id, trajectory.sample)] = (trajectory.response, trajectory.policy_version)
    return kept


def kept_since(run_dir: Path, since: float) -> int:
    return sum(1 for p in (run_dir / "inflight").rglob("*.json") if p.stat().st_mtime >= since)


@pytest.mark.parametrize(
    "points", [pytest.param(3, marks=pytest.mark.slow), pytest.param(10, marks=[pytest.mark.slow, pytest.mark.soak])]
)
def test_a_run_killed_anywhere_keeps_every_finished_rollout_and_draws_none_twice(tmp_path, points) -> None:
    rng, steps = random.Random(points), STEPS[points]
    run_dir, log_path = tmp_path / "runs" / "run", tmp_path / "run.log"
    command = run_command("run", {**RUN, **small_run([stage("stage1", steps)]), "output_dir": str(tmp_path)})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started, snapshots, kills, victim = [], {}, [], None
    began = time.monotonic()
    try:
        while len(kills) < points:
            since = time.time()
            with log_path.open("ab") as log:
                victim = subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            k, delay = rng.randint(1, 4), rng.uniform(0, 1.5)
            deadline = time.monotonic() + 600
            while victim.poll() is None and (not (run_dir / "inflight").exists() or kept_since(run_dir, since) < k):
                assert time.monotonic() < deadline, "the attempt kept no rollout in 10 minutes"
                time.sleep(0.02)
            if victim.poll() is not None:  # it finished before this kill point
                break
            time.sleep(delay)
            started += descendants(victim.pid) + placed_pids(run_dir)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            snapshots.update(kept_rollouts(run_dir))
            kills.append((k, round(delay, 2)))
        if victim.returncode is None or victim.returncode < 0:  # the last one was killed: finish the run
            with log_path.open("ab") as log:
                done = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
            assert done.returncode == 0, log_path.read_text()[-4000:]
        assert victim.returncode in (0, -signal.SIGKILL), log_path.read_text()[-4000:]
    finally:
        if victim is not None and victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)

    rows = duckdb.sql(
        f"SELECT step, problem_id, sample, response, generated_version, trained_version "
        f"FROM read_parquet('{run_dir}/rollouts/stage=stage1/*/*.parquet', hive_partitioning = true)"
    ).fetchall()
    final = {(step, p, s): (response, gen) for step, p, s, response, gen, _ in rows}
    redrawn = sorted(key for key, kept in snapshots.items() if final.get(key) != kept)
    per_step = {step: sum(1 for key in final if key[0] == step) for step in range(steps)}
    print(
        f"{len(kills)} kills (k-th kept rollout, delay s) {kills}; {len(snapshots)} finished rollouts in flight at "
        f"the kills, {len(redrawn)} drawn again; rollouts per step {per_step}; {time.monotonic() - began:.0f} s"
    )
    assert len(kills) == points, f"the run finished after {len(kills)} of {points} kill points"
    assert snapshots, "no kill found a finished rollout in flight"
    assert redrawn == []
    assert len(rows) == len(final) == steps * ROLLOUTS_PER_STEP and set(per_step.values()) == {ROLLOUTS_PER_STEP}
    assert all(trained - gen in (0, 1) for *_, gen, trained in rows)  # one_step: at most one version behind
    assert sum(trained - gen for *_, gen, trained in rows) > 0  # and drawn ahead, at least once
    assert not (run_dir / "inflight").exists()
    cores = {a["role"]: set(a["cores"]) for a in json.loads((run_dir / "placement.json").read_text())["actors"]}
    if len(os.sched_getaffinity(0)) > 1:
        assert cores["engine"] and cores["trainer"] and not cores["engine"] & cores["trainer"], cores
    assert wait_gone(started + placed_pids(run_dir)) == []
