"""The resources a run of a config would get, for `rstar2 plan` and the check before a run: the
running cluster at `cluster.address` (or $RAY_ADDRESS), or this machine as the local Ray a run
starts would see it. Imports Ray (and torch) only to ask a running cluster, torch only where a GPU
device exists: planning a laptop run takes a second.
"""

from __future__ import annotations

import glob
import os
import socket

from tasks.cluster.memory import GIB
from tasks.cluster.plan import Node, PlanError, Resources, resources_from_ray_nodes
from tasks.config.cluster import ClusterConfig

CONNECT_TIMEOUT_S = 5.0


def local_resources(num_cpus: float | None) -> Resources:
    """This machine as the local Ray a run starts would see it: the cores this process may use
    (or cluster.num_cpus) and its GPUs."""
    cpus = num_cpus or len(os.sched_getaffinity(0))
    gpus, memory = 0, None
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"):
        import torch

        if torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus)) / GIB
    return Resources((Node(cpus, gpus, memory),), "this machine")


def expect_listener(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """PlanError unless something accepts a connection at the address's host:port: Ray itself
    retries an unreachable GCS for minutes before it gives up. "auto" is left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise PlanError(f"cluster.address: no Ray cluster answers at {address} ({exc})") from None


def run_resources(cluster: ClusterConfig, gpu_memory_gib: float | None = None) -> Resources:
    """What a run with this `cluster:` section would be placed on. Ray does not report GPU memory:
    `gpu_memory_gib` for a running cluster, or None to not check it there."""
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    if not address:
        return local_resources(cluster.num_cpus)
    expect_listener(address)
    from tasks.cluster.connect import cluster_nodes

    return resources_from_ray_nodes(cluster_nodes(address), gpu_memory_gib, f"Ray at {address}")
