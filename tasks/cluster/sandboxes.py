"""Sandbox replicas as Ray actors: each runs the project's sandbox service on its node, and the
rollout's client spreads calls over their URLs (least in flight). On a cluster a replica listens
on its node's address, on a laptop on loopback; either way every call must carry the run's
credential, which the driver hands to the replicas (never to logs, MLflow or placement.json)."""

from __future__ import annotations

from pathlib import Path

import ray

from tasks.cluster.connect import node_address, placement_record
from tasks.sandbox.limits import Limits
from tasks.sandbox.server import SandboxService


class SandboxActor:
    """The body of a replica actor. The service's process stops with the actor (it watches its
    parent), so a replica killed with its node leaves no server behind; Ray restarts a killed
    actor (sandbox.max_restarts), and the actor starts its service again, on the same
    port, if the service alone died."""

    def __init__(self, index: int, workers: int, limits: Limits, log_dir: str, token: str, loopback: bool):
        self.index = index
        log_path = Path(log_dir) / f"sandbox-{index}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        host = "127.0.0.1" if loopback else node_address()
        self.service = SandboxService(host=host, workers=workers, limits=limits, log_path=log_path, token=token)
        self.service.start()

    def url(self) -> str:
        """Where the service answers; started again first if it died."""
        if not self.service.alive:
            self.service.stop()
            self.service.start()
        return self.service.url

    def where(self) -> dict:
        return placement_record("sandbox", self.index) | {"url": self.service.url, "server_pid": self.service.pid}

    def stop(self) -> None:
        self.service.stop()


class SandboxGroup:
    def __init__(self, actors: list, timeout_s: float):
        self.actors = actors
        self.urls: list[str] = ray.get([a.url.remote() for a in actors], timeout=timeout_s)

    def resolve(self, index: int, timeout_s: float = 5.0) -> str | None:
        """Replica `index`'s URL now (a restarted replica has a new one); None while it is not up."""
        try:
            return ray.get(self.actors[index].url.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            return None

    def stop(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # already gone: its service saw its parent go and stopped itself
            ray.kill(actor, no_restart=True)
        self.actors = []
