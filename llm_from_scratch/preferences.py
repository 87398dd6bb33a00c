"""Preference pairs for stories, labelled by the gold reward through Bradley-Terry noise, and the Bayes ceiling.

A pair answers one story prompt (tasks.story_prompt) with two different candidate stories, each the story generator
plus 0-2 corruptions (tasks.CORRUPTIONS). Labels are noisy, as human labels are: with r the gold story reward
(gold_rewards.story_reward), a is chosen over b with probability
    p = sigmoid(beta * (r_a - r_b))              (Bradley-Terry, beta = BT_BETA)

The Bayes ceiling. Even a reward model that knows r exactly predicts the label with accuracy max(p, 1 - p) on that
pair, so mean(max(p, 1 - p)) over the pairs is the best accuracy any reward model can reach: `bayes_accuracy`.
Likewise mean(-log p_chosen) is the Bradley-Terry loss of the gold reward itself on the realised labels: `gold_loss`.
"""

from __future__ import annotations

import math

from llm_from_scratch.gold_rewards import story_reward
from llm_from_scratch.tasks import CORRUPTIONS, corrupted_story, prompt_split, story_prompt
from llm_from_scratch.tinyworld import Recorder, pick_distinct

BT_BETA = 8.0


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def candidate_story(rng: Recorder, spec: dict) -> tuple[str, list[str]]:
    """A response to a story prompt: the story generator plus 0-2 corruptions. Returns (text, corruptions)."""
    kinds = pick_distinct(rng, CORRUPTIONS, rng.randint(0, 2))
    return corrupted_story(rng, spec, kinds), kinds


def preference_pairs(n: int, seed: int | str = 0, beta: float = BT_BETA, split: str | None = None) -> list[dict]:
    """n labelled pairs for story prompts; the label is drawn with p = sigmoid(beta * (r_a - r_b))."""
    rng, pairs = Recorder(seed), []
    while len(pairs) < n:
        prompt, spec = story_prompt(rng)
        if split is not None and prompt_split(prompt) != split:
            continue
        a, b = candidate_story(rng, spec)[0], candidate_story(rng, spec)[0]
        if a == b:
            continue
        r_a, r_b = story_reward(spec, a), story_reward(spec, b)
        if not rng.coin(sigmoid(beta * (r_a - r_b))):
            a, b, r_a, r_b = b, a, r_b, r_a
        pairs.append({"prompt": prompt, "chosen": a, "rejected": b, "gold_chosen": r_a, "gold_rejected": r_b,
                      "p_chosen": sigmoid(beta * (r_a - r_b)), "spec": spec})
    return pairs


def bayes_accuracy(pairs: list[dict]) -> float:
    """mean(max(p, 1 - p)): the best label accuracy any reward model can reach on these noisy labels."""
    return sum(max(p["p_chosen"], 1 - p["p_chosen"]) for p in pairs) / len(pairs)


def gold_loss(pairs: list[dict]) -> float:
    """mean(-log p_chosen): the Bradley-Terry loss (nats) of the gold reward itself on these realised labels."""
    return sum(-math.log(p["p_chosen"]) for p in pairs) / len(pairs)
