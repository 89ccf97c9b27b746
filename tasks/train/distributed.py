"""The trainer's process group: the one a launcher set up, or one of its own."""

from __future__ import annotations

import logging
import os
import socket

import torch


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_distributed() -> None:
    """A single-process group unless a launcher (torchrun, deepspeed) already set one up."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    inherited = os.environ.get("RSTAR2_OWN_GROUP_PORT")
    if "WORLD_SIZE" not in os.environ or (inherited and inherited == os.environ.get("MASTER_PORT")):
        # Our own one-process group. Child processes inherit these variables; the marker (the
        # port we chose) tells a child that no launcher set them (a launcher such as torchrun
        # sets its own port), so it takes a port of its own instead of its parent's, which the
        # parent may still listen on.
        port = str(free_port())
        os.environ.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_PORT": port,
                "RSTAR2_OWN_GROUP_PORT": port,
            }
        )
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.utils.logger.setLevel(logging.WARNING)
    world = groups._WORLD_GROUP
    if not torch.distributed.is_initialized() or (
        world is not None and world not in torch.distributed.distributed_c10d._world.pg_map
    ):
        # A vLLM engine shut down in this process destroys every process group, which DeepSpeed
        # still holds as its world and data-parallel groups (and the next engine of the same
        # process, e.g. the next run of an ablation, creates new ones): drop those references.
        groups._release_process_group_references(None)
    deepspeed.init_distributed()
