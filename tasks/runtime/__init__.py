"""The live services of one pipeline run, as one lifecycle object.

A flow opens a `Runtime` with `with`: it connects to the Ray cluster the config names (or starts
a local one), checks the placement plan against the cluster before creating any actor, and
places the trainer ranks, the vLLM engines and the sandbox replicas. Everything it started is
stopped on the way out, failure included. Tests use the same object; a laptop runs the same
actors on a local Ray.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from transformers import AutoTokenizer

from tasks.cluster.actors import Placement, placement_table
from tasks.cluster.connect import RayCluster, interrupt_behind
from tasks.cluster.engines import EngineGroup
from tasks.cluster.plan import build_plan, resources_from_ray_nodes
from tasks.cluster.sandboxes import SandboxGroup
from tasks.cluster.sync import WeightSync
from tasks.cluster.trainers import TrainerGroup
from tasks.config import OptimConfig, RunConfig
from tasks.records import Sample
from tasks.reward.verify import Verifier
from tasks.rollout.metrics import max_logprob_gap
from tasks.sandbox.app import TOKEN_ENV
from tasks.sandbox.client import ToolRunner


class Runtime:
    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path):
        self.cfg, self.model_dir, self.run_dir = cfg, Path(model_dir), Path(run_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.cluster = RayCluster(cfg.cluster)
        self.placement = Placement()
        self.where: list[dict] = []  # each actor's node and pid, as placed
        self.sandboxes: SandboxGroup | None = None
        self.tools: ToolRunner | None = None
        self.engines: EngineGroup | None = None
        self.verifier: Verifier | None = None
        self.trainer: TrainerGroup | None = None
        self.weight_sync: WeightSync | None = None
        self.sandbox_token: str | None = None  # the credential every sandbox call carries
        self._trainer_started = False
        self._stages_trained: set[str] = set()  # RL stages this runtime has trained (or resumed)

    def __enter__(self) -> Runtime:
        try:
            self._start()
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _start(self) -> None:
        cluster = self.cfg.cluster
        self.cluster.start()
        build_plan(self.cfg, resources_from_ray_nodes(self.cluster.nodes()))  # refuses before any actor exists
        # The credential every sandbox call carries: the user's for services of their own
        # (sandbox.urls), else a new one per run, which only this driver and its replicas hold.
        own = not self.cfg.sandbox.urls
        self.sandbox_token = os.environ.get(TOKEN_ENV) or (secrets.token_urlsafe(32) if own else None)
        replicas_token = self.sandbox_token if own else None
        self.placement.start(self.cfg, self.model_dir, self.run_dir, replicas_token, loopback=self.cluster.local)
        self.engines = EngineGroup(self.placement.engines, self.cfg.engines)
        urls = self.cfg.sandbox.urls
        if not urls:
            self.sandboxes = SandboxGroup(self.placement.sandboxes, cluster.startup_timeout_s)
            urls = self.sandboxes.urls
        self.trainer = TrainerGroup(self.placement.ranks, self.cfg.trainer.call_timeout_s)
        self.weight_sync = WeightSync(self.trainer, self.engines, cluster)
        self.where = self.placement.where(cluster.startup_timeout_s)
        self.trainer.where = [row for row in self.where if row["role"] == "trainer"]
        print(placement_table(self.where))
        resolve = self.sandboxes.resolve if self.sandboxes else None
        self.tools = ToolRunner(urls, resolve, self.cfg.sandbox.outage_timeout_s, self.sandbox_token)
        self.verifier = Verifier()

    def __exit__(self, *exc) -> None:
        failures = []
        for stop in (
            self.tools and self.tools.close,
            self.verifier and self.verifier.close,
            self.engines and self.engines.stop,
            self.sandboxes and self.sandboxes.stop,
            self.placement.stop,
            self.cluster.stop,
        ):
            try:  # one service that fails to stop must not leave the others running
                if stop:
                    stop()
            except Exception as failure:
                failures.append(failure)
        self.tools = self.verifier = self.engines = self.sandboxes = self.trainer = None
        if failures and not any(exc):
            raise failures[0]
        raised = exc[1] if exc else None
        interrupt = interrupt_behind(raised) if raised is not None else None
        if interrupt is not None and interrupt is not raised:
            raise interrupt from None  # a SIGTERM, not a fault: Prefect ends the flow run, no retry

    def load_policy(self, model_dir: Path) -> None:
        """Serve a new model directory's weights from the running engines (same architecture)."""
        self.engines.load_from_dir(model_dir, self.cfg.engines.load_timeout_s)
        self.model_dir = Path(model_dir)

    def supervised_trainer(self, model_dir: Path, optim: OptimConfig, total_steps: int) -> TrainerGroup:
        """The trainer ranks started on `model_dir` for supervised steps (SFT); the RL trainer
        later starts afresh from the policy the engines serve."""
        self._trainer_started = False
        return self.trainer.start(model_dir, optim, total_steps, self.cfg.model.dtype, self.cfg.seed, self.cfg.trainer)

    def policy_trainer(self, total_steps: int, reset_optimizer: bool) -> TrainerGroup:
        """The RL trainer, started on first use and kept across stages unless a reset is asked."""
        if not self._trainer_started or reset_optimizer:
            weights = self.model_dir
            if self._trainer_started:
                # A fresh optimizer, the current weights: round-trip them through a directory.
                weights = self.trainer.save_pretrained(self.run_dir / "checkpoints" / "stage-boundary")
                self.tokenizer.save_pretrained(weights)
            self.trainer.start(
                weights, self.cfg.rl.optim, total_steps, self.cfg.model.dtype, self.cfg.seed, self.cfg.trainer
            )
            self._trainer_started = True
        return self.trainer

    def begin_stage(self, name: str) -> set[str]:
        """Note that this runtime trains RL stage `name` now; returns the stages it trained before
        (a stage after one of those continues from the trainer as it is, not from a checkpoint)."""
        before = set(self._stages_trained)
        self._stages_trained.add(name)
        return before

    def restore(self, directory: Path, tag: str | None = None, weights_only: bool = False) -> None:
        """The trainer from a DeepSpeed checkpoint (the latest in `directory` without a tag), and
        its weights pushed into the engines."""
        self.trainer.load_checkpoint(directory, tag=tag, weights_only=weights_only)
        self.weight_sync.push()

    def rejoin_restarted(self) -> int:
        """Engines Ray has brought back since the last push get the trainer's weights now and
        serve again, without waiting for the next update's push; returns how many rejoined."""
        if not self.engines.any_back():
            return 0
        before = self.engines.restarts
        self.weight_sync.push()
        return self.engines.restarts - before

    def sync_weights(self, probe: list[Sample]) -> float | None:
        """Push the trainer's weights into the running engines (no restart), then compare the
        two views of the policy on the probe samples: the worst per-token log-prob gap over the
        engines (every one must have the new weights); None without a probe."""
        self.weight_sync.push()
        if not probe:
            return None
        trainer_view = self.trainer.token_logprobs(probe)
        return max(
            max_logprob_gap(engine_view, trainer_view)
            for engine_view in self.engines.prompt_logprobs([s.token_ids for s in probe])
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
