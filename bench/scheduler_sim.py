"""Discrete-event simulation of one paper-scale RL step's rollouts: KV-aware vs static scheduling.

Four policies: static (the baseline), kv_aware (the paper's: each rollout reserves its full
length of KV), kv_observed (KV-aware, each rollout reserving `--kv-headroom` x the mean size of
a previous step's rollouts, drawn from the same distribution) and kv_live (the observed reserve
or each rollout's live size, whichever is more, up to `--overcommit` x each engine's cache).

64 engines, 512 prompts x 32 rollouts, heavy-tailed multi-turn rollouts with tool calls whose
latencies are drawn from measured sandbox latencies. Every run uses the scheduler code of the
real rollout loop (tasks/rollout/scheduler.py) on the same sampled rollouts; only the engine is
modelled. For each KV-cache size (a sweep: how much memory the engines get depends on the
model, the GPU and on what shares it, e.g. a colocated trainer) prints makespan, engine idle
fraction, preemptions (running rollouts evicted from the KV cache, recomputed later) and
prefix evictions (a rollout waiting on its tool lost its cached KV and recomputes it on its
next turn), and recomputed tokens.

The engine model, one vLLM engine per GPU (assumptions, with where the numbers come from):
- KV cache: Qwen3-14B in bf16 keeps 40 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes =
  160 KiB per token; ~140 GB of an MI300X's 192 GB after the 28 GB of weights -> 850K tokens;
  the 64 GiB that configs/qwen3-14b-paper.yaml gives an engine (`engines.kv_cache_gib`) -> 419,430.
- A decode step costs a fixed part (reading the 28 GB of weights at ~4 TB/s: ~7 ms, plus
  overhead), a small part per running sequence, and reading each running sequence's KV (160 KiB
  per context token at ~4 TB/s). Prefill (new or recomputed tokens) costs 2 x 14e9 FLOPs per
  token at ~240 TFLOP/s effective.
- Like vLLM, an engine admits queued requests while their current KV fits (at most
  max_num_seqs running). When the running ones outgrow the cache it first drops cached prefixes
  of rollouts waiting on a tool (least recently used), then preempts the latest-admitted
  running rollout; both recompute their whole context when they run again.
- Prompt KV is shared as vLLM's prefix cache shares it: a group's rollouts (`--samples` of a
  problem) share its prompt's whole blocks (16 tokens on a GPU) on the engine they run on;
  replayed ones also share the whole blocks of the prefix every prompt starts with (the system
  prompt) with every rollout there. What is not in whole blocks is counted per token.
- A rollout's turn ends its request; while its tool runs, its KV stays in the prefix cache (so
  the next turn only prefills the tool response) unless evicted.

Rollouts (stage 1 of the paper: 8K response budget shared by all turns, T = 10 turns): prompt
lognormal (median 500 tokens), turns lognormal (median 350 tokens, sigma 1.0), tool responses
lognormal (median 60 tokens), another turn after each with probability 0.65; tool latency drawn
from `--tool-latencies` (a file with one latency in seconds per line, e.g. exported from the
rollouts table) or by default from the latencies bench/sandbox_bench.py measured on 2 cores
(p50 12 ms for small programs, 38 ms for sympy, 1 s loops, 4 s timeouts; mixture below).

    .venv/bin/python bench/scheduler_sim.py              # ~20 s
    .venv/bin/python bench/scheduler_sim.py --engines 8 --prompts 64 --kv-tokens 300000
    .venv/bin/python bench/scheduler_sim.py --max-response 12288 --max-turns 15   # stages 2 and 3
    .venv/bin/python bench/scheduler_sim.py --async   # step time, on-policy vs rl.async one_step
    .venv/bin/python bench/scheduler_sim.py --replay trace.json --hardware cal.json

With --replay: the runs the real pool measured (bench/rollout_bench.py --trace-out), each under
its own policy and reserve, through the engine model fitted on a real engine
(bench/engine_calibration.py --out), simulated against real makespan per run and per policy.

With --async: a whole RL step on the GPUs of the engines' run (--engines), on-policy (every GPU
holds an engine and a trainer rank, colocated, and they take turns) against rl.async one_step
(split placement: E GPUs of engines, the rest trainer ranks; the next step's rollouts drawn during
the update). Rollouts: this simulation, KV-aware with the observed reserve, at the paper
config's 419,430 KV tokens per engine, and for split engines also at --split-kv-tokens (an
engine with the GPU to itself: ~140 GB of an MI300X after the weights). The update: 8 x 14e9
FLOPs per trained token (forward and backward, and the forward again under gradient checkpointing,
as the paper config trains), at --update-tflops per GPU, by default the trainer's measured rate
on an H200 (tasks/cluster/throughput.py; no MI300X figure is measured), on the kept half of the
tokens drawn (G of 2G). The push: 28 GB of bf16 weights at --sync-gbps.
"""

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.cluster.throughput import MEASURED, flops_per_token  # noqa: E402
from tasks.rl.asynchrony import step_time  # noqa: E402
from tasks.rollout.scheduler import make_scheduler, reserve_tokens  # noqa: E402


