"""Connect to the Ray cluster a run names, or start a local one sized to this machine.

`cluster.address` (or $RAY_ADDRESS) names a running cluster; without one the run starts a local
Ray on 127.0.0.1 only (nothing listens on the machine's network address), with this machine's
cores as logical CPUs and no dashboard unless asked, and stops it at the end. A process that is
already connected (a test's cluster) is used as it is and left running.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import ray
import torch

from tasks.cluster.plan import PlanError
from tasks.config.cluster import ClusterConfig
from tasks.config.environment import LOCAL_ONLY
from tasks.rollout.engine import available_cores

_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def worker_env() -> dict[str, str]:
    """What every actor process needs before it imports torch, vLLM or DeepSpeed."""
    env = {
        **{key: os.environ.get(key, value) for key, value in LOCAL_ONLY.items()},
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # vLLM's multiprocessing executor cannot start its worker inside an actor.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
    }
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    return env


class RayCluster:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.owned = False  # this object connected (or started Ray) and disconnects at stop()
        self.local = False  # a local Ray this object started

    @property
    def address(self) -> str | None:
        return self.cfg.address or os.environ.get("RAY_ADDRESS")

    def start(self) -> RayCluster:
        if ray.is_initialized():
            return self
        with _sigterm_handler_kept():
            self._connect()
        self.owned = True
        return self

    def _connect(self) -> None:
        if self.address:
            ray.init(address=self.address, runtime_env={"env_vars": worker_env()}, log_to_driver=True)
        else:
            ray.init(  # on 127.0.0.1: see tasks/cluster/__init__.py
                # "local": a new Ray, never one that `ray start` (or a test) left in /tmp/ray
                address="local",
                num_cpus=self.cfg.num_cpus or len(available_cores()),
                include_dashboard=self.cfg.dashboard,
                _node_ip_address="127.0.0.1",
                runtime_env={"env_vars": worker_env()},
                log_to_driver=True,
            )
            self.local = True

    def nodes(self) -> list[dict]:
        return live_nodes()

    def stop(self) -> None:
        if self.owned:
            ray.shutdown()  # a local Ray's processes stop with it; a cluster's keep running
            self.owned = self.local = False

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def _sigterm_handler_kept():
    """ray.init makes SIGTERM exit the driver from wherever it lands (sys.exit), inside Ray's own
    calls too; a run keeps the handler it had (Prefect's, which ends a flow run as a crash, or the
    CLI's), so that a SIGTERM stops the run and its actors rather than look like a fault."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def interrupt_behind(exc: BaseException) -> BaseException | None:
    """The interrupt (a signal's exception, KeyboardInterrupt, SystemExit: none an Exception) that
    `exc` stands for, if any: one raised by a signal handler while Ray's compiled code ran comes out
    as a SystemError ("returned a result with an exception set"), which a retry would take for a
    fault."""
    seen = exc
    while seen is not None:
        if not isinstance(seen, Exception):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def node_address() -> str:
    """The address of the node this process runs on, as its raylet was started with."""
    node_id = ray.get_runtime_context().get_node_id()
    return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)


def placement_record(role: str, index: int) -> dict:
    """Where this actor runs: what the run prints and logs as its placement."""
    context = ray.get_runtime_context()
    return {
        "role": role,
        "index": index,
        "node_id": context.get_node_id(),
        "node_ip": node_address(),
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "cores": available_cores(),  # the CPU cores it may run on (split placement binds them)
        # What Ray granted (placement-group resources carry the group's id in their names).
        "resources": {name.split("_group_")[0]: amount for name, amount in context.get_assigned_resources().items()},
    }


def live_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def cluster_nodes(address: str) -> list[dict]:
    """The live nodes of a running cluster, for `rstar2 plan` and the check before a run; connects
    and disconnects. A process already connected is asked as it is (a run uses that cluster)."""
    if ray.is_initialized():
        return live_nodes()
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise PlanError(f"cluster.address: no Ray cluster answers at {address} ({exc})") from None
    try:
        return live_nodes()
    finally:
        ray.shutdown()
