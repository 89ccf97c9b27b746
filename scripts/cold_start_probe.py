"""Where does the tiny model's problem -> program ability live, and does SFT keep it usable?

Builds the base model exactly as the pipeline does (curated splits, tokenizer, pre-training) for a
config, runs the configured SFT on it in this process, and greedy-probes the held-out problems
before and after SFT:
- `plain`:  the program after `question\\n`, the layout of the pre-training documents;
- `call`:   the program inside a tool call, after the exact rollout prompt with the call's prefix
            (`<tool_call>{"name": ..., "arguments": {"code": "`) filled in (JSON-escaped match);
- `free`:   the whole first turn from the rollout prompt alone: a call of the right program;
- `answer`: after the right call and the tool's output, `\\boxed{<that output>}`.
Each is the share of exact matches. Run it on 1 thread beside a second one, e.g.

    .venv/bin/python scripts/cold_start_probe.py --set sft.mode=non_reasoning --threads 1 --out a.json

`--copy MODEL_DIR` only probes copying in a model already built (a run's models/base):
teacher-forced and greedy, on the fresh drills the pre-training checks and on unseen ones.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.cli import parse_overrides
from tasks.config import load_config
from tasks.data.chat_examples import sft_examples
from tasks.data.pretrain import copy_documents, copy_probe_samples
from tasks.data.problem_sets import curate, load_problems
from tasks.rollout.format import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallError,
    parse_tool_call,
    prompt_text,
    tool_call_text,
    tool_response_text,
)
from tasks.train.supervised import build_base_model, train_sft
from tasks.train.trainer import Trainer


def greedy(model, tokenizer, segments: list[str], max_new_tokens: int) -> str:
    """Greedy continuation of segments tokenized one by one, as a trajectory is."""
    ids = [i for text in segments for i in tokenizer(text, add_special_tokens=False).input_ids]
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=False)


@torch.no_grad()
def copy_probe(model_dir: Path, seed: int, n: int = 64) -> dict[str, float]:
    """Exact copies of n drills: teacher-forced on the copy alone, on the copy
    and its newline (the pre-training's check), and greedy; fresh = the check's drills at this
    seed, unseen = drills of a seed no pre-training draws from."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def teacher_forced(samples, ending: bool) -> float:
        exact = 0
        for sample in samples:
            ids = torch.tensor([sample.token_ids])
            right = model(ids).logits[0, :-1].argmax(-1) == ids[0, 1:]
            target = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
            if not ending:
                target[target.nonzero()[-1]] = False  # drop the newline
            exact += bool(right[target].all())
        return exact / len(samples)

    def greedy_share(drill_seed: int) -> float:
        exact = 0
        for document in copy_documents(n, drill_seed):
            prompt, _, copy = document.rstrip("\n").rpartition("\n")
            exact += greedy(model, tokenizer, [prompt + "\n"], 48).split("\n")[0] == copy
        return exact / n

    fresh = copy_probe_samples(tokenizer, n, seed + 7)  # the pre-training check's drills
    return {
        "teacher_forced_copy": teacher_forced(fresh, ending=False),
        "teacher_forced_copy_and_newline": teacher_forced(fresh, ending=True),
        "greedy_fresh": greedy_share(seed + 7),
        "greedy_unseen": greedy_share(12345),
    }


@torch.no_grad()
def probe(model_dir: Path, problems, tool_name: str, tool_spec: str) -> dict[str, float]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hits = {"plain": 0, "call": 0, "free": 0, "answer": 0}
    call_prefix = f'{TOOL_CALL_OPEN}{{"name": "{tool_name}", "arguments": {{"code": "'
    for p in problems:
        prompt = prompt_text(p.question, tool_name, tool_spec)
        hits["plain"] += greedy(model, tokenizer, [p.question + "\n"], 80).startswith(p.solution_code)
        escaped = json.dumps(p.solution_code)[1:-1]
        hits["call"] += greedy(model, tokenizer, [prompt, call_prefix], 100).startswith(escaped)
        turn = greedy(model, tokenizer, [prompt], 140).partition(TOOL_CALL_CLOSE)  # the engine stops there
        try:
            hits["free"] += bool(turn[1]) and parse_tool_call("".join(turn[:2]), tool_name).code == p.solution_code
        except ToolCallError:
            pass
        segments = [prompt, tool_call_text(tool_name, p.solution_code), tool_response_text(p.answer)]
        hits["answer"] += f"\\boxed{{{p.answer}}}" in greedy(model, tokenizer, segments, 40)
    return {k: round(v / len(problems), 3) for k, v in hits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], help="key=value (YAML value), as rstar2 run --set")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--base-only", action="store_true", help="probe the base model, skip SFT")
    parser.add_argument(
        "--sft", action="append", default=[], help="an SFT variant on the same base: key=value[,key=value] (repeatable)"
    )
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    parser.add_argument("--copy", type=Path, metavar="MODEL_DIR", help="only probe copying in this model")
    args = parser.parse_args()

    overrides = parse_overrides(args.set)
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(args.threads)
    if args.copy:
        print(json.dumps({"model": str(args.copy), "seed": cfg.seed, **copy_probe(args.copy, cfg.seed)}))
        return
    work = Path(tempfile.mkdtemp(prefix="cold-start-probe-"))
    paths = curate(cfg.data, work)["paths"]
    train, heldout = load_problems(paths["train"]), load_problems(paths["heldout"])
    started = time.perf_counter()
    losses: dict[str, list[float]] = {}

    def log(metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            losses.setdefault(name, []).append(value)

    base_dir, _ = build_base_model(
        cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"threads": args.threads})}),
        train,
        work / "base",
        log,
    )
    result = {"overrides": args.set, "base": probe(base_dir, heldout, cfg.rollout.tool_name, cfg.rollout.tool_spec)}
    result["base copying"] = copy_probe(base_dir, cfg.seed)
    curve = losses.get("pretrain/loss", [])
    result["pretrain_loss_every_50"] = [round(sum(curve[i : i + 10]) / 10, 3) for i in range(0, len(curve) - 9, 50)]
    result["copy_exact_every_25"] = losses.get("pretrain/copy_exact", [])
    result["base_s"] = round(time.perf_counter() - started)
    print(json.dumps(result), flush=True)
    for index, variant in enumerate([] if args.base_only else args.sft or [""]):
        changes = parse_overrides([item for item in variant.split(",") if item])
        variant_cfg = load_config(args.config, {**overrides, **changes})
        losses.pop("sft/loss", None)
        probed = train_and_probe_sft(variant_cfg, base_dir, heldout, work / f"sft-{index}", args.threads, log)
        result[f"sft {variant}".strip()] = {**probed, "loss": round(losses["sft/loss"][-1], 3)}
        print(json.dumps(result), flush=True)
    result["total_s"] = round(time.perf_counter() - started)
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def train_and_probe_sft(cfg, base_dir: Path, heldout, out_dir: Path, threads: int, log) -> dict[str, float]:
    """The configured SFT in this process (one local trainer), then the probes on its policy."""

    def start_trainer(model_dir, optim, total):
        return Trainer(model_dir, optim, total, cfg.model.dtype, cfg.seed, threads, cfg.trainer.zero_stage)

    sft_dir, _ = train_sft(cfg, sft_examples(cfg)[0], base_dir, out_dir, log, start_trainer)
    return probe(sft_dir, heldout, cfg.rollout.tool_name, cfg.rollout.tool_spec)


if __name__ == "__main__":
    main()
