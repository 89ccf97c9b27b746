"""`rstar2 run`: the whole pipeline (or some RL stages of a run) from the command line, the same
flow the UI triggers; `rstar2 evaluate`: a saved policy of a run; `rstar2 ablate`: the RoC
ablation over seeds; `rstar2 coldstart`: RL from a non-reasoning vs a reasoning SFT over seeds;
`rstar2 query "SQL"`: SQL over the runs' tables; `rstar2 plan`: where a
config's actors would go on a cluster, and whether they fit.

Bad input (a config field, a data file, the model directory, the cluster) ends a command with one
line on stderr naming what and where, and exit status 2; `run`, `ablate` and `coldstart` check it before any
flow starts, so nothing is written."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from tasks.config.environment import keep_local


@contextmanager
def _bad_input_exits_2() -> Iterator[None]:
    from tasks.config import InputError

    try:
        yield
    except InputError as exc:
        # One line, even where a message quotes a library's multi-line error.
        print(" ".join(str(exc).split()), file=sys.stderr)
        raise SystemExit(2) from None


def parse_overrides(pairs: list[str]) -> dict:
    from tasks.config import InputError

    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InputError(f"--set expects key=value (dotted key), got {pair!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def _check(config: str, overrides: dict) -> None:
    """The config and every input it names (flows/preflight.py), before any flow runs."""
    from flows.preflight import check_run
    from tasks.config import load_config

    check_run(load_config(config, overrides))


RESOURCES_HELP = (
    "the cluster to plan for, instead of cluster.address / $RAY_ADDRESS or this machine: "
    "NODESxGPUSxGIB[:cpus=N,name=amount,...], groups joined by '+'; e.g. 8x8x80 (8 nodes of 8 GPUs "
    "with 80 GiB, 64 CPUs each), 1x8x80:cpus=96, 8x8x192+2x0:cpus=128,cpu_node=4 (plus 2 CPU-only nodes "
    "offering the custom resource cpu_node), 1x0:cpus=2 (a laptop); NxG leaves GPU memory unknown"
)


def _plan(args: argparse.Namespace) -> None:
    """Print the plan (a plan that cannot fit raises PlanError). Never starts Ray: without
    --resources it asks a running cluster (cluster.address, $RAY_ADDRESS) or looks at this machine."""
    from tasks.cluster.plan import build_plan, format_plan, parse_resources
    from tasks.cluster.resources import run_resources
    from tasks.config import load_config

    cfg = load_config(args.config, parse_overrides(args.set))
    resources = parse_resources(args.resources) if args.resources else run_resources(cfg.cluster, args.gpu_memory_gib)
    print(format_plan(build_plan(cfg, resources, args.gpu_class)))


def _exit_on_sigterm(signum, frame) -> None:
    # Exits as the interpreter does, so that what the run started in this process (the temporary
    # Prefect server, a local Ray) is stopped on the way out: Prefect ends a flow run on SIGTERM,
    # then signals the process again for the handler that was there before its own.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    keep_local()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # The first start of the local Prefect API migrates a new database: on a busy 2-core machine
    # that took longer than Prefect's default 20 s and the run failed before it began.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    if os.environ.get("PREFECT_HOME"):  # Prefect creates its home folder, but not the parents
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    from tasks.config import default_config_path

    parser = argparse.ArgumentParser(prog="rstar2", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the whole pipeline")
    run.add_argument("--config", default=str(default_config_path()), help="YAML config (default: tiny)")
    run.add_argument("--run-id", default=None, help="name of the run folder (default: generated)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set rl.roc.mode=off",
    )
    run.add_argument(
        "--stage",
        action="append",
        dest="stages",
        metavar="NAME",
        help="run only this RL stage (repeatable); earlier stages must have finished in the run",
    )
    evaluate = commands.add_parser("evaluate", help="evaluate a saved policy of a run")
    evaluate.add_argument("--run-id", required=True)
    evaluate.add_argument("--checkpoint", default="sft", help="base, sft or an RL stage's name")
    evaluate.add_argument("--label", default=None, help="name of this evaluation (default: the checkpoint)")
    evaluate.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override an eval setting, e.g. --set k=64"
    )
    evaluate.add_argument("--output-dir", default="outputs")
    ablate = commands.add_parser("ablate", help="the RoC ablation: paper / release / off over seeds, one report")
    ablate.add_argument("--config", default=str(default_config_path()), help="YAML config (default: tiny)")
    ablate.add_argument("--seeds", type=int, default=3)
    ablate.add_argument("--modes", nargs="+", default=["paper", "release", "off"], choices=["paper", "release", "off"])
    ablate.add_argument("--name", default="roc", help="runs <name>-s<seed>-<mode>, report outputs/ablations/<name>")
    ablate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ablate.add_argument(
        "--sft-from",
        default=None,
        metavar="NAME",
        help="start every run from ablation NAME's SFT policy of its seed (compare RL settings)",
    )
    coldstart = commands.add_parser(
        "coldstart", help="the cold-start experiment: RL from a non-reasoning vs a reasoning SFT over seeds, one report"
    )
    coldstart.add_argument("--config", default=str(default_config_path()), help="YAML config (default: tiny)")
    coldstart.add_argument("--seeds", type=int, default=3)
    coldstart.add_argument(
        "--arms", nargs="+", default=["non_reasoning", "reasoning"], choices=["non_reasoning", "reasoning"]
    )
    coldstart.add_argument(
        "--name", default="coldstart", help="runs <name>-s<seed>-<arm>, report outputs/ablations/<name>"
    )
    coldstart.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    compare = commands.add_parser(
        "async-compare", help="rl.async against on-policy RL: the modes from one SFT policy per seed, one report"
    )
    compare.add_argument("--config", default=str(default_config_path()), help="YAML config (default: tiny)")
    compare.add_argument("--seeds", type=int, default=3)
    compare.add_argument(
        "--modes",
        nargs="+",
        default=["off", "one_step"],
        choices=["off", "one_step", "bounded"],
        help="first: baseline",
    )
    compare.add_argument(
        "--is-cap", type=float, default=2.0, help="rl.loss.is_cap of the off-policy modes (default: 2.0)"
    )
    compare.add_argument("--name", default="async", help="runs <name>-s<seed>-<mode>, report outputs/ablations/<name>")
    compare.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    query = commands.add_parser("query", help="run SQL on the DuckDB views (dashboards/views.sql)")
    query.add_argument("sql", help='e.g. "SELECT stage, step, avg(reward) FROM rollouts GROUP BY ALL"')
    query.add_argument("--runs", default="outputs/runs/*", help="run folder or glob (default: every run)")
    plan = commands.add_parser(
        "plan", help="where a config's actors go on a cluster and the memory each GPU holds; exit 2 if it cannot fit"
    )
    plan.add_argument("--config", default=str(default_config_path()), help="YAML config (default: tiny)")
    plan.add_argument("--resources", default=None, metavar="SPEC", help=RESOURCES_HELP)
    plan.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="GiB per GPU of a Ray cluster (Ray does not report it; default: memory per GPU not checked)",
    )
    plan.add_argument("--gpu-class", default=None, help="the GPUs' class, for the update time (measured: h200)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    if args.command == "plan":
        with _bad_input_exits_2():
            _plan(args)
        return
    if args.command == "query":
        from dashboards.views import connect

        connect(args.runs).sql(args.sql).show(max_width=200)
        return
    with _bad_input_exits_2():
        overrides = parse_overrides(args.set)
        if args.command in ("run", "ablate", "coldstart", "async-compare"):
            _check(args.config, overrides)
    if args.command == "evaluate":
        from flows.evaluate import evaluate_checkpoint

        evaluate_checkpoint(
            run_id=args.run_id,
            checkpoint=args.checkpoint,
            label=args.label,
            eval_overrides=overrides,
            output_dir=args.output_dir,
        )
        return
    if args.command == "ablate":
        from flows.ablate import ablate

        ablate(
            config=args.config,
            seeds=args.seeds,
            modes=args.modes,
            overrides=overrides,
            name=args.name,
            sft_from=args.sft_from,
        )
        return
    if args.command == "coldstart":
        from flows.ablate import cold_start

        cold_start(config=args.config, seeds=args.seeds, arms=args.arms, overrides=overrides, name=args.name)
        return
    if args.command == "async-compare":
        from flows.ablate import async_comparison

        async_comparison(
            config=args.config,
            seeds=args.seeds,
            modes=args.modes,
            is_cap=args.is_cap,
            overrides=overrides,
            name=args.name,
        )
        return
    from flows.pipeline import pipeline

    pipeline(config=args.config, run_id=args.run_id, overrides=overrides, stages=args.stages)


if __name__ == "__main__":
    main()
