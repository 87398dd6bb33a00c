"""Tests for llm_from_scratch.preferences: Bradley-Terry labels and the Bayes ceiling."""

import math

import pytest

from llm_from_scratch import gold_rewards, preferences

# ----------------------------------------------------------------------------
# Preference pairs and the Bayes ceiling


def test_bayes_accuracy_by_hand():
    assert preferences.bayes_accuracy([{"p_chosen": 0.9}, {"p_chosen": 0.3}]) == pytest.approx((0.9 + 0.7) / 2)


def test_preference_pairs_labels_follow_bradley_terry():
    pairs = preferences.preference_pairs(1500, seed=1)
    agree = 0.0
    for p in pairs:
        assert p["chosen"] != p["rejected"]
        assert p["gold_chosen"] == gold_rewards.story_reward(p["spec"], p["chosen"])
        assert p["gold_rejected"] == gold_rewards.story_reward(p["spec"], p["rejected"])
        margin = p["gold_chosen"] - p["gold_rejected"]
        assert p["p_chosen"] == pytest.approx(1 / (1 + math.exp(-preferences.BT_BETA * margin)))
        agree += 1.0 if p["gold_chosen"] > p["gold_rejected"] else 0.5 if p["gold_chosen"] == p["gold_rejected"] else 0
    ceiling = preferences.bayes_accuracy(pairs)
    assert 0.8 <= ceiling <= 0.9
    assert agree / len(pairs) == pytest.approx(ceiling, abs=0.03)
