"""The live services of one pipeline run, as one lifecycle object.

A flow opens a `Runtime` with `with`, and everything it started (the sandbox service, the tool
runner's loop, the vLLM engine, the verifier's worker, the trainer) is stopped on the way out,
failure included. Tests use the same object.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

from transformers import AutoTokenizer

from tasks.config import RunConfig
from tasks.reward.verify import Verifier
from tasks.rollout.agent import ToolRunner
from tasks.rollout.engine import weights_from_dir
from tasks.rollout.metrics import max_logprob_gap
from tasks.rollout.pool import EnginePool
from tasks.sandbox.executor import Limits
from tasks.sandbox.server import SandboxService
from tasks.train.sample import Sample
from tasks.train.trainer import Trainer


class Runtime:
    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path):
        self.cfg, self.model_dir, self.run_dir = cfg, Path(model_dir), Path(run_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.sandbox: SandboxService | None = None
        self.tools: ToolRunner | None = None
        self.engine: EnginePool | None = None
        self.verifier: Verifier | None = None
        self.trainer: Trainer | None = None
        self._stages_trained: set[str] = set()  # RL stages this process has trained (or resumed)

    def __enter__(self) -> Runtime:
        box = self.cfg.sandbox
        urls = box.urls
        if not urls:
            limits = Limits(
                timeout_s=box.timeout_s,
                cpu_s=max(1, int(box.timeout_s)),
                memory_mb=box.memory_mb,
                output_bytes=box.output_bytes,
            )
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            self.sandbox = SandboxService(
                workers=box.workers, limits=limits, log_path=self.run_dir / "logs" / "sandbox.log"
            ).start()
            urls = [self.sandbox.url]
        self.tools = ToolRunner(urls)
        self.verifier = Verifier()
        self.engine = EnginePool(self.model_dir, self.cfg.engine, self.cfg.seed, self.cfg.model.dtype).start()
        return self

    def __exit__(self, *exc) -> None:
        for stop in (
            self.tools and self.tools.close,
            self.verifier and self.verifier.close,
            self.engine and self.engine.stop,
            self.sandbox and self.sandbox.stop,
        ):
            if stop:
                stop()
        self.trainer = None
        gc.collect()

    def load_policy(self, model_dir: Path) -> None:
        """Serve a new model directory's weights from the running engine (same architecture)."""
        self.engine.load_weights(weights_from_dir(model_dir))
        self.model_dir = Path(model_dir)

    def policy_trainer(self, total_steps: int, reset_optimizer: bool) -> Trainer:
        """The RL trainer, created on first use and kept across stages unless a reset is asked."""
        if self.trainer is None or reset_optimizer:
            weights = self.model_dir
            if self.trainer is not None:
                # A fresh optimizer, the current weights: round-trip them through a directory.
                weights = self.trainer.save_pretrained(self.run_dir / "checkpoints" / "stage-boundary")
                self.tokenizer.save_pretrained(weights)
            self.trainer = None
            gc.collect()
            self.trainer = Trainer(
                weights, self.cfg.rl.optim, total_steps, self.cfg.model.dtype, self.cfg.seed, self.cfg.trainer_threads
            )
        return self.trainer

    def begin_stage(self, name: str) -> set[str]:
        """Note that this process trains RL stage `name` now; returns the stages it trained before
        (a stage after one of those continues from the trainer as it is, not from a checkpoint)."""
        before = set(self._stages_trained)
        self._stages_trained.add(name)
        return before

    def restore(self, directory: Path, tag: str | None = None, weights_only: bool = False) -> None:
        """The trainer from a DeepSpeed checkpoint (the latest in `directory` without a tag), and
        its weights pushed into the engines."""
        self.trainer.load_checkpoint(directory, tag=tag, weights_only=weights_only)
        self.engine.load_weights(self.trainer.named_weights())

    def sync_weights(self, probe: list[Sample]) -> float | None:
        """Push the trainer's weights into the running engines (no restart), then compare the
        two views of the policy on the probe samples: the worst per-token log-prob gap over the
        engines (every one must have the new weights); None without a probe."""
        self.engine.load_weights(self.trainer.named_weights())
        if not probe:
            return None
        trainer_view = self.trainer.token_logprobs(probe)
        return max(
            max_logprob_gap(engine_view, trainer_view)
            for engine_view in self.engine.prompt_logprobs([s.token_ids for s in probe])
        )

    def export_policy(self, final: Path) -> Path:
        """The trainer's policy as a Hugging Face directory (tokenizer included), written beside
        `final` and renamed into place, so a half-written export is never mistaken for one."""
        partial = final.with_name(f".{final.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.trainer.save_pretrained(partial)
        self.tokenizer.save_pretrained(partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return final
