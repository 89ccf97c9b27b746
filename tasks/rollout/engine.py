"""A vLLM engine in this process: lifecycle, token-level requests, in-place weight sync.

The engine is driven one step at a time (add_request / step) rather than through
`LLM.generate`, so the agent loop can hand finished turns to the sandbox and feed tool results
back while the engine keeps serving the other trajectories: no turn-level barrier.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.config import EnginesConfig


def configure_cpu_runtime() -> None:
    """Settings that must be in place before vLLM is imported (see README, 'CPU notes')."""
    # The in-process engine starts in ~3 s instead of ~20 s and exposes the worker for reloads.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Two cores are shared by engine, trainer and sandbox: more threads made steps 10x slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # torch._C: once an engine ran in this process, vLLM has made torch.set_num_threads a no-op.
    torch._C.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


class RotaryReloadNotice(logging.Filter):
    """Drops one vLLM warning, "RotaryEmbedding: Failed to load weights", logged at every weight
    push. A rotary embedding holds no trained weights (its cos/sin cache is computed from the
    config), so a reload loads none of its tensors and vLLM puts the cache back as it was, which
    is right: the engine/trainer log-prob gap after a push stays ~1e-7 (tests/test_weight_sync.py).
    Any other layer that fails to load still warns."""

    LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def available_cores() -> list[int]:
    """The cores this process may run on (all of them where the OS does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cores(cores: list[int], engine_cores: int) -> tuple[list[int], list[int]]:
    """Split placement on CPU (cluster.placement): the engines' cores, the first `engine_cores`,
    and the trainer's, the rest, so that rollouts and updates overlap without contending. A node
    with too few cores for both gives each role all of them."""
    if 0 < engine_cores < len(cores):
        return cores[:engine_cores], cores[engine_cores:]
    return cores, cores


@dataclass(frozen=True)
class FinishedTurn:
    request_id: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or stop token) or "length"
    # log p of each token under the engine's policy as it sampled (temperature applied): the
    # behaviour policy of importance-weighted updates (rl.loss.is_cap); one per token, always
    logprobs: list[float]
    weights_version: int  # of the weights that drew it, as the engine holds them (load_weights)


class Engine:
    def __init__(self, model_dir: Path, cfg: EnginesConfig, seed: int, dtype: str = "float32"):
        self.model_dir, self.cfg, self.seed, self.dtype = Path(model_dir), cfg, seed, dtype
        self.llm = None
        self.busy_s = 0.0  # time spent in step(): what is left of the wall time, it sat idle
        self.preemptions = 0  # running requests evicted from the KV cache (to be recomputed)
        self.steps = 0  # steps taken: busy_s / steps is the step's cost where the engine runs
        # Which weights it holds: 0, those it started from; then what each load says it loaded.
        self.weights_version = 0

    def start(self) -> Engine:
        configure_cpu_runtime()
        if not torch.cuda.is_available():
            # vLLM-CPU sizes and binds an OpenMP pool only for model workers in processes of its
            # own (VLLM_CPU_OMP_THREADS_BIND); this engine runs its model in the calling thread.
            torch._C.set_num_threads(self.cfg.threads)
        from vllm import LLM

        logging.getLogger(RotaryReloadNotice.LOGGER).addFilter(RotaryReloadNotice())
        self.llm = LLM(
            model=str(self.model_dir),
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.cfg.max_model_len,
            max_num_seqs=self.cfg.max_num_seqs,
            enable_prefix_caching=True,
            block_size=self.cfg.block_size,
            enforce_eager=self.cfg.enforce_eager,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            # Unbounded, vLLM-CPU takes ~92% of RAM; a bound is needed on every device.
            kv_cache_memory_bytes=int(self.cfg.kv_cache_gib * 2**30),
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            disable_log_stats=False,
            # Sampled tokens' log-probs after temperature, the distribution they were drawn from
            # (the trainer's log-probs are taken at the same temperature).
            logprobs_mode="processed_logprobs",
        )
        self._count_preemptions()
        return self

    def _count_preemptions(self) -> None:
        # vLLM counts preemptions only for its loggers, which the in-process LLM does not run;
        # the scheduler's own preemption method is the one place every eviction goes through.
        scheduler = self._core.engine_core.engine_core.scheduler
        preempt = scheduler._preempt_request

        def counted(*args, **kwargs):
            self.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted

    def stats(self) -> dict:
        """Seconds spent generating, steps and preemptions so far; the threads and cores it runs on."""
        return {
            "busy_s": self.busy_s,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "threads": torch.get_num_threads(),
            "cores": available_cores(),
        }

    def kv_tokens(self) -> int:
        """The KV cache's capacity in tokens, as vLLM sized it from kv_cache_gib."""
        cache = self._core.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size

    def __enter__(self) -> Engine:
        return self.start() if self.llm is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.llm = None

    @property
    def _core(self):
        return self.llm.llm_engine

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
    ) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=stop_token_ids,
            detokenize=False,  # the agent loop decodes whole turns itself
            output_kind=RequestOutputKind.FINAL_ONLY,
            logprobs=0,  # the sampled token's own
        )
        self._core.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_ids), params)

    def has_unfinished(self) -> bool:
        return self._core.has_unfinished_requests()

    def step(self) -> list[FinishedTurn]:
        started = time.perf_counter()
        finished = []
        outputs = self._core.step()
        self.busy_s += time.perf_counter() - started
        self.steps += 1
        for output in outputs:
            if output.finished:
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs or [], tokens)]
                finished.append(
                    FinishedTurn(output.request_id, tokens, completion.finish_reason, logprobs, self.weights_version)
                )
        return finished

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p of each token given its prefix (first token excluded): the engine's view of
        the policy, compared with the trainer's to catch a stale or wrong weight sync."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        return [
            [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], seq[1:])]
            for out, seq in zip(outputs, sequences)
        ]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push new weights, `version` of the run's, into the running engine, then drop KV
        computed with the old ones; every turn it finishes from now on carries `version`. Only
        between rollouts: a turn half drawn by each of two policy versions could be trained on as
        drawn by either."""
        if self.has_unfinished():
            raise RuntimeError("new weights pushed while requests generate: push only between rollouts")
        worker = self._core.engine_core.engine_core.model_executor.driver_worker.worker
        worker.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        # Without this, prefix-cache hits would reuse keys/values of the previous policy.
        self.llm.reset_prefix_cache()
        self.weights_version = version


def weights_from_dir(model_dir: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors of a Hugging Face safetensors directory, under their checkpoint names."""
    from safetensors.torch import load_file

    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        yield from load_file(shard).items()
