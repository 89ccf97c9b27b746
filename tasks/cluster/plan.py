"""A dry run of a config's `cluster:` section: which actor lands on which node, what each GPU
holds, and a PlanError (one line, starting with the config field to change) where it cannot fit.
Pure (no Ray; the only I/O reads a model's config.json), so `rstar2 plan` answers in a second for
a cluster described by a string ("8x8x80"), by `ray.nodes()` or by the CLI's look at this machine.

Placement follows tasks/cluster/actors.py: ranks and engines packed in node order (rank 0 on node
0), an engine's tensor-parallel group on one node, sandbox replicas spread over the nodes offering
what they ask for; colocated on GPUs (trainer.gpus > 0), rank i and engine i share a GPU, half
each. Memory per GPU counts a rank's model states (as DeepSpeed's own estimators do), ZeRO-3's
gathered largest layer, the activations and logits of the largest micro-batch it trains on, and an
engine's share as vLLM budgets it: weights, KV cache, the activations of its profiling pass and
CUDA graphs, within gpu_memory_utilization of the GPU. A rank's terms are fitted to measured GPU
peaks of real trainer steps, whose update and optimizer step peak apart (bench/memory_bench.py,
docs/benchmarks.md); given the GPU class, the update time of an RL step at the measured rate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import groupby

from tasks.cluster.memory import (
    ENGINE_PARTS,
    ENGINE_PROFILE_TOKENS,
    ModelShape,
    PlanError,
    engine_memory,
    model_shape,
    trained_micro_batch,
    trainer_peak,
)
from tasks.cluster.throughput import MEASURED, update_seconds
from tasks.config import RunConfig

# The chunk a lever proposes: at a 150K vocabulary 4096 positions' logits take ~9 GiB at once.
LOGIT_CHUNK = 4096
DEFAULT_NODE_CPUS = 64  # a spec without cpus=: a typical 8-GPU node's logical CPUs
_EPS = 1e-9  # fractional CPUs: 0.1 * 3 must still fit in 0.3


@dataclass(frozen=True)
class Node:
    cpus: float
    gpus: int = 0
    gpu_memory_gib: float | None = None  # None: unknown, memory per GPU not checked
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources offered

    def offers(self) -> dict[str, float]:
        return {"CPU": self.cpus, "GPU": self.gpus, **self.resources}


@dataclass(frozen=True)
class Resources:
    nodes: tuple[Node, ...]
    source: str  # what described them: a spec, a Ray address, this machine

    @property
    def gpu_memory_gib(self) -> float | None:
        """The smallest GPU's memory (what a plan must fit); None where no GPU's is known."""
        return min((n.gpu_memory_gib for n in self.nodes if n.gpus and n.gpu_memory_gib), default=None)

    def describe(self) -> str:
        """'8 nodes x 8 GPUs (80 GiB), 64 CPUs + 2 nodes x 128 CPUs, cpu_node=4': runs of equal nodes."""
        runs = []
        for node, run in groupby(self.nodes):
            gib = f"{node.gpu_memory_gib:g} GiB" if node.gpu_memory_gib else "memory unknown"
            gpus = f"{node.gpus} GPU{'s' * (node.gpus > 1)} ({gib}), " if node.gpus else ""
            custom = "".join(f", {k}={v:g}" for k, v in node.resources.items())
            count = len(list(run))
            runs.append(f"{count} node{'s' * (count > 1)} x {gpus}{node.cpus:g} CPUs{custom}")
        return " + ".join(runs)


def parse_resources(spec: str) -> Resources:
    """'NODESxGPUSxGIB[:cpus=C,name=amount,...]', groups joined by '+'. '8x8x80' is 8 nodes of
    8 GPUs with 80 GiB each and 64 CPUs; '2x0:cpus=128,cpu_node=4' adds 2 CPU-only nodes of 128
    CPUs offering 4 of the custom resource cpu_node; 'NxG' leaves GPU memory unknown."""
    nodes: list[Node] = []
    for group in spec.split("+"):
        shape, _, options = group.strip().partition(":")
        try:
            count, gpus, *memory = (float(part) for part in shape.split("x"))
            extra = {k.strip(): float(v) for k, v in (o.split("=") for o in options.split(",") if o.strip())}
            if len(memory) > 1 or count < 1 or count != int(count) or gpus != int(gpus):
                raise ValueError
        except ValueError:
            raise PlanError(
                f"--resources: cannot read {group!r}; expected NODESxGPUSxGIB[:cpus=N,name=amount], e.g. 8x8x80"
            ) from None
        cpus = extra.pop("cpus", DEFAULT_NODE_CPUS)
        gib = memory[0] if memory and gpus else None
        nodes += [Node(cpus, int(gpus), gib, dict(extra)) for _ in range(int(count))]
    return Resources(tuple(nodes), f"--resources {spec}")


def resources_from_ray_nodes(nodes: list[dict], gpu_memory_gib: float | None = None, source: str = "ray") -> Resources:
    """`ray.nodes()` as Resources: live nodes only, custom resources without Ray's own (memory,
    object store, node:<ip>). Ray does not report GPU memory: pass it, or None to not check it."""
    builtin = {"CPU", "GPU", "memory", "object_store_memory"}
    out = [
        Node(float(r.get("CPU", 0)), int(r.get("GPU", 0)), gpu_memory_gib if r.get("GPU") else None,
             {k: v for k, v in r.items() if k not in builtin and not k.startswith("node:")})
        for r in (node.get("Resources", {}) for node in nodes if node.get("Alive", False))
    ]  # fmt: skip
    if not out:
        raise PlanError(f"cluster.address: {source} reports no live node")
    return Resources(tuple(out), source)


# ---------------------------------------------------------------- memory per GPU


def _trainer_load(cfg: RunConfig, shape: ModelShape, **changes) -> dict[str, float]:
    """A trainer rank's GPU at its peak, with `changes` to the trainer: section (a lever's)."""
    role = cfg.trainer.model_copy(update=changes)
    tokens = trained_micro_batch(cfg)[1]
    return trainer_peak(
        shape,
        cfg.model.dtype,
        role.zero_stage,
        role.ranks,
        tokens,
        role.gradient_checkpointing,
        role.logit_chunk_tokens,
    )


def _gpu_loads(cfg: RunConfig, shape: ModelShape, colocated: bool) -> dict[str, dict[str, float]]:
    """What each kind of GPU the plan uses holds: kind -> part -> GiB."""
    trainer, engine = _trainer_load(cfg, shape), engine_memory(cfg, shape)
    if colocated:
        return {"trainer+engine": trainer | engine}
    return ({"trainer": trainer} if cfg.trainer.gpus else {}) | ({"engine": engine} if cfg.engines.gpus else {})


def _biggest_lever(cfg: RunConfig, shape: ModelShape, parts: dict[str, float], over: float) -> tuple[str, str]:
    """The one field whose change frees the most memory on this GPU, and what to set it to."""
    levers = []
    if "kv cache" in parts:
        keep = parts["kv cache"] - over
        advice = f"at most {keep:.1f} GiB of KV cache fits" if keep > 0 else "it would not fit even with no KV cache"
        levers.append((parts["kv cache"], "engines.kv_cache_gib", advice))
    role, tp = cfg.trainer, cfg.engines.tensor_parallel_size
    if "optimizer" in parts:  # the trainer's: a higher ZeRO stage, more ranks, less held at once
        now = sum(_trainer_load(cfg, shape).values())
        changes = [
            ("trainer.zero_stage", {"zero_stage": 3}, "ZeRO-3"),
            ("trainer.ranks", {"ranks": 2 * role.ranks}, f"{2 * role.ranks} ranks"),
            ("trainer.gradient_checkpointing", {"gradient_checkpointing": True}, "true"),
            ("trainer.logit_chunk_tokens", {"logit_chunk_tokens": LOGIT_CHUNK}, f"{LOGIT_CHUNK}"),
        ]
        for name, change, label in changes:
            if all(getattr(role, field) != value for field, value in change.items()):
                saved = now - sum(_trainer_load(cfg, shape, **change).values())
                levers.append((saved, name, f"{label} would free {saved:.1f} GiB"))
    if "engine weights" in parts and cfg.cluster.placement == "split":
        saved = parts["engine weights"] / 2
        levers.append((saved, "engines.tensor_parallel_size", f"{2 * tp} would free {saved:.1f} GiB"))
    _, name, advice = max(levers)
    return name, advice


def _check_memory(cfg: RunConfig, shape: ModelShape, loads: dict, resources: Resources) -> None:
    """Every GPU within its memory, and an engine within the share vLLM may take of it."""
    capacity = resources.gpu_memory_gib
    if not capacity:
        return
    share = cfg.engines.gpu_memory_utilization * capacity
    for kind, parts in loads.items():
        breakdown = " + ".join(f"{gib:.1f} {part}" for part, gib in parts.items())
        engine = sum(gib for part, gib in parts.items() if part in ENGINE_PARTS)
        if "engine" in kind and engine > share:
            keep = parts["kv cache"] - (engine - share)
            advice = f"at most {keep:.1f} GiB of KV cache fits" if keep > 0 else "no KV cache fits"
            raise PlanError(
                f"engines.kv_cache_gib: an engine needs ~{engine:.1f} GiB, over the {share:.1f} GiB vLLM may take "
                f"(engines.gpu_memory_utilization {cfg.engines.gpu_memory_utilization:g} of {capacity:g}); {advice}"
            )
        total = sum(parts.values())
        if total > capacity:
            name, advice = _biggest_lever(cfg, shape, parts, total - capacity)
            raise PlanError(
                f"{name}: a {kind} GPU needs ~{total:.1f} GiB ({breakdown}), over its {capacity:g} GiB; {advice}"
            )


# ---------------------------------------------------------------- placement


@dataclass(frozen=True)
class Actor:
    role: str  # trainer, engine or sandbox
    index: int
    node: int
    cpus: float
    gpus: float  # what it asks Ray for (half a GPU each when colocated)
    gpu_ids: tuple[int, ...]  # the node's GPUs it runs on
    resources: dict[str, float]


@dataclass(frozen=True)
class Plan:
    actors: tuple[Actor, ...]
    loads: dict[str, dict[str, float]]  # kind of GPU -> part -> GiB
    resources: Resources
    summary: str
    notes: tuple[str, ...] = ()  # what the memory estimate assumed


ROLES = ("trainer", "engine", "sandbox")
NOUNS = {"ranks": "ranks", "count": "engines", "replicas": "replicas"}


@dataclass(frozen=True)
class _Ask:
    """One role's request: `count` actors, each needing `needs` ({"CPU": .., "GPU": whole GPUs, custom..})."""

    section: str  # trainer, engines, sandbox
    count_name: str  # ranks, count, replicas
    count: int
    needs: dict[str, float]


