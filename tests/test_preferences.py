"""Tests for llm_from_scratch.preferences: Bradley-Terry labels and the Bayes ceiling."""

import math

import pytest

from llm_from_scratch import gold_rewards, preferences

# ----------------------------------------------------------------------------
# Preference pairs and the Bayes ceiling


def test_bayes_accuracy_by_hand():
    # float64: 1 − 0.3 is not the literal 0.7 to the last bit; 2-3 roundings of 1.1e-16, far inside rel 1e-6
    assert preferences.bayes_accuracy([{"p_chosen": 0.9}, {"p_chosen": 0.3}]) == pytest.approx((0.9 + 0.7) / 2)


def test_preference_pairs_labels_follow_bradley_terry():
    pairs = preferences.preference_pairs(1500, seed=1)
    agree = 0.0
    for p in pairs:
        assert p["chosen"] != p["rejected"]
        assert p["gold_chosen"] == gold_rewards.story_reward(p["spec"], p["chosen"])
        assert p["gold_rejected"] == gold_rewards.story_reward(p["spec"], p["rejected"])
        margin = p["gold_chosen"] - p["gold_rejected"]
        assert p["p_chosen"] == 1 / (1 + math.exp(-preferences.BT_BETA * margin))  # exact: the same float64 ops
        agree += 1.0 if p["gold_chosen"] > p["gold_rejected"] else 0.5 if p["gold_chosen"] == p["gold_rejected"] else 0
    ceiling = preferences.bayes_accuracy(pairs)
    assert 0.8 <= ceiling <= 0.9
    # sampling, not rounding: 1,500 labels, each right with chance max(p, 1 − p): s.e. ≤ 0.0095, so ~3 s.e.
    assert agree / len(pairs) == pytest.approx(ceiling, abs=0.03)