@dataclass(frozen=True)
class Hardware:
    kv_tokens: int = 850_000
    max_num_seqs: int = 256
    step_base_s: float = 0.010
    step_per_seq_s: float = 5e-5
    step_per_context_token_s: float = 4e-8
    prefill_per_token_s: float = 1.2e-4
    max_chunk_steps: int = 16  # admit arrivals (tool results) at least this often
    # The driver's time per finished turn (taken back, decoded, parsed, its tool call or next
    # request sent), one turn after another for all engines: fitted on the real pool's traces.
    turn_overhead_s: float = 0.0


# Hardware's per-step costs, the terms bench/engine_calibration.py fits on a real engine.
ENGINE_COSTS = ("step_base_s", "step_per_seq_s", "step_per_context_token_s", "prefill_per_token_s")

# (share, median s, sigma): small programs, sympy, 1 s CPU loops, 4 s timeouts (sandbox bench).
DEFAULT_TOOL_LATENCY = ((0.70, 0.012, 0.4), (0.25, 0.038, 0.3), (0.03, 1.02, 0.05), (0.02, 4.0, 0.0))


@dataclass
class Rollout:
    prompt: int
    turns: list[int]  # tokens generated per assistant turn
    tools: list[tuple[int, float]]  # (response tokens, latency s) after each turn but the last
    # simulation state
    turn: int = 0
    context: int = 0  # tokens of the sequence so far (valid while not running)
    resident: int = 0  # of those, how many are in the engine's KV cache
    group: int = -1  # rollouts of one group share their prompt's KV on an engine; -1: none
    group_prefix: int = 0  # tokens of the prompt its group shares (whole blocks)
    common_prefix: int = 0  # tokens of it every rollout shares (whole blocks)
    engine: int = -1
    admit_tick: int = 0
    admit_context: int = 0
    version: int = 0  # bumps on preemption, to skip its stale entry in the finish heap
    last_used: float = 0.0


# vLLM's KV block on a GPU: a prompt's whole blocks are what a group's rollouts share.
GPU_BLOCK_TOKENS = 16