def _ask(section: str, count_name: str, count: int, cpus: float, gpus: int, custom: dict) -> _Ask:
    return _Ask(section, count_name, count, {"CPU": cpus, "GPU": gpus, **custom})


def _place(resources: Resources, free: list[dict], ask: _Ask, spread: bool) -> list[tuple[int, tuple[int, ...]]]:
    """Packed: each actor on the first node with room, so ranks 0..k share node 0. Spread: each on
    the next node with room after the previous one's, round the nodes. A node's GPUs go in order."""
    slots, start, count = [], 0, len(free)
    for index in range(ask.count):
        order = [(start + i) % count for i in range(count)] if spread else range(count)
        fits = (n for n in order if all(free[n].get(k, 0) + _EPS >= v for k, v in ask.needs.items() if v))
        node = next(fits, None)
        if node is None:
            what = ", ".join(f"{v:g} {k}" for k, v in ask.needs.items() if v)
            raise PlanError(
                f"{ask.section}.{ask.count_name}: actor {index} finds no node with {what} left "
                f"({index} of {ask.count} placed; an actor's GPUs never span nodes)"
            )
        first = resources.nodes[node].gpus - int(free[node]["GPU"])
        for key, value in ask.needs.items():
            free[node][key] = free[node].get(key, 0) - value
        slots.append((node, tuple(range(first, first + int(ask.needs["GPU"])))))
        start = node + 1
    return slots


