"""The RoC ablation's and the cold-start experiment's numbers and reports, from run results made up
here (no pipeline run), and how a run starts from another run's policy."""

import json
import math
from pathlib import Path

import pytest

from tasks.summary.mode_comparison import compare, step_rows, write_report
from tasks.summary.runs import DRAWN_SHARE, LUCKY_SHARE, RECOVERED_SHARE, RunResult, paired_gain, positive_shares

NAN = math.nan


def _run(seed: int, mode: str, sft: float, final: float, shares: list[float]) -> RunResult:
    return RunResult(
        seed,
        mode,
        f"roc-s{seed}-{mode}",
        {"base": 0.0, "sft": sft, "stage1": final},
        {
            "reward_mean": [0.1] * len(shares),
            "roc/kept_pos_tool_error_share": shares,
            DRAWN_SHARE: [0.4] * len(shares),
            RECOVERED_SHARE: [0.3] * len(shares),
            LUCKY_SHARE: [0.1] * len(shares),
            "response_length_mean": [50.0] * len(shares),
            "turns_mean": [2.0] * len(shares),
        },
        [len(shares)],
    )


RESULTS = [
    _run(0, "paper", 0.2, 0.5, [0.2, 0.0, NAN]),
    _run(1, "paper", 0.3, 0.5, [0.1, 0.1]),
    _run(0, "off", 0.2, 0.4, [0.3, 0.3, NAN]),
    _run(1, "off", 0.3, 0.4, [0.2, 0.2]),
]


def test_gain_and_error_share_are_averaged_per_seed_then_over_seeds() -> None:
    numbers = compare(RESULTS)
    paper, off = numbers["modes"]["paper"], numbers["modes"]["off"]
    assert paper["gain"][0] == pytest.approx(0.25) and paper["gain"][1] == pytest.approx(math.sqrt(0.005))
    assert off["final"][:2] == pytest.approx((0.4, 0.0))
    # steps without kept positives (NaN) do not count: paper 0.1 and 0.1, off 0.3 and 0.2
    assert paper["error_share_by_seed"] == pytest.approx([0.1, 0.1])
    assert off["error_share"][0] == pytest.approx(0.25)
    assert numbers["relative_reduction"] == pytest.approx(0.6)
    # per seed: 1 - 0.1 / 0.3 and 1 - 0.1 / 0.2
    assert numbers["relative_reduction_by_seed"] == pytest.approx({0: 2 / 3, 1: 0.5})
    assert paper["drawn_error_share"][:2] == pytest.approx((0.4, 0.0))


def test_positive_shares_count_positives_with_any_failed_call_recovered_or_lucky() -> None:
    rows = [
        {"reward": 1.0, "tool_failures": 0, "tool_statuses": ["ok"]},
        {"reward": 1.0, "tool_failures": 2, "tool_statuses": ["parse_error", "error", "ok"]},  # recovered
        {"reward": 0.0, "tool_failures": 1, "tool_statuses": ["error"]},
        {"reward": 1.0, "tool_failures": 1, "tool_statuses": ["ok", "timeout", "internal"]},  # lucky
        {"reward": 1.0, "tool_failures": 0, "tool_statuses": []},
    ]
    shares = positive_shares(rows)
    assert shares[DRAWN_SHARE] == pytest.approx(2 / 4)
    assert shares[RECOVERED_SHARE] == pytest.approx(1 / 4) and shares[LUCKY_SHARE] == pytest.approx(1 / 4)
    assert all(math.isnan(v) for v in positive_shares(rows[2:3]).values())