def sample_rollouts(
    n: int,
    max_response: int,
    max_turns: int,
    turn_median: int,
    latencies: list[float] | None,
    seed: int,
    group_size: int = 1,
) -> list[Rollout]:
    """`n` rollouts, `group_size` of a problem after another: they share its prompt, and on an
    engine its whole KV blocks."""
    rng = random.Random(seed)

    def tool_latency() -> float:
        if latencies:
            return rng.choice(latencies)
        u, acc = rng.random(), 0.0
        for share, median, sigma in DEFAULT_TOOL_LATENCY:
            acc += share
            if u <= acc:
                return median * rng.lognormvariate(0, sigma) if sigma else median
        return DEFAULT_TOOL_LATENCY[-1][1]

    rollouts = []
    for index in range(n):
        drawn = int(500 * rng.lognormvariate(0, 0.3))  # drawn for each, so the draws after it stay put
        prompt = drawn if index % group_size == 0 else rollouts[-1].prompt
        turns: list[int] = []
        tools: list[tuple[int, float]] = []
        used = 0
        while True:
            tokens = max(1, min(int(turn_median * rng.lognormvariate(0, 1.0)), max_response - used))
            turns.append(tokens)
            used += tokens
            if len(turns) >= max_turns or used >= max_response or rng.random() > 0.65:
                break
            response = min(int(60 * rng.lognormvariate(0, 0.8)) + 1, max_response - used)
            if response <= 0 or used + response >= max_response:
                break
            tools.append((response, tool_latency()))
            used += response
        shared = prompt // GPU_BLOCK_TOKENS * GPU_BLOCK_TOKENS
        group = index // group_size if group_size > 1 else -1
        rollouts.append(Rollout(prompt, turns, tools, context=prompt, group=group, group_prefix=shared))
    return rollouts


@dataclass
class Engine:
    hw: Hardware
    queue: deque = field(default_factory=deque)  # rollouts ready for their next turn
    running: dict = field(default_factory=dict)  # rollout id -> None, in admission order
    finish_heap: list = field(default_factory=list)  # (end tick, version, rollout id)
    tool_wait: dict = field(default_factory=dict)  # rollout id -> None, least recently used first
    holders: dict = field(default_factory=dict)  # group -> its rollouts holding KV here (its prompt's once)
    holding: int = 0  # rollouts holding KV here (the common prefix's once)
    tick: int = 0  # decode steps taken
    used: int = 0  # KV tokens held: running contexts + cached prefixes of tool waiters
    running_context: int = 0
    busy: bool = False
    busy_s: float = 0.0
    preemptions: int = 0
    prefix_evictions: int = 0
    recomputed_tokens: int = 0