def _check_totals(asks: list[_Ask], resources: Resources) -> None:
    """Refuse what the whole cluster cannot meet, before placing: GPUs, custom resources, CPUs."""
    have, offers = resources.describe(), [n.offers() for n in resources.nodes]
    for key in sorted({k for ask in asks for k in ask.needs}, key=lambda k: (k == "CPU", k != "GPU", k)):
        offered, need = sum(o.get(key, 0) for o in offers), 0.0
        for ask in (a for a in asks if a.needs.get(key)):
            each, unit = ask.needs[key], key + "s" * (key in ("CPU", "GPU"))
            if key not in ("GPU", "CPU") and not offered:
                raise PlanError(f"{ask.section}.resources: asks for {key}, which no node offers ({have})")
            beside = f" beside the {need:g} asked before" if need else ""
            need += ask.count * each
            if need > offered + _EPS:
                name = f"{ask.section}.cpus" if key == "CPU" else f"{ask.section}.{ask.count_name}"
                raise PlanError(
                    f"{name}: {ask.count} {NOUNS[ask.count_name]} x {each:g} {key} need {ask.count * each:g} {unit}"
                    f"{beside}, the cluster has {offered:g} ({have})"
                )


def _check_shape(cfg: RunConfig, shape: ModelShape, colocated: bool) -> None:
    tp = cfg.engines.tensor_parallel_size
    if shape.heads and shape.heads % tp:
        raise PlanError(f"engines.tensor_parallel_size: {tp} does not divide the model's {shape.heads} attention heads")
    if cfg.trainer.gpus > 1 or (cfg.trainer.gpus % 1 and not colocated):
        raise PlanError(f"trainer.gpus: a rank drives one GPU, a whole one when split (got {cfg.trainer.gpus:g})")
    if cfg.sandbox.gpus:
        raise PlanError(f"sandbox.gpus: sandbox replicas run programs on CPUs (got {cfg.sandbox.gpus:g})")
    if colocated:
        if tp != 1:
            raise PlanError(f"engines.tensor_parallel_size: colocated, each engine shares one rank's GPU (got {tp})")
        if cfg.engines.count != cfg.trainer.ranks:
            raise PlanError(
                f"engines.count: colocated, one engine per rank's GPU: {cfg.trainer.ranks}, not {cfg.engines.count}"
            )
        return
    if cfg.engines.gpus and cfg.engines.gpus != tp:
        raise PlanError(
            f"engines.gpus: an engine holds engines.tensor_parallel_size = {tp} GPUs, not {cfg.engines.gpus:g}"
        )