def test_a_paired_gain_carries_the_standard_error_of_the_evaluations_sampling() -> None:
    def rows(rewards: dict[str, list[float]]) -> list[dict]:
        return [{"problem_id": p, "reward": r} for p, samples in rewards.items() for r in samples]

    before = rows({"a": [0, 0, 0, 0], "b": [1, 0, 0, 0], "c": [1, 1, 1, 1]})
    after = rows({"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [1, 1, 1, 1]})
    gain, error = paired_gain(before, after)
    assert gain == pytest.approx((0.5 + 0.75 + 0) / 3)
    # sample variances over k: a after 1/3 / 4, b before 1/4 / 4; the rest draw one value
    assert error == pytest.approx(math.sqrt(1 / 12 + 1 / 16) / 3)
    # two evaluations of one policy: no gain, and both draws' error
    assert paired_gain(after, after) == (0.0, pytest.approx(math.sqrt(2 / 12) / 3))
    with pytest.raises(ValueError, match="different problems .* 1 in one only"):
        paired_gain(before, rows({"a": [1, 1], "b": [1, 1]}))
    with pytest.raises(ValueError, match="problem c has one sample"):
        paired_gain(before, rows({"a": [1, 1], "b": [1, 1], "c": [1]}))


def test_drawn_share_early_and_late_in_stage_1_and_its_reduction() -> None:
    def run(mode: str, drawn: list[float]) -> RunResult:
        result = _run(0, mode, 0.2, 0.4, [0.1] * len(drawn))
        result.steps[DRAWN_SHARE] = drawn
        result.stage_ends = [6, len(drawn)]  # stage 1 is the first 6 steps
        return result

    numbers = compare(
        [run("paper", [0.3, 0.3, 0.3, 0.1, 0.1, NAN, 0.9]), run("off", [0.3, 0.2, 0.4, 0.3, 0.2, 0.2, 0.0])]
    )
    paper, off = numbers["modes"]["paper"], numbers["modes"]["off"]
    assert paper["drawn_first"][0] == pytest.approx(0.3) and off["drawn_first"][0] == pytest.approx(0.3)
    assert paper["drawn_end"][0] == pytest.approx(0.1) and off["drawn_end"][0] == pytest.approx(0.7 / 3)
    assert numbers["drawn_end_reduction"] == pytest.approx(1 - 0.1 / (0.7 / 3))


def test_a_mode_without_positives_reports_nan_not_zero(tmp_path) -> None:
    numbers = compare([_run(0, "paper", 0.0, 0.0, [NAN, NAN]), _run(0, "off", 0.0, 0.0, [NAN])])
    assert math.isnan(numbers["modes"]["paper"]["error_share"][0])
    assert math.isnan(numbers["relative_reduction"])
    report = write_report(
        [_run(0, "paper", 0.0, 0.0, [NAN]), _run(0, "off", 0.0, 0.0, [NAN])], tmp_path, "rstar2 ablate"
    ).read_text()
    assert "| paper | 0.000 ± 0.000 | 0.000 ± 0.000 | +0.0 ± 0.0 |" in report
    assert "| paper | n/a | 40.0 ± 0.0 | 40.0 ± 0.0 | 40.0 ± 0.0 | 30.0 ± 0.0 | 10.0 ± 0.0 | 50.0 | 2.00 |" in report
    assert "not measurable" in report


def test_report_has_a_row_per_mode_the_command_and_a_png(tmp_path) -> None:
    report = write_report(RESULTS, tmp_path, "rstar2 ablate --seeds 2")
    text = report.read_text()
    assert "`rstar2 ablate --seeds 2`" in text and "![curves](curves.png)" in text
    assert "| paper | 0.250 ± 0.071 | 0.500 ± 0.000 | +25.0 ± 7.1 |" in text
    assert (
        "| paper | 10.0 ± 0.0 | 40.0 ± 0.0 | 40.0 ± 0.0 | 40.0 ± 0.0 | 30.0 ± 0.0 | 10.0 ± 0.0 | 50.0 | 2.00 |" in text
    )
    assert "| off | 0.250 ± 0.071 | 0.400 ± 0.000 | +15.0 ± 7.1 |" in text
    assert "| off | 25.0 ± 7.1 | 40.0 ± 0.0 |" in text
    assert "60% lower (relative); per seed 67% / 50%, mean 58.3 ± 11.8%." in text
    assert "| `roc-s1-off` | base 0.000 -> sft 0.300 -> stage1 0.400 | n/a |" in text
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_step_table_has_a_row_per_step_and_mode_numbered_within_its_stage() -> None:
    def run(seed: int, mode: str, drawn: list[float], kept: list[float]) -> RunResult:
        result = _run(seed, mode, 0.2, 0.4, kept)
        result.steps[DRAWN_SHARE] = drawn
        result.stage_ends = [2, 3]
        return result

    rows = step_rows(
        [
            run(0, "paper", [0.2, 0.1, NAN], [0.1, NAN, NAN]),
            run(1, "paper", [0.4, 0.1, NAN], [0.3, NAN, NAN]),
            run(0, "off", [0.3, 0.2, 0.1], [0.3, 0.2, NAN]),
        ]
    )
    assert rows[0] == "| stage | step | roc mode | drawn | kept | recovered | lucky | length | turns |"
    assert len(rows) == 2 + 3 * 2
    assert rows[2] == "| 1 | 0 | paper | 30.0 ± 14.1 | 20.0% | 30.0% | 10.0% | 50.0 | 2.00 |"
    assert rows[5] == "| 1 | 1 | off | 20.0 ± 0.0 | 20.0% | 30.0% | 10.0% | 50.0 | 2.00 |"
    # stage 2's first step: no positive in either paper seed, and none kept under off
    assert rows[6] == "| 2 | 0 | paper | n/a | n/a | 30.0% | 10.0% | 50.0 | 2.00 |"
    assert rows[7] == "| 2 | 0 | off | 10.0 ± 0.0 | n/a | 30.0% | 10.0% | 50.0 | 2.00 |"


@pytest.mark.slow
def test_ablate_flow_runs_each_mode_from_one_sft_policy_and_reports(tmp_path, prefect_api) -> None:
    """Two modes, one seed, at a small size: the second mode's run starts from the first one's SFT
    policy (not trained again) and the report compares both. Where a second ablation (`sft_from`)
    starts: the unit tests below."""
    from flows.ablate import ablate
    from tasks.config import default_config_path
    from tests.small_run import small_run, stage

    overrides = {
        **small_run([stage("stage1", 2)]),
        "output_dir": str(tmp_path),
        "data.n_train": 24,
        "rl.group_size": 2,
    }
    report = ablate(config=str(default_config_path()), seeds=1, modes=["paper", "off"], overrides=overrides, name="t")
    paper, off = tmp_path / "runs" / "t-s0-paper", tmp_path / "runs" / "t-s0-off"
    sft = (paper / "models" / "sft" / "model.safetensors").read_bytes()
    assert (off / "models" / "sft" / "model.safetensors").read_bytes() == sft
    assert not (off / "state" / "sft.json").read_text().count(str(paper))  # paths point into its own folder
    assert json.loads((off / "config.json").read_text())["rl"]["roc"]["mode"] == "off"
    for run in (paper, off):
        assert sorted(p.name for p in (run / "steps" / "stage=stage1").iterdir()) == ["step=0", "step=1"]
        assert (run / "evaluations" / "checkpoint=sft").exists() and (run / "models" / "stage1").exists()
        assert not (run / "evaluations" / "checkpoint=base").exists()  # the tiny default skips it
    text = Path(report).read_text()
    assert "| paper |" in text and "| off |" in text and "| `t-s0-off` | sft " in text
    assert "rstar2 ablate --config" in text and "--seeds 1 --modes paper off --name t " in text
    assert (Path(report).parent / "curves.png").exists()


def _finished_sft_run(run_dir: Path, cfg) -> Path:
    """A run folder as the pipeline leaves it after SFT (files with placeholder contents)."""
    for folder in (
        "data",
        "models/base",
        "models/sft",
        "evaluations/checkpoint=sft/benchmark=heldout",
        "rollouts/stage=eval-sft/step=0",
    ):
        (run_dir / folder).mkdir(parents=True)
        (run_dir / folder / "part-0.parquet").write_bytes(b"rows")
    (run_dir / "state").mkdir()
    for name in ("curate", "base", "sft", "eval-sft"):
        (run_dir / "state" / f"{name}.json").write_text(json.dumps({"result": str(run_dir / "models" / name)}))
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return run_dir


def test_a_run_starts_from_another_runs_sft_policy_only_if_their_configs_differ_in_rl_or_scheduling(tmp_path) -> None:
    from tasks.config import default_config_path, load_config
    from tasks.store.run_folder import arm_source, sft_run_of, start_from_run
    from tasks.summary.mode_comparison import ablation_command

    def cfg(**overrides):
        return load_config(default_config_path(), {"output_dir": str(tmp_path), **overrides})

    runs = tmp_path / "runs"
    source = _finished_sft_run(runs / "a-s0-paper", cfg())
    assert sft_run_of(runs, "a", 0) == source
    with pytest.raises(ValueError, match="no run a-s1-<mode>"):
        sft_run_of(runs, "a", 1)
    # An ablation's runs: a seed's later arms from its first arm's run, the first from scratch or
    # from ablation `sft_from`'s run of the seed; its report's command names that ablation.
    assert arm_source(runs, "b", 0, "off", "paper", None) == runs / "b-s0-paper"
    assert arm_source(runs, "b", 0, "paper", "paper", None) is None
    assert arm_source(runs, "b", 0, "paper", "paper", "a") == source
    assert arm_source(runs, "b", 0, "off", "paper", "a") == runs / "b-s0-paper"
    command = ablation_command("configs/tiny.yaml", 1, ["paper"], {"rl.optim.lr": 1e-5}, "b", sft_from="a")
    assert "--name b --sft-from a --set=rl.optim.lr=1e-05" in command

    scheduling = {"engines.scheduler": "kv_live", "engines.kv_overcommit": 8}
    start_from_run(source, runs / "b-s0-paper", cfg(**{"rl.optim.lr": 1e-5, "rl.roc.mode": "off", **scheduling}))
    target = runs / "b-s0-paper"
    assert (target / "models" / "sft" / "part-0.parquet").read_bytes() == b"rows"
    assert json.loads((target / "state" / "sft.json").read_text())["result"] == str(target / "models" / "sft")
    assert not (target / "config.json").exists()  # the pipeline writes its own

    with pytest.raises(ValueError, match=r"differ in \['seed', 'sft'\]"):
        start_from_run(source, runs / "c-s1-paper", cfg(seed=1, **{"sft.epochs": 3}))
    assert not (runs / "c-s1-paper").exists()


def test_an_arm_starts_from_another_runs_base_model_if_only_the_sft_mode_or_rl_differ(tmp_path) -> None:
    from tasks.config import default_config_path, load_config
    from tasks.store.run_folder import start_from_run

    def cfg(**overrides):
        return load_config(default_config_path(), {"output_dir": str(tmp_path), **overrides})

    runs = tmp_path / "runs"
    source = _finished_sft_run(runs / "c-s0-non_reasoning", cfg())
    target = runs / "c-s0-reasoning"
    start_from_run(source, target, cfg(**{"sft.mode": "reasoning", "rl.optim.lr": 1e-5}), "base")
    assert (target / "models" / "base" / "part-0.parquet").read_bytes() == b"rows"
    assert not (target / "models" / "sft").exists() and not (target / "evaluations").exists()
    assert sorted(p.name for p in (target / "state").iterdir()) == ["base.json", "curate.json"]
    with pytest.raises(ValueError, match=r"differ in \['sft'\], and only rl, sft.mode may"):
        start_from_run(source, runs / "d-s0-reasoning", cfg(**{"sft.mode": "reasoning", "sft.epochs": 3}), "base")


def test_half_final_step_is_where_the_reward_first_reaches_half_its_final_mean() -> None:
    from tasks.summary.cold_start import half_final_step

    assert half_final_step([0.0, 0.1, 0.25, 0.3, 0.5, 0.4, 0.6]) == 3  # final 0.5, half 0.25
    assert half_final_step([0.4, 0.1, 0.5, 0.5, 0.5]) == 1
    assert math.isnan(half_final_step([0.2, 0.0, 0.0, 0.0])) and math.isnan(half_final_step([]))


def test_cold_start_report_compares_the_arms_over_seeds(tmp_path) -> None:
    from tasks.summary.cold_start import summarize, write_report

    def arm_run(seed, arm, sft, final, lengths):
        steps = {
            "reward_mean": [0.1, 0.2, 0.4, 0.4, 0.4, 0.2],
            "response_length_mean": lengths,
            "turns_mean": [2.0, 2.0, 2.0, 3.0, 3.0, 9.0],
            "tool_error_rate": [0.5, 0.5, 0.5, 0.1, 0.1, 0.1],
        }
        return RunResult(seed, arm, f"c-s{seed}-{arm}", {"sft": sft, "stage1": 0.0, "stage2": final}, steps, [5, 6])

    results = [
        arm_run(0, "non_reasoning", 0.1, 0.5, [100.0, 100, 100, 60, 60, 500]),
        arm_run(1, "non_reasoning", 0.2, 0.6, [120.0, 120, 120, 80, 80, 500]),
        arm_run(0, "reasoning", 0.5, 0.5, [90.0, 90, 90, 90, 90, 500]),
    ]
    arms = summarize(results)
    nr = arms["non_reasoning"]
    # abs=1e-4: 0.0707 is sqrt(0.005) = 0.070711 written to 4 places; float64 adds ~1e-17
    assert nr["sft"][:2] == pytest.approx((0.15, 0.0707), abs=1e-4) and nr["gain"][0] == pytest.approx(0.4)
    # "at the end" is the first stage's last 3 steps: step 6 (the hard stage) is not in it
    assert nr["length_first"][0] == pytest.approx(110) and nr["length_end"][0] == pytest.approx(250 / 3)
    assert nr["turns_first"][0] == 2.0 and nr["turns_end"][0] == pytest.approx(8 / 3)
    assert nr["tool_error_rate"][0] == pytest.approx(0.3) and nr["half_final_step"][0] == 2
    assert arms["reasoning"]["gain"][:3] == (0.0, 0.0, 1)
    text = write_report(results, tmp_path, "rstar2 coldstart --seeds 2").read_text()
    assert "| non_reasoning | 0.150 ± 0.071 | 0.550 ± 0.071 | +40.0 ± 0.0 | 110 ± 14 -> 83 ± 14 |" in text
    assert "| `c-s0-reasoning` | sft 0.500 -> stage1 0.000 -> stage2 0.500 | n/a |" in text
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_async_report_sets_each_mode_against_the_range_of_off(tmp_path) -> None:
    from tasks.summary.async_comparison import summarize, write_report

    def arm_run(seed, arm, final, lag):
        steps = {
            "reward_mean": [0.1, 0.3],
            "staleness/mean": [0.0, lag],
            "tool_error_rate": [0.2, 0.2],
            "idle/trainer": [0.6, 0.4],
            "idle/engines": [0.5, 0.3],
            "time_step_s": [6.0, 4.0],
        }
        return RunResult(seed, arm, f"a-s{seed}-{arm}", {"sft": 0.3, "stage1": final}, steps, [2])

    results = [arm_run(0, "off", 0.4, 0.0), arm_run(1, "off", 0.6, 0.0)]
    results += [arm_run(0, "one_step", 0.5, 1.0), arm_run(1, "one_step", 0.55, 1.0)]
    results += [arm_run(0, "bounded", 0.2, 2.0), arm_run(1, "bounded", 0.3, 2.0)]
    arms = summarize(results)
    assert arms["one_step"]["within_baseline"] and not arms["bounded"]["within_baseline"]
    assert arms["one_step"]["gain"][0] == pytest.approx(0.225) and arms["one_step"]["staleness"][0] == 0.5
    assert arms["off"]["idle_trainer"][0] == pytest.approx(0.5) and arms["off"]["step_s"][0] == 5.0
    text = write_report(results, tmp_path, "rstar2 async-compare --seeds 2").read_text()
    assert "| one_step | 0.300 ± 0.000 | 0.525 ± 0.035 | +22.5 ± 3.5 | 0.500 ± 0.000 |" in text
    assert "off's range after RL over seeds: 0.400 to 0.600." in text
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_on_other_cores_or_threads_may_start_from_another_runs_sft_policy(tmp_path) -> None:
    from tasks.config import default_config_path, load_config
    from tasks.store.run_folder import start_from_run

    def cfg(**overrides):
        return load_config(default_config_path(), {"output_dir": str(tmp_path), **overrides})

    runs = tmp_path / "runs"
    source = _finished_sft_run(runs / "s-s0-off", cfg())
    start_from_run(source, runs / "s-s0-split", cfg(**{"cluster.placement": "split", "trainer.threads": 1}))
    assert (runs / "s-s0-split" / "models" / "sft").exists()
    with pytest.raises(ValueError, match=r"differ in \['trainer'\]"):
        start_from_run(source, runs / "s-s0-z3", cfg(**{"trainer.zero_stage": 3}))