class Simulation:
    def __init__(
        self, rollouts: list[Rollout], n_engines: int, hw: Hardware, policy: str, reserve: int, overcommit: float = 1.0
    ) -> None:
        self.rollouts = rollouts
        self.hw = hw
        self.engines = [Engine(hw) for _ in range(n_engines)]
        self.scheduler = make_scheduler(policy, [hw.kv_tokens] * n_engines, reserve, range(len(rollouts)), overcommit)
        self.events: list = []
        self.seq = 0
        self.done = 0
        self.now = 0.0
        self.driver_free = 0.0  # when the driver is done with the turns handed to it so far

    def push(self, at: float, kind: str, payload: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def context_of(self, rid: int, engine: Engine) -> int:
        r = self.rollouts[rid]
        return r.admit_context + (engine.tick - r.admit_tick)

    def wake(self, e: int) -> None:
        if not self.engines[e].busy:
            self.engines[e].busy = True
            self.push(self.now, "engine", e)

    def dispatch(self) -> None:
        for rid, e in self.scheduler.admit():
            self.rollouts[rid].engine = e
            self.engines[e].queue.append(rid)
            self.wake(e)

    @staticmethod
    def shared_prompt(engine: Engine, r: Rollout) -> int:
        """Of a rollout that holds no KV, the prompt tokens others already hold on the engine
        (vLLM's prefix cache shares their blocks): its group's prefix, else the common one."""
        if r.group < 0:
            return 0
        return r.group_prefix if engine.holders.get(r.group) else r.common_prefix if engine.holding else 0

    @staticmethod
    def release(engine: Engine, r: Rollout) -> int:
        """The rollout's KV dropped: the tokens freed (of its prompt, only what no other rollout on
        the engine shares)."""
        freed = r.resident
        if r.group >= 0:
            engine.holders[r.group] -= 1
            engine.holding -= 1
            if not engine.holders[r.group]:
                del engine.holders[r.group]
            freed -= Simulation.shared_prompt(engine, r)  # what the others still hold of it
        engine.used -= freed
        r.resident = 0
        return freed

    def to_cache(self, engine: Engine, r: Rollout) -> int:
        """The tokens a queued rollout's next turn adds to the engine's cache, and prefills."""
        return r.context - r.resident - (0 if r.resident else self.shared_prompt(engine, r))

    def evict_prefix(self, engine: Engine) -> bool:
        """Drop the least recently used cached prefix of a rollout that is not running."""
        if not engine.tool_wait:
            return False
        rid = next(iter(engine.tool_wait))
        del engine.tool_wait[rid]
        engine.recomputed_tokens += self.release(engine, self.rollouts[rid])
        engine.prefix_evictions += 1
        return True

    def preempt(self, engine: Engine) -> None:
        rid, _ = engine.running.popitem()  # the latest admitted, as vLLM does
        r = self.rollouts[rid]
        context = self.context_of(rid, engine)
        r.turns[r.turn] -= context - r.admit_context  # the part of the turn already generated
        r.context, r.version = context, r.version + 1
        engine.running_context -= context
        r.resident = context
        engine.recomputed_tokens += self.release(engine, r)
        engine.preemptions += 1
        engine.queue.appendleft(rid)

    def admit_queued(self, engine: Engine) -> int:
        """Start queued turns whose KV fits; the tokens to prefill."""
        prefill = 0
        while engine.queue and len(engine.running) < self.hw.max_num_seqs:
            rid = engine.queue[0]
            r = self.rollouts[rid]
            while engine.used + self.to_cache(engine, r) + 1 > self.hw.kv_tokens and self.evict_prefix(engine):
                pass
            if engine.used + self.to_cache(engine, r) + 1 > self.hw.kv_tokens:
                break
            engine.queue.popleft()
            engine.tool_wait.pop(rid, None)
            new = self.to_cache(engine, r)
            prefill += new
            engine.used += new
            if not r.resident and r.group >= 0:
                engine.holders[r.group] = engine.holders.get(r.group, 0) + 1
                engine.holding += 1
            r.resident = r.context
            r.admit_tick, r.admit_context = engine.tick, r.context
            engine.running[rid] = None
            engine.running_context += r.context
            heapq.heappush(engine.finish_heap, (engine.tick + r.turns[r.turn], r.version, rid))
        return prefill

    def run_chunk(self, e: int) -> None:
        engine = self.engines[e]
        prefill = self.admit_queued(engine)
        if not engine.running:
            assert not engine.queue, "an idle engine left a queued rollout waiting (KV leak)"
            engine.busy = False
            return
        while True:
            n = len(engine.running)
            while engine.finish_heap:
                end, version, rid = engine.finish_heap[0]
                if rid in engine.running and self.rollouts[rid].version == version:
                    break
                heapq.heappop(engine.finish_heap)  # stale: that rollout was preempted
            to_turn_end = engine.finish_heap[0][0] - engine.tick
            to_full = (self.hw.kv_tokens - engine.used) // n
            if to_full >= 1 or n == 0:
                break
            if not self.evict_prefix(engine):
                self.preempt(engine)
            if not engine.running:
                engine.busy = False
                return
        k = max(1, min(to_turn_end, to_full, self.hw.max_chunk_steps))
        step_s = (
            self.hw.step_base_s
            + self.hw.step_per_seq_s * n
            + self.hw.step_per_context_token_s * (engine.running_context + n * k / 2)
        )
        duration = prefill * self.hw.prefill_per_token_s + k * step_s
        engine.tick += k
        engine.used += n * k
        engine.running_context += n * k
        engine.busy_s += duration
        self.push(self.now + duration, "engine", e)

    def end_turns(self, e: int) -> None:
        engine = self.engines[e]
        while engine.finish_heap and engine.finish_heap[0][0] <= engine.tick:
            _, version, rid = heapq.heappop(engine.finish_heap)
            r = self.rollouts[rid]
            if rid not in engine.running or r.version != version:
                continue
            del engine.running[rid]
            context = self.context_of(rid, engine)
            engine.running_context -= context
            r.context = r.resident = context
            self.scheduler.resize(rid, context)
            self.driver_free = max(self.now, self.driver_free) + self.hw.turn_overhead_s
            if r.turn < len(r.tools):
                engine.tool_wait[rid] = None  # its KV stays cached while the tool runs
                self.push(self.driver_free + r.tools[r.turn][1], "tool", rid)
            else:
                self.release(engine, r)
                self.done += 1
                self.scheduler.finish(rid)

    def run(self) -> dict:
        self.dispatch()
        progress = tqdm(total=len(self.rollouts), unit="rollout", leave=False, disable=None)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "engine":
                before = self.done
                self.end_turns(payload)
                if self.done != before:
                    progress.update(self.done - before)
                    self.dispatch()
                self.run_chunk(payload)
            else:  # a tool answered: the rollout's next turn
                r = self.rollouts[payload]
                engine = self.engines[r.engine]
                if engine.tool_wait.pop(payload, "evicted") is None:
                    engine.tool_wait[payload] = None  # its cached prefix: most recently used now
                r.context += r.tools[r.turn][0]
                self.scheduler.resize(payload, r.context)
                r.turn += 1
                engine.queue.append(payload)
                self.wake(r.engine)
        progress.close()
        assert self.done == len(self.rollouts), (self.done, len(self.rollouts))
        makespan = max(self.now, self.driver_free)
        return {
            "makespan_s": makespan,
            "idle_fraction": 1 - sum(e.busy_s for e in self.engines) / (makespan * len(self.engines)),
            "preemptions": sum(e.preemptions for e in self.engines),
            "prefix_evictions": sum(e.prefix_evictions for e in self.engines),
            "recomputed_tokens": sum(e.recomputed_tokens for e in self.engines),
        }


def simulate(policy: str, args: argparse.Namespace, hw: Hardware, reserve: str = "max_length") -> dict:
    """One step's rollouts under `policy`; for kv_aware, `reserve` is its per-rollout KV reserve
    mode, "observed" taking the mean size of a previous step's rollouts (another sample of the
    same distribution)."""
    latencies = None
    if args.tool_latencies:
        latencies = [float(x) for x in Path(args.tool_latencies).read_text().split()]

    def sample(seed: int) -> list[Rollout]:
        return sample_rollouts(
            args.prompts * args.samples,
            args.max_response,
            args.max_turns,
            args.turn_median,
            latencies,
            seed,
            group_size=args.samples,
        )

    rollouts = sample(args.seed)
    max_rollout = max(r.prompt for r in rollouts) + args.max_response
    previous = []
    if reserve == "observed":
        previous = [r.prompt + sum(r.turns) + sum(t for t, _ in r.tools) for r in sample(args.seed + 1)]
    reserved = reserve_tokens(reserve, max_rollout, previous, args.kv_headroom)
    started = time.perf_counter()
    result = Simulation(rollouts, args.engines, hw, policy, reserved, args.overcommit).run()
    result["sim_s"] = time.perf_counter() - started
    result["slots_per_engine"] = hw.kv_tokens // reserved
    return result


# (label, policy, KV reserve): the baseline, the paper's scheduler, and ours.
POLICIES = (
    ("static", "static", "max_length"),
    ("kv_aware", "kv_aware", "max_length"),
    ("kv_observed", "kv_aware", "observed"),
    ("kv_live", "kv_live", "observed"),
)


def replay_record(traces: list) -> list:
    """A rollout's turn traces (tasks.records.TurnTrace) as [prompt tokens, tokens generated per
    turn, [(tokens added, tool latency s)] and [the driver's gap] after each turn but the last,
    the engine it ran on]: what --replay runs through the engine model. A tool result counts at what the next turn's
    request added (the response and its template); a call answered without the sandbox (a
    malformed one) at no latency."""
    tools = [[after.added_tokens, turn.tool_latency_s or 0.0] for turn, after in zip(traces, traces[1:])]
    # What the driver took between a turn coming back and the next one going out, its tool aside.
    gaps = [after.started_at - turn.ended_at - (turn.tool_latency_s or 0.0) for turn, after in zip(traces, traces[1:])]
    return [traces[0].added_tokens, [t.generated_tokens for t in traces], tools, gaps, traces[0].engine]


@dataclass(frozen=True)
class PromptSharing:
    """How a measured batch's prompts shared KV blocks: `group_size` rollouts of a problem after
    another, all starting with the same `common_tokens`, cached in blocks of `block_size`."""

    group_size: int
    block_size: int
    common_tokens: int

    def whole_blocks(self, tokens: int) -> int:
        return tokens // self.block_size * self.block_size


def replayed(run: dict, engines: int, hw: Hardware, sharing: PromptSharing) -> dict:
    """One measured run's rollouts (replay records, in the batch's order) simulated under the
    run's own policy and reserve."""
    rollouts = [
        Rollout(
            prompt,
            list(turns),
            [tuple(t) for t in tools],
            context=prompt,
            group=index // sharing.group_size,
            group_prefix=sharing.whole_blocks(prompt),
            common_prefix=sharing.whole_blocks(min(prompt, sharing.common_tokens)),
        )
        for index, (prompt, turns, tools, *_) in enumerate(run["rollouts"])
    ]
    overcommit = run["overcommit"] if run["scheduler"] == "kv_live" else 1.0
    return Simulation(rollouts, engines, hw, run["scheduler"], max(1, run["reserve"]), overcommit).run()


def turn_overhead(workload: dict) -> float:
    """The driver's time per turn: the median, over every run's turns that went on, of the gap
    between a turn coming back and the next going out, its tool's latency aside."""
    gaps = [gap for run in workload["runs"] for rollout in run["rollouts"] for gap in rollout[3]]
    if not gaps:
        raise ValueError(f"workload {workload['label']!r}: no turn went on after another, nothing to fit")
    return statistics.median(gaps)


def calibrated(path: Path, kv_tokens: int, max_num_seqs: int, overhead_s: float) -> Hardware:
    """The engine model fitted on a real engine (bench/engine_calibration.py), with a pool's KV
    cache and sequence cap and the driver's time per turn; every step simulated (a CPU engine
    admits arrivals at every step)."""
    costs = json.loads(path.read_text())
    return Hardware(
        kv_tokens,
        max_num_seqs,
        **{term: costs[term] for term in ENGINE_COSTS},
        max_chunk_steps=1,
        turn_overhead_s=overhead_s,
    )


def replay(trace_path: Path, hardware_path: Path, driver: bool = True) -> None:
    """Each run the real pool measured (bench/rollout_bench.py --trace-out), its own rollouts (prompt,
    turn lengths, tool latencies) replayed under its own policy through the calibrated engine
    model: simulated makespan against the real one, per run and per policy."""
    for workload in json.loads(trace_path.read_text())["workloads"]:
        kv = workload["kv_tokens"]
        overhead = turn_overhead(workload) if driver else 0.0
        hw = calibrated(hardware_path, min(kv), workload["max_num_seqs"], overhead)
        sharing = PromptSharing(workload["group_size"], workload["block_size"], workload["common_prefix_tokens"])
        print(
            f"\n{workload['label']}: {len(kv)} engine(s) of {min(kv)} KV tokens; "
            f"the driver {overhead * 1e3:.1f} ms a turn"
        )
        print(
            f"{'policy':<11} {'reserve':>7} {'real s':>7} {'sim s':>7} {'error':>7} "
            f"{'real preempted':>14} {'sim preempted':>13}"
        )
        cells: dict[str, list[tuple[float, float]]] = {}
        for run in workload["runs"]:
            sim = replayed(run, len(kv), hw, sharing)
            real = run["makespan_s"]
            cells.setdefault(run["policy"], []).append((real, sim["makespan_s"]))
            print(
                f"{run['policy']:<11} {run['reserve']:>7} {real:>7.2f} {sim['makespan_s']:>7.2f} "
                f"{sim['makespan_s'] / real - 1:>+7.1%} {run['preemptions']:>14} {sim['preemptions']:>13}"
            )
        means = {p: (statistics.fmean(r for r, _ in v), statistics.fmean(s for _, s in v)) for p, v in cells.items()}
        for policy, (real, sim) in means.items():
            error = sim / real - 1
            print(f"{policy:<11} mean of {len(cells[policy])}: real {real:.2f} s, simulated {sim:.2f} s ({error:+.1%})")
        rank = {which: sorted(means, key=lambda p: means[p][which]) for which in (0, 1)}
        print(
            f"fastest first: real {rank[0]}, simulated {rank[1]}"
            + (" (agree)" if rank[0] == rank[1] else " (DISAGREE)")
        )


def async_estimate(args: argparse.Namespace) -> None:
    """Step time of one paper-scale RL step, on-policy colocated vs one_step split (see the
    module's docstring for the assumptions)."""
    hw = Hardware(kv_tokens=419_430)
    rollouts = sample_rollouts(
        args.prompts * args.samples, args.max_response, args.max_turns, args.turn_median, None, args.seed, args.samples
    )
    sizes = [r.prompt + sum(r.turns) + sum(t for t, _ in r.tools) for r in rollouts]
    previous = sample_rollouts(len(rollouts), args.max_response, args.max_turns, args.turn_median, None, args.seed + 1)
    reserve = reserve_tokens(
        "observed",
        max(r.prompt for r in rollouts) + args.max_response,
        [r.prompt + sum(r.turns) + sum(t for t, _ in r.tools) for r in previous],
        args.kv_headroom,
    )
    trained_tokens = 0.5 * sum(sizes)

    def update_s(gpus: int) -> float:
        return trained_tokens * flops_per_token(14e9, checkpointing=True) / (gpus * args.update_tflops * 1e12)

    def rollout_s(engines: int, kv_tokens: int = hw.kv_tokens) -> float:
        fresh = [
            Rollout(r.prompt, r.turns, r.tools, context=r.prompt, group=r.group, group_prefix=r.group_prefix)
            for r in rollouts
        ]
        return Simulation(fresh, engines, Hardware(kv_tokens=kv_tokens), "kv_aware", reserve).run()["makespan_s"]

    sync_s = 28e9 / (args.sync_gbps * 1e9)
    gpus = args.engines
    print(
        f"\n{gpus} GPUs, {len(rollouts)} rollouts, {trained_tokens / 1e6:.1f}M trained tokens; update at "
        f"{args.update_tflops:g} TFLOP/s effective per GPU, push {sync_s:.1f} s ({args.sync_gbps:g} GB/s)"
    )
    print(f"{'mode':<9} {'placement':<26} {'rollouts s':>10} {'update s':>9} {'push s':>7} {'step s':>8} {'vs off':>7}")
    r, u = rollout_s(gpus), update_s(gpus)
    off = step_time("off", r, u, sync_s)
    where = f"colocated {gpus}, {hw.kv_tokens // 1000}K KV"
    print(f"{'off':<9} {where:<26} {r:>10.1f} {u:>9.1f} {sync_s:>7.1f} {off:>8.1f} {1:>7.2f}")
    for kv in (hw.kv_tokens, args.split_kv_tokens):
        for engines in (gpus // 2, 5 * gpus // 8, 3 * gpus // 4, 7 * gpus // 8):
            r, u = rollout_s(engines, kv), update_s(gpus - engines)
            t = step_time("one_step", r, u, sync_s)
            where = f"split {engines} + {gpus - engines}, {kv // 1000}K KV"
            print(f"{'one_step':<9} {where:<26} {r:>10.1f} {u:>9.1f} {sync_s:>7.1f} {t:>8.1f} {t / off:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--samples", type=int, default=32, help="rollouts per prompt (2G)")
    parser.add_argument("--max-response", type=int, default=8192)
    parser.add_argument("--max-turns", type=int, default=10)
    parser.add_argument("--turn-median", type=int, default=900, help="tokens per turn (median)")
    parser.add_argument(
        "--kv-tokens",
        default="850000,500000,419430,300000,200000",
        help="KV-cache sizes per engine (tokens) to compare at, comma-separated",
    )
    parser.add_argument("--tool-latencies", default=None, help="file: one latency (s) per line")
    parser.add_argument(
        "--kv-headroom",
        type=float,
        default=1.3,
        help="kv_observed reserves this times the previous step's mean rollout",
    )
    parser.add_argument(
        "--turn-overhead", type=float, default=0.0, help="the driver's s per finished turn, one driver for all engines"
    )
    parser.add_argument("--overcommit", type=float, default=1.0, help="kv_live: admit up to this x each engine's KV")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async", dest="overlap", action="store_true", help="step time: off vs rl.async one_step")
    parser.add_argument(
        "--update-tflops",
        type=float,
        default=MEASURED["h200"].tflops,
        help=f"--async: trainer FLOP/s per GPU (1e12); default measured: {MEASURED['h200'].source}",
    )
    parser.add_argument("--sync-gbps", type=float, default=25.0, help="--async: weight push, GB/s")
    parser.add_argument(
        "--split-kv-tokens", type=int, default=850_000, help="--async: KV tokens of an engine with a GPU of its own"
    )
    parser.add_argument(
        "--replay", type=Path, default=None, help="the real pool's traces (bench/rollout_bench.py --trace-out)"
    )
    parser.add_argument(
        "--no-driver", action="store_true", help="--replay: the engine model alone, no driver time per turn"
    )
    parser.add_argument(
        "--hardware", type=Path, default=None, help="--replay: an engine's fitted costs (bench/engine_calibration.py)"
    )
    args = parser.parse_args()
    if args.replay:
        if not args.hardware:
            parser.error("--replay needs --hardware (bench/engine_calibration.py --out)")
        replay(args.replay, args.hardware, driver=not args.no_driver)
        return
    if args.overlap:
        async_estimate(args)
        return

    lengths = sorted(
        sum(r.turns) + sum(t for t, _ in r.tools)
        for r in sample_rollouts(
            args.prompts * args.samples, args.max_response, args.max_turns, args.turn_median, None, args.seed
        )
    )
    print(
        f"{args.engines} engines, {args.prompts} x {args.samples} rollouts, budget "
        f"{args.max_response} response tokens, T = {args.max_turns}; response tokens per "
        f"rollout: mean {sum(lengths) / len(lengths):.0f}, p50 {lengths[len(lengths) // 2]}, "
        f"p99 {lengths[int(0.99 * len(lengths))]}, "
        f"{sum(n >= args.max_response for n in lengths) / len(lengths):.0%} at the budget"
    )
    print(
        f"{'KV tokens':>9} {'policy':<11} {'slots':>5} {'makespan s':>11} {'idle':>6} "
        f"{'preempted':>9} {'prefix evicted':>14} {'recomputed tok':>14} {'vs static':>10}"
    )
    for kv in (int(x) for x in args.kv_tokens.split(",")):
        hw = Hardware(kv_tokens=kv, turn_overhead_s=args.turn_overhead)
        results = {label: simulate(policy, args, hw, reserve) for label, policy, reserve in POLICIES}
        for name, r in results.items():
            gain = 1 - r["makespan_s"] / results["static"]["makespan_s"]
            slots = r["slots_per_engine"] if name != "static" else "-"
            print(
                f"{kv:>9} {name:<11} {slots:>5} {r['makespan_s']:>11.1f} "
                f"{r['idle_fraction']:>6.1%} {r['preemptions']:>9} {r['prefix_evictions']:>14} "
                f"{r['recomputed_tokens']:>14} {gain:>+10.1%}"
            )


if __name__ == "__main__":
    main()