def build_plan(cfg: RunConfig, resources: Resources, gpu_class: str | None = None) -> Plan:
    """Place the config's actors on `resources` and estimate each GPU's memory (and, given the GPU
    class, an RL step's update time); PlanError if the plan cannot fit."""
    c = cfg.cluster
    colocated = c.placement == "colocated" and cfg.trainer.gpus > 0  # as tasks/cluster/actors.py decides
    shape = model_shape(cfg)
    _check_shape(cfg, shape, colocated)
    loads = _gpu_loads(cfg, shape, colocated)
    _check_memory(cfg, shape, loads, resources)
    if colocated:  # one bundle per GPU: a rank and its engine, their CPUs and resources together
        both = dict(Counter(cfg.trainer.resources) + Counter(cfg.engines.resources))
        roles = [_ask("trainer", "ranks", cfg.trainer.ranks, cfg.trainer.cpus + cfg.engines.cpus, 1, both)]
    else:
        engine_gpus = cfg.engines.tensor_parallel_size if cfg.engines.gpus else 0
        roles = [
            _ask("trainer", "ranks", cfg.trainer.ranks, cfg.trainer.cpus, int(cfg.trainer.gpus), cfg.trainer.resources),
            _ask("engines", "count", cfg.engines.count, cfg.engines.cpus, engine_gpus, cfg.engines.resources),
        ]
    sandbox = _ask("sandbox", "replicas", cfg.sandbox.replicas, cfg.sandbox.cpus, 0, cfg.sandbox.resources)
    _check_totals([*roles, sandbox], resources)
    free = [n.offers() for n in resources.nodes]
    slots = [_place(resources, free, ask, spread=False) for ask in roles]
    slots = [slots[0], slots[0]] if colocated else slots  # engine i beside rank i
    actors = []
    for role, spec, placed in zip(("trainer", "engine"), (cfg.trainer, cfg.engines), slots):
        actors += [
            Actor(role, i, node, spec.cpus, 0.5 if colocated else len(gpus), gpus, spec.resources)
            for i, (node, gpus) in enumerate(placed)
        ]
    actors += [
        Actor("sandbox", i, node, cfg.sandbox.cpus, 0, (), cfg.sandbox.resources)
        for i, (node, _) in enumerate(_place(resources, free, sandbox, spread=True))
    ]
    size = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9 else f"{shape.params / 1e6:.1f}M"
    summary = (
        f"{cfg.name}: {size} parameters ({shape.source}), {cfg.model.dtype}; "
        f"{c.placement if loads else 'CPUs only'}: trainer ranks {cfg.trainer.ranks} (ZeRO-{cfg.trainer.zero_stage}), "
        f"engines {cfg.engines.count} (TP {cfg.engines.tensor_parallel_size}), sandbox replicas {cfg.sandbox.replicas}"
    )
    phase, tokens = trained_micro_batch(cfg)
    checkpointing = "on" if cfg.trainer.gradient_checkpointing else "off"
    chunk = cfg.trainer.logit_chunk_tokens
    notes = (
        f"activations, logits: the largest micro-batch trained, {phase}'s {tokens} tokens "
        f"(trainer.gradient_checkpointing {checkpointing}, logits of "
        f"{f'{chunk} positions at a time' if chunk else 'every position at once'}); a trainer's GPU peaks in "
        "its update (activations, logits) or in its optimizer step (fp32 grads, step buffers), whichever holds more",
        f"an engine may take engines.gpu_memory_utilization {cfg.engines.gpu_memory_utilization:g} of its GPU; "
        f"its activations: a {ENGINE_PROFILE_TOKENS}-token profiling pass",
    )
    if loads and cfg.rl.stages:
        notes += (_update_note(cfg, shape, gpu_class),)
    return Plan(tuple(actors), loads, resources, summary, notes)


