"""The run's actors, placed by placement groups: trainer ranks, engines, sandbox replicas.

One placement group per role (colocated GPUs: one bundle per GPU shared by a rank and an
engine), each waited for with a timeout: a request the cluster cannot meet fails with the
resources it asked for instead of pending forever. Bundles are taken in node order, so ranks
0..k share a node and an engine's tensor-parallel GPUs (one bundle) never span two nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tasks.cluster.engines import EngineActor
from tasks.cluster.sandboxes import SandboxActor
from tasks.cluster.trainers import TrainerActor
from tasks.config import RunConfig
from tasks.config.roles import ActorResources, SandboxConfig
from tasks.sandbox.limits import Limits

ENGINE_CONCURRENCY = 4  # a take waiting for turns, requests arriving, a control call


def _bundle(spec: ActorResources, gpus: float, cpus: float | None = None) -> dict[str, float]:
    bundle = {"CPU": spec.cpus if cpus is None else cpus, "GPU": gpus, **spec.resources}
    return {key: value for key, value in bundle.items() if value}


def sandbox_limits(box: SandboxConfig) -> Limits:
    """A replica's limits on each program, from the config's sandbox section."""
    return Limits(
        timeout_s=box.program_timeout_s,
        cpu_s=max(1, int(box.program_timeout_s)),
        memory_mb=box.memory_mb,
        output_bytes=box.output_bytes,
    )


def _in_node_order(pg) -> list[int]:
    """Bundle indices grouped by the node each landed on (nodes in order of first bundle)."""
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    first = {}
    for index in sorted(nodes):
        first.setdefault(nodes[index], index)
    return sorted(nodes, key=lambda index: (first[nodes[index]], index))


@dataclass
class Placement:
    """Placement groups and the actors in them; `stop` kills the actors and frees the groups."""

    groups: list = field(default_factory=list)
    ranks: list = field(default_factory=list)
    engines: list = field(default_factory=list)
    sandboxes: list = field(default_factory=list)

    def _group(self, bundles: list[dict], strategy: str, role: str, timeout_s: float):
        pg = placement_group(bundles, strategy=strategy, name=role)
        self.groups.append(pg)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"cluster: the {role} placement group ({len(bundles)} x {bundles[0]}) was not placed within "
                f"{timeout_s:.0f} s: the cluster lacks these resources (see `rstar2 plan`)"
            ) from None
        return pg

    @staticmethod
    def _at(pg, bundle: int, spec: ActorResources, gpus: float, **options) -> dict:
        return {
            "num_cpus": spec.cpus,
            "num_gpus": gpus,
            "resources": dict(spec.resources),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
            **options,
        }

    def start(
        self, cfg: RunConfig, model_dir: Path, run_dir: Path, sandbox_token: str | None, loopback: bool
    ) -> Placement:
        """The run's actors. Sandbox replicas only with `sandbox_token` (the credential their calls
        carry; None where `sandbox.urls` names running services), on loopback with `loopback`."""
        c = cfg.cluster
        timeout = c.startup_timeout_s
        colocated = c.placement == "colocated" and cfg.trainer.gpus > 0
        if colocated:
            # One GPU per bundle, half of it to the rank and half to the engine beside it.
            shared = _bundle(cfg.trainer, 1, cfg.trainer.cpus + cfg.engines.cpus)
            for name, amount in cfg.engines.resources.items():
                shared[name] = shared.get(name, 0) + amount
            pg = self._group([shared] * cfg.trainer.ranks, "PACK", "trainer+engines", timeout)
            rank_slots = engine_slots = [(pg, b) for b in _in_node_order(pg)]
            rank_gpus = engine_gpus = 0.5
        else:
            pg = self._group([_bundle(cfg.trainer, cfg.trainer.gpus)] * cfg.trainer.ranks, "PACK", "trainer", timeout)
            rank_slots = [(pg, b) for b in _in_node_order(pg)]
            pg = self._group([_bundle(cfg.engines, cfg.engines.gpus)] * cfg.engines.count, "PACK", "engines", timeout)
            engine_slots = [(pg, b) for b in _in_node_order(pg)]
            rank_gpus, engine_gpus = cfg.trainer.gpus, cfg.engines.gpus
        # Split on CPU: the engines and the trainer on cores of their own (rollouts overlap updates
        # under rl.async); the sandbox and the driver run where the OS puts them.
        split = cfg.engines.count * cfg.engines.threads if c.placement == "split" and not cfg.trainer.gpus else 0
        rank_actor = ray.remote(TrainerActor)
        self.ranks = [
            rank_actor.options(**self._at(pg, b, cfg.trainer, rank_gpus)).remote(rank, cfg.trainer.ranks, split)
            for rank, (pg, b) in enumerate(rank_slots)
        ]
        engine_actor = ray.remote(EngineActor)
        pin_engines = cfg.engines.count > 1 or bool(split)
        engine_cfg = cfg.engines.model_dump()
        self.engines = [
            engine_actor.options(
                **self._at(pg, b, cfg.engines, engine_gpus),
                max_concurrency=ENGINE_CONCURRENCY,
                max_restarts=cfg.engines.max_restarts,
            ).remote(index, str(model_dir), engine_cfg, cfg.seed + index, cfg.model.dtype, pin_engines, split)
            for index, (pg, b) in enumerate(engine_slots[: cfg.engines.count])
        ]
        if sandbox_token is not None:
            box = cfg.sandbox
            pg = self._group([_bundle(box, 0)] * box.replicas, "SPREAD", "sandbox", timeout)
            replica = ray.remote(SandboxActor)
            self.sandboxes = [
                replica.options(**self._at(pg, b, box, 0), max_restarts=box.max_restarts).remote(
                    index, box.workers, sandbox_limits(box), str(run_dir / "logs"), sandbox_token, loopback
                )
                for index, b in enumerate(_in_node_order(pg))
            ]
        return self

    def where(self, timeout_s: float) -> list[dict]:
        """Each actor's role, index, node and pid, as it reports them."""
        actors = self.ranks + self.engines + self.sandboxes
        return ray.get([actor.where.remote() for actor in actors], timeout=timeout_s)

    def stop(self) -> None:
        for actor in self.ranks + self.engines + self.sandboxes:
            ray.kill(actor)
        self.ranks, self.engines, self.sandboxes = [], [], []
        for pg in self.groups:
            remove_placement_group(pg)
        self.groups = []


def placement_table(where: list[dict]) -> str:
    """The placement as printed at the start of a run: one line per actor."""
    lines = ["placement (actor -> node):"]
    for row in where:
        gpus = f" gpus {','.join(row['gpu_ids'])}" if row["gpu_ids"] else ""
        node = f"node {row['node_id'][:12]} ({row['node_ip']})"
        asked = ", ".join(f"{name} {amount:g}" for name, amount in sorted(row["resources"].items()))
        lines.append(f"  {row['role']:<8}{row['index']:>3} -> {node} pid {row['pid']}{gpus} ({asked})")
    return "\n".join(lines)
