"""Two hosts with addresses of their own: network namespaces joined by a veth pair, private
addresses that exist only inside them, `ray start` on each with token auth, as a user would.
Host A (the head) offers `gpu_node` and runs the trainer ranks, the engines and the driver; host B
offers `cpu_node` and runs the sandbox replicas.

- A run driven through RAY_ADDRESS (tests/test_two_nodes.py drives its runs through
  `cluster.address`), with an engine and a sandbox replica SIGKILLed mid-step: the tables an
  uninterrupted run writes (every part, every row once, every group whole), the engine back and
  serving within the stage, and from host A a call to a replica on host B without the run's
  credential answered 401, its program never run.
- Afterwards the namespaces, every Ray process and every actor are gone: each process in a
  namespace the test made is killed by pid (`ray stop` would kill every Ray on the machine).

Needs root (network namespaces); skipped without. Run: .venv/bin/python -m pytest -q -s
tests/test_two_hosts.py   (about 3 minutes)
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.processes import alive, placed_pids, wait_busy, wait_for, wait_gone, wait_until
from tests.small_run import run_command, small_run, stage
from tests.test_resume_pipeline import table_parts
from tests.test_two_nodes import group_sizes, placed, step_metric

pytestmark = pytest.mark.slow  # starts engines or trains

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).parent / "ray"
# Long enough for a killed engine to come back within the stage with room to spare: its restart
# (a new worker, vLLM's import, the engine built) took 5 steps of ~2 s on the machine the suite
# was written on and 9 on CI's; a 2x margin over CI's.
STEPS = 18


def kill_sandbox_and_engine(run_dir: Path, rng: random.Random, log: list) -> None:
    """Sandbox replica 0 (actor and server, as when its node goes) as the RL stage begins, then
    engine 1 while it generates step 0's rollouts."""
    wait_for(run_dir / "state" / "eval-sft.json")
    replica = placed(run_dir, "sandbox", 0)
    for pid in (replica["pid"], replica["server_pid"]):
        os.kill(pid, signal.SIGKILL)
    log.append("sandbox 0")
    engine = placed(run_dir, "engine", 1)["pid"]
    wait_busy(engine)
    time.sleep(rng.uniform(0, 0.3))
    os.kill(engine, signal.SIGKILL)
    log.append("engine 1")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespace_pids(name: str) -> list[int]:
    return [int(pid) for pid in ip("netns", "pids", name, check=False).stdout.split()]