def _update_note(cfg: RunConfig, shape: ModelShape, gpu_class: str | None) -> str:
    if gpu_class not in MEASURED:
        return f"update time per RL step: give --gpu-class, one of the measured {', '.join(MEASURED)}"
    seconds, tokens, rate = update_seconds(cfg, shape.params, gpu_class)
    per_token = "8N (checkpointing)" if cfg.trainer.gradient_checkpointing else "6N"
    return (
        f"update time per RL step: at most {seconds:.0f} s ({tokens / 1e6:.1f}M trained tokens x {per_token} "
        f"FLOPs over {cfg.trainer.ranks} ranks at {rate.tflops:g} TFLOP/s each, measured: {rate.source})"
    )


# ---------------------------------------------------------------- the printed plan


def _span(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs = [[i for _, i in run] for _, run in groupby(enumerate(indices), key=lambda pair: pair[1] - pair[0])]
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_plan(plan: Plan) -> str:
    """The plan as text: actors (a run of one role on one node per line), then memory per GPU."""
    lines = [f"plan  {plan.summary}", f"on    {plan.resources.describe()}  [{plan.resources.source}]", ""]
    rows = [["actors", "node", "cpus each", "gpus each", "node GPUs", "resources each"]]
    same = lambda a: (a.role, a.node, a.cpus, a.gpus, tuple(a.resources.items()))  # noqa: E731
    in_node_order = sorted(plan.actors, key=lambda a: (a.node, ROLES.index(a.role), a.index))
    for (role, node, cpus, gpus, custom), run in groupby(in_node_order, key=same):
        run = list(run)
        ids = sorted({g for a in run for g in a.gpu_ids})
        resources = ", ".join(f"{k}={v:g}" for k, v in custom)
        rows.append(
            [f"{role} {_span([a.index for a in run])}", str(node), f"{cpus:g}", f"{gpus:g}", _span(ids), resources]
        )
    lines += _table(rows)
    if not plan.loads:
        return "\n".join([*lines, "", "no GPUs: memory per GPU not estimated"])
    gib = plan.resources.gpu_memory_gib
    kinds = list(plan.loads)
    gpus = [len({(a.node, g) for a in plan.actors if a.role in kind for g in a.gpu_ids}) for kind in kinds]
    rows = [["GiB per GPU", *(f"{kind} ({n} GPUs)" for kind, n in zip(kinds, gpus))]]
    for part in dict.fromkeys(part for load in plan.loads.values() for part in load):
        rows.append([part, *(f"{plan.loads[kind][part]:.2f}" if part in plan.loads[kind] else "-" for kind in kinds)])
    rows.append(["total", *(f"{sum(plan.loads[kind].values()):.2f}" for kind in kinds)])
    rows.append(["of", *([f"{gib:g}" if gib else "unknown (not checked)"] * len(kinds))])
    lines += ["", "memory per GPU (a trainer rank's share of weights, grads and optimizer)"]
    return "\n".join(lines + _table(rows) + [f"  {note}" for note in plan.notes])
