"""The live services of one pipeline run, as one lifecycle object.

A flow opens a `Runtime` with `with`, and everything it started (the sandbox service, the tool
runner's loop, the vLLM engine, the verifier's worker, the trainer) is stopped on the way out,
failure included. Tests use the same object.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from tasks.config import RunConfig
from tasks.reward.verify import Verifier
from tasks.rollout.agent import ToolRunner
from tasks.rollout.engine import weights_from_dir
from tasks.rollout.pool import EnginePool
from tasks.sandbox.executor import Limits
from tasks.sandbox.server import SandboxService
from tasks.train.trainer import Trainer
from tasks.tracking.mlflow_log import Tracker


@dataclass
class RunContext:
    """Where a run writes, and its MLflow parent run: plain data, safe to pass to tasks."""

    run_id: str
    run_dir: Path
    mlflow_run_id: str
    output_dir: Path
    tags: dict = field(default_factory=dict)  # MLflow tags every run of this pipeline run carries

    @property
    def tracker(self) -> Tracker:
        return Tracker(self.output_dir)


class Runtime:
    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path):
        self.cfg, self.model_dir, self.run_dir = cfg, Path(model_dir), Path(run_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.sandbox: SandboxService | None = None
        self.tools: ToolRunner | None = None
        self.engine: EnginePool | None = None
        self.verifier: Verifier | None = None
        self.trainer: Trainer | None = None
        self.stages_trained: set[str] = set()  # RL stages this process has trained (or resumed)
        self.rollout_sizes: list[int] = []  # tokens per rollout of the last batch, any kind (KV reserve)

    def __enter__(self) -> Runtime:
        box = self.cfg.sandbox
        urls = box.urls
        if not urls:
            limits = Limits(timeout_s=box.timeout_s, cpu_s=max(1, int(box.timeout_s)), memory_mb=box.memory_mb,
                            output_bytes=box.output_bytes)
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            self.sandbox = SandboxService(workers=box.workers, limits=limits,
                                          log_path=self.run_dir / "logs" / "sandbox.log").start()
            urls = [self.sandbox.url]
        self.tools = ToolRunner(urls)
        self.verifier = Verifier()
        self.engine = EnginePool(self.model_dir, self.cfg.engine, self.cfg.seed, self.cfg.model.dtype).start()
        return self

    def __exit__(self, *exc) -> None:
        for stop in (self.tools and self.tools.close, self.verifier and self.verifier.close,
                     self.engine and self.engine.stop, self.sandbox and self.sandbox.stop):
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
            self.trainer = Trainer(weights, self.cfg.rl.optim, total_steps, self.cfg.model.dtype, self.cfg.seed,
                                   self.cfg.trainer_threads)
        return self.trainer
