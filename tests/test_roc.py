"""GRPO-RoC downsampling (tasks/rl/roc.py): penalties, selection in each mode, group advantages.

Covers p_err / p_format (including the release's turn counting), the paper's weighted sampling
of positives against exact without-replacement inclusion probabilities, uniform downsampling of
negatives, the release's deterministic selection with at least 2 per class, "off", dropping of
zero-signal groups, and that every mode keeps exactly `keep` rollouts.

Run: OMP_NUM_THREADS=1 python -m pytest tests/test_roc.py -q
"""

import itertools
import math
import random

import pytest

from tasks.rl.roc import (
    PERFECT_EPS,
    TrajectoryScore,
    downsample,
    group_advantages,
    p_err,
    p_format,
    p_total,
    paper_class_counts,
    release_class_counts,
    select_group,
)


def traj(reward=1.0, calls=2, failures=0, blocks=1, turns=3, turns_after=None) -> TrajectoryScore:
    """A trajectory with sensible defaults: a perfect positive unless told otherwise."""
    if turns_after is None:
        turns_after = max(turns - 1, 0) if calls else 0
    return TrajectoryScore(reward, calls, failures, blocks, turns, turns_after)


def negative(i: int = 0) -> TrajectoryScore:
    return traj(reward=0.0, calls=i % 3, failures=i % 2 if i % 3 else 0, blocks=i % 2, turns=2)


# ------------------------------------------------------------------------------------------------
# Penalties


def test_p_err():
    assert p_err(traj(calls=0, failures=0)) == 0.5  # no tool call: fixed middling penalty
    assert p_err(traj(calls=4, failures=0)) == 0.0
    assert p_err(traj(calls=4, failures=1)) == 0.25
    assert p_err(traj(calls=3, failures=3)) == 1.0


def test_p_format_all_turns():
    assert p_format(traj(blocks=0, turns=5)) == 1.0  # no answer block
    assert p_format(traj(blocks=1, turns=5)) == 0.0  # exactly one answer
    assert p_format(traj(blocks=3, turns=4)) == 0.5  # (3 - 1) / 4
    assert p_format(traj(blocks=9, turns=4)) == 1.0  # capped at 1
    assert p_format(traj(blocks=2, turns=0)) == 1.0  # degenerate: no turns


def test_p_format_release_turn_counting():
    # One turn, no tool call: the paper's count gives 0, the release's gives the worst penalty.
    no_tool = traj(calls=0, blocks=1, turns=1, turns_after=0)
    assert p_format(no_tool, "all") == 0.0
    assert p_format(no_tool, "after_first_tool") == 1.0
    # Two answers over 4 turns, 2 of them after the first tool response.
    two_answers = traj(calls=2, blocks=2, turns=4, turns_after=2)
    assert p_format(two_answers, "all") == 0.25
    assert p_format(two_answers, "after_first_tool") == 0.5
    assert p_total(two_answers, "after_first_tool") == 0.5  # p_err 0 + 0.5


# ------------------------------------------------------------------------------------------------
# Paper mode: weighted sampling of positives, uniform negatives

# Six positives with distinct p_total, so distinct weights 1 / p_total.
POSITIVES = [
    traj(calls=0, blocks=1, turns=2),  # p_err 0.5 + p_format 0 -> 0.5, w 2
    traj(calls=2, failures=2, blocks=1, turns=3),  # 1.0 + 0 -> 1.0, w 1
    traj(calls=4, failures=1, blocks=1, turns=4),  # 0.25 + 0 -> 0.25, w 4
    traj(calls=3, failures=1, blocks=1, turns=3),  # 1/3 + 0 -> 1/3, w 3
    traj(calls=0, blocks=2, turns=4),  # 0.5 + 0.25 -> 0.75, w 4/3
    traj(calls=1, failures=1, blocks=5, turns=4),  # 1.0 + 1.0 -> 2.0, w 0.5
]