class Hosts:
    """Two namespaces, a veth pair between them, and a Ray node started in each."""

    def __init__(self, workdir: Path):
        tag = f"{os.getpid() % 100000}"
        self.subnet = random.Random(tag).randrange(1, 250)
        self.names = (f"rstar2-a{tag}", f"rstar2-b{tag}")
        self.addresses = (f"10.250.{self.subnet}.1", f"10.250.{self.subnet}.2")
        self.workdir = workdir
        # Ray's session folder: short, for its sockets (an AF_UNIX path holds 107 bytes at most).
        self.ray_dir = Path(tempfile.mkdtemp(prefix="r2h-", dir="/tmp"))
        # Token auth as a user sets it up: one token, given to every node and to the driver.
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.env.pop("RAY_ADDRESS", None)
        # Set for this process's local Rays (tasks/cluster/__init__.py: loopback only); hosts with
        # addresses of their own form a real multi-node cluster.
        self.env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)

    @property
    def head(self) -> str:
        return f"{self.addresses[0]}:6379"

    def exec(self, host: int, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *command]

    def up(self) -> Hosts:
        a, b = self.names
        veth = (f"va{self.names[0][-5:]}", f"vb{self.names[0][-5:]}")
        for name in self.names:
            ip("netns", "add", name)
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for name, dev, address in zip(self.names, veth, self.addresses):
            ip("link", "set", dev, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", dev)
            ip("-n", name, "link", "set", dev, "up")
            ip("-n", name, "link", "set", "lo", "up")
        common = ["--block", "--disable-usage-stats"]
        self.ray = [
            subprocess.Popen(
                self.exec(0, [str(RAY), "start", "--head", f"--node-ip-address={self.addresses[0]}", "--port=6379",
                              "--num-cpus=3", '--resources={"gpu_node": 4}', "--include-dashboard=false",
                              f"--temp-dir={self.ray_dir}", *common]),
                env=self.env, stdout=open(self.workdir / "host-a.log", "w"), stderr=subprocess.STDOUT,
            )
        ]  # fmt: skip
        self.wait_nodes(1)
        self.ray.append(
            subprocess.Popen(
                self.exec(1, [str(RAY), "start", f"--address={self.head}", f"--node-ip-address={self.addresses[1]}",
                              "--num-cpus=2", '--resources={"cpu_node": 2}', *common]),
                env=self.env, stdout=open(self.workdir / "host-b.log", "w"), stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        self.wait_nodes(2)
        return self

    def wait_nodes(self, count: int, timeout_s: float = 120) -> None:
        probe = (
            f"import ray; ray.init(address={self.head!r}, log_to_driver=False); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(
                self.exec(0, [sys.executable, "-c", probe]), env=self.env, capture_output=True, text=True
            )
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(2)
        raise TimeoutError(f"{count} Ray nodes never joined at {self.head}")

    def pids(self) -> list[int]:
        return [pid for name in self.names for pid in namespace_pids(name)]

    def down(self) -> list[int]:
        """Kill every process in the namespaces (all of them started here), then delete them;
        returns the pids still alive."""
        pids = self.pids() + [p.pid for p in getattr(self, "ray", [])]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in getattr(self, "ray", []):
            process.wait(timeout=30)
        left = wait_gone(pids)
        for name in self.names:
            ip("netns", "del", name, check=False)
        shutil.rmtree(self.ray_dir, ignore_errors=True)
        return left


def run(hosts: Hosts, run_id: str, overrides: dict) -> tuple[Path, str]:
    """A run driven from host A, the cluster named by RAY_ADDRESS."""
    env = {**hosts.env, "RAY_ADDRESS": hosts.head}
    out = subprocess.run(
        hosts.exec(0, run_command(run_id, overrides)), env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return Path(overrides["output_dir"]) / "runs" / run_id, out.stdout + out.stderr


def refused_without_credential(hosts: Hosts, run_dir: Path, marker: Path) -> int:
    """From host A, a program posted to sandbox replica 0 on host B with no credential: the HTTP
    status it gets (the program would create `marker`)."""
    wait_for(run_dir / "logs" / "sandbox-0.log")
    wait_until(lambda: "sandbox on http" in (run_dir / "logs" / "sandbox-0.log").read_text(), "replica 0", 120)
    line = next(x for x in (run_dir / "logs" / "sandbox-0.log").read_text().splitlines() if "sandbox on http" in x)
    url = line.split()[2].rstrip(":")
    assert url.startswith(f"http://{hosts.addresses[1]}:"), line  # the replica listens on host B's address
    body = json.dumps({"code": f"open({str(marker)!r}, 'w').write('ran')", "input": ""})
    post = (  # retried while the replica, which logs its address first, is not yet listening
        "import time, urllib.request, urllib.error\n"
        f"request = urllib.request.Request({url + '/execute'!r}, data={body!r}.encode(), "
        "headers={'Content-Type': 'application/json'})\n"
        "for attempt in range(60):\n"
        "    try:\n        print(urllib.request.urlopen(request, timeout=10).status); break\n"
        "    except urllib.error.HTTPError as error:\n        print(error.code); break\n"
        "    except urllib.error.URLError:\n        time.sleep(0.5)\n"
    )
    out = subprocess.run(hosts.exec(0, [sys.executable, "-c", post]), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip())


def kill_replica_and_engine(hosts: Hosts, run_dir: Path, marker: Path, log: list) -> None:
    log.append(("401", refused_without_credential(hosts, run_dir, marker)))
    kill_sandbox_and_engine(run_dir, random.Random("two-hosts"), log)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    workdir = tmp_path_factory.mktemp("two-hosts")
    hosts = Hosts(workdir)
    overrides = {
        **small_run([stage("stage1", STEPS)]),
        "output_dir": str(workdir / "out"),
        "eval.base": False,
        "rl.roc.drop_zero_signal": False,  # every step trains, checkpoints and syncs
        "trainer.ranks": 2, "trainer.cpus": 1, "trainer.resources": {"gpu_node": 1},
        "engines.count": 2, "engines.cpus": 0.5, "engines.resources": {"gpu_node": 1},
        "sandbox.replicas": 2, "sandbox.cpus": 0.5, "sandbox.workers": 1, "sandbox.resources": {"cpu_node": 1},
    }  # fmt: skip
    result = {"hosts": hosts, "log": []}
    try:
        started = time.monotonic()
        hosts.up()
        result["ray_pids"] = hosts.pids()
        marker = workdir / "ran-without-credential"
        faults_dir = workdir / "out" / "runs" / "faults"
        injector = threading.Thread(
            target=kill_replica_and_engine, args=(hosts, faults_dir, marker, result["log"]), daemon=True
        )
        injector.start()
        result["faults"], result["output"] = run(hosts, "faults", overrides)
        injector.join(timeout=10)
        result["marker"] = marker
        result["overrides"] = overrides
        result["actor_pids"] = placed_pids(faults_dir)
        result["actors_left"] = wait_gone(result["actor_pids"])
        result["seconds"] = time.monotonic() - started
    finally:
        result["left"] = hosts.down()
    print(f"two hosts: {result.get('seconds', 0):.0f} s for Ray on both hosts and the run")
    return result


def test_the_run_on_two_hosts_places_each_role_on_its_host(runs):
    hosts = runs["hosts"]
    actors = json.loads((runs["faults"] / "placement.json").read_text())["actors"]
    where = {(a["role"], a["node_ip"]) for a in actors}
    a, b = hosts.addresses
    assert where == {("trainer", a), ("engine", a), ("sandbox", b)}


def test_a_call_from_the_other_host_without_the_credential_is_refused_and_runs_nothing(runs):
    assert runs["log"][0] == ("401", 401)
    assert not runs["marker"].exists()


def test_an_engine_and_a_replica_killed_mid_step_leave_the_tables_as_uninterrupted(runs):
    assert runs["log"][1:] == ["sandbox 0", "engine 1"]
    faults, small = runs["faults"], runs["overrides"]
    # What an uninterrupted run writes: problems x 2G rollouts a step, the held-out problems x k
    # an evaluation, each row once (rows = unique keys), every group whole, every step recorded.
    drawn, group = 2 * 2 * small["rl.group_size"], 2 * small["rl.group_size"]
    evaluated = pq.read_metadata(faults / "data" / "heldout.parquet").num_rows * small["eval.k"]
    assert table_parts(faults, "rollouts") == {
        **{("stage1", step): (drawn, drawn) for step in range(STEPS)},
        **{(f"eval-{c}", 0): (evaluated, evaluated) for c in ("sft", "stage1")},
    }
    assert set(group_sizes(faults).values()) == {group, small["eval.k"]}
    assert table_parts(faults, "steps").keys() == {("stage1", step) for step in range(STEPS)}
    deaths, requeued = step_metric(faults, "engine_deaths"), step_metric(faults, "requeued_rollouts")
    assert sum(deaths.values()) == 1
    # The death counts in the step that found it: step 0 when it fell while step 0 generated (its
    # rollouts then went to the other engine), step 1 when it fell as step 0's generation ended.
    assert deaths[1] == 1.0 or requeued[0] > 0
    # Ray restarted the replica, and an outage is never counted against the model.
    assert (faults / "logs" / "sandbox-0.log").read_text().count("sandbox on http") == 2
    assert set(step_metric(faults, "tool_internal").values()) == {0.0}


def test_the_killed_engine_comes_back_and_serves_within_the_stage(runs):
    faults = runs["faults"]
    restarts = step_metric(faults, "engine_restarts")
    print(f"engine deaths by step {step_metric(faults, 'engine_deaths')}, restarts by step {restarts}")
    assert sum(restarts.values()) >= 1, restarts
    back = min(step for step, n in restarts.items() if n)
    assert back < STEPS - 1  # steps after its return ran with it serving: no further death
    deaths = step_metric(faults, "engine_deaths")
    assert all(deaths[step] == 0 for step in range(back, STEPS)), deaths


def test_nothing_it_started_is_left(runs):
    assert runs["actors_left"] == []  # the runs' actors were gone once each run ended
    assert runs["left"] == []  # every Ray process on both hosts
    assert all(not alive(pid) for pid in runs["ray_pids"])
    listed = ip("netns", "list").stdout
    assert not any(name in listed for name in runs["hosts"].names)