def exact_inclusion_probabilities(weights: list[float], k: int) -> list[float]:
    """P(i is among k successive weighted draws without replacement), by enumerating orders."""
    inclusion = [0.0] * len(weights)
    for order in itertools.permutations(range(len(weights)), k):
        probability, remaining = 1.0, sum(weights)
        for i in order:
            probability *= weights[i] / remaining
            remaining -= weights[i]
        for i in order:
            inclusion[i] += probability
    return inclusion


def test_paper_selection_frequencies_match_exact_inclusion():
    # Interleave positives and negatives so index order says nothing about the class.
    group, positive_index, negative_index = [], [], []
    for j in range(6):
        positive_index.append(len(group))
        group.append(POSITIVES[j])
        negative_index.append(len(group))
        group.append(negative(j))
    keep, draws = 6, 10_000
    rng = random.Random(1234)
    counts = [0] * len(group)
    for _ in range(draws):
        kept = select_group(group, keep, "paper", rng)
        assert len(kept) == keep and kept == sorted(set(kept))
        assert sum(group[i].reward > 0 for i in kept) == 3  # 6 positives halved
        for i in kept:
            counts[i] += 1

    weights = [1.0 / p_total(t) for t in POSITIVES]
    expected = exact_inclusion_probabilities(weights, 3)
    assert math.isclose(sum(expected), 3.0)  # float64: ~1e3 roundings over 120 orders, ~1e-13 < rel_tol 1e-9
    tolerance = 0.015  # ~3 standard errors at 10,000 draws (se <= 0.005)
    for j, i in enumerate(positive_index):
        assert abs(counts[i] / draws - expected[j]) < tolerance, (j, counts[i] / draws, expected[j])
    for i in negative_index:  # 3 of 6 uniformly: each kept with probability 1/2
        assert abs(counts[i] / draws - 0.5) < tolerance


def test_perfect_positives_get_the_largest_weight():
    # Two perfect positives (p_total = 0) among imperfect ones: both are essentially always kept.
    perfect = traj(calls=3, failures=0, blocks=1, turns=4)
    assert p_total(perfect) == 0.0
    positives = [POSITIVES[0], perfect, POSITIVES[2], perfect, POSITIVES[5], POSITIVES[1]]
    group = positives + [negative(j) for j in range(6)]
    rng = random.Random(0)
    both = sum({1, 3} <= set(select_group(group, 6, "paper", rng)) for _ in range(2000))
    # weights 1/eps = 1000 vs <= 4: P(a perfect one is not among 3 draws) is tiny
    assert both >= 1990
    assert 10 * max(1.0 / p_total(t) for t in POSITIVES) < 1.0 / PERFECT_EPS


def test_paper_class_counts_keep_a_lone_member():
    assert paper_class_counts(16, 16, 16) == (8, 8)
    assert paper_class_counts(1, 31, 16) == (1, 15)  # the only positive survives
    assert paper_class_counts(31, 1, 16) == (15, 1)  # the only negative survives
    assert paper_class_counts(5, 27, 16) == (3, 13)  # odd sizes: extra slot to the smaller class
    assert paper_class_counts(27, 5, 16) == (13, 3)


# ------------------------------------------------------------------------------------------------
# Release mode


def test_release_is_deterministic_with_min_two_per_class():
    # 2 positives of 32: round(2 * 16 / 32) = 1, raised to 2.
    group = [negative(j) for j in range(30)]
    group.insert(7, POSITIVES[5])
    group.insert(20, POSITIVES[2])
    kept_a = select_group(group, 16, "release", random.Random(0))
    kept_b = select_group(group, 16, "release", random.Random(99))
    assert kept_a == kept_b  # the rng is unused
    assert 7 in kept_a and 20 in kept_a
    negatives = [i for i, t in enumerate(group) if t.reward == 0]
    assert [i for i in kept_a if group[i].reward == 0] == negatives[:14]  # first in generation order
    assert release_class_counts(2, 30, 16) == (2, 14)
    assert release_class_counts(1, 31, 16) == (1, 15)  # a lone member: min(2, 1)
    assert release_class_counts(30, 2, 16) == (14, 2)


def test_release_positives_lowest_penalty_ties_by_index():
    # penalties: 2.0, 0.5, 0.25, 0.5, 1.0, 0.25 -> lowest three are 2, 5 (0.25), then 1 (0.5 beats 3 by index)
    pos = [POSITIVES[5], POSITIVES[0], POSITIVES[2], POSITIVES[0], POSITIVES[1], POSITIVES[2]]
    group = pos + [negative(j) for j in range(6)]
    kept = select_group(group, 6, "release", random.Random(0))
    assert [i for i in kept if i < 6] == [1, 2, 5]
    assert [i for i in kept if i >= 6] == [6, 7, 8]


# ------------------------------------------------------------------------------------------------
# Off, totals, downsample


def test_off_keeps_all():
    group = POSITIVES[:3] + [negative(j) for j in range(5)]
    assert select_group(group, 8, "off", random.Random(0)) == list(range(8))


@pytest.mark.parametrize("mode", ["paper", "release"])
@pytest.mark.parametrize("keep,size", [(16, 32), (8, 16), (5, 10), (6, 11)])
def test_total_kept_is_always_keep(mode, keep, size):
    rng = random.Random(7)
    for n_pos in range(size + 1):
        group = [POSITIVES[j % 6] for j in range(n_pos)] + [negative(j) for j in range(size - n_pos)]
        rng.shuffle(group)
        kept = select_group(group, keep, mode, rng)
        assert len(kept) == keep and len(set(kept)) == keep
        kept_pos = sum(group[i].reward > 0 for i in kept)
        if 0 < n_pos < size:  # mixed group: both classes survive, so the advantage is not zero
            assert 0 < kept_pos < keep


def test_downsample_drops_zero_signal_groups():
    mixed = POSITIVES + [negative(j) for j in range(6)]
    all_right = [POSITIVES[j % 6] for j in range(12)]
    all_wrong = [negative(j) for j in range(12)]
    result = downsample([all_right, mixed, all_wrong, mixed], 6, "paper", random.Random(3))
    assert result.dropped_zero_signal == 2
    assert result.kept[0] == [] and result.kept[2] == []
    assert len(result.kept[1]) == 6 and len(result.kept[3]) == 6
    assert result.kept_positives == 6 and result.kept_negatives == 6
    for name, value in result.metrics().items():
        assert isinstance(value, float), name
    assert 0.0 <= result.kept_pos_tool_error_share <= 1.0

    # Without the drop, all-equal groups are downsampled like any other.
    kept = downsample([all_wrong], 6, "paper", random.Random(3), drop_zero_signal=False).kept
    assert len(kept[0]) == 6


def test_downsample_stats_favour_clean_positives():
    # Over many groups, kept positives must have lower penalties than the ones RoC left out.
    groups = [POSITIVES + [negative(j) for j in range(6)] for _ in range(300)]
    result = downsample(groups, 6, "paper", random.Random(5))
    kept_penalty = result.kept_pos_p_err + result.kept_pos_p_format
    assert kept_penalty < result.dropped_pos_p_err + result.dropped_pos_p_format
    # Release is the extreme case: the three lowest penalties (0.25, 1/3, 0.5) always win.
    release = downsample(groups[:1], 6, "release", random.Random(5))
    # float64: means of 3 terms summed in another order, a few u ~ 1e-16 (isclose: rel_tol 1e-9)
    assert math.isclose(release.kept_pos_p_err + release.kept_pos_p_format, (0.25 + 1 / 3 + 0.5) / 3)


def test_group_advantages_population_std():
    rewards = [1.0, 0.0, 0.0, 0.0]
    mean, std = 0.25, math.sqrt(0.1875)  # population std: divide by G = 4
    expected = [(r - mean) / (std + 1e-6) for r in rewards]
    assert group_advantages(rewards) == pytest.approx(expected)
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert sum(group_advantages([1.0, 0.0, 1.0, 1.0, 0.0])) == pytest.approx(0.0, abs=1e-9)  # float64: 5 terms, ~1e-15
    assert group_advantages([]) == []
