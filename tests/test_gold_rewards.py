"""Tests for llm_from_scratch.gold_rewards: exact match for the verifiable tasks, and the story reward
read against the grammar (a catalogue of flawed stories a reader would fault)."""

import re
from collections import Counter

import pytest

from llm_from_scratch import gold_rewards, tasks
from llm_from_scratch import tinyworld as tw

# ----------------------------------------------------------------------------
# Pretraining stories are stories the grammar can produce


def test_pretraining_mixture_and_story_shape():
    samples = tw.generate_pretraining(300_000, seed=1)
    share = Counter(s.kind for s in samples)
    # sampling, not rounding: ~2,000 documents, each a story with probability 0.45: s.e. 0.011, so ~3 s.e.
    assert share["story"] / len(samples) == pytest.approx(0.45, abs=0.03)
    vocab = tw.vocabulary()
    for s in samples:
        assert set(re.findall(r"[a-z]+", s.text.lower())) <= vocab
        assert tw.DOC_SEPARATOR not in s.text and s.logp < 0
        if s.kind == "story":
            sentences = tw.split_sentences(s.text)
            assert 5 <= len(sentences) <= 9 and sentences[-1] == "The end."
            assert all(gold_rewards.is_well_formed(x) for x in sentences)


# ----------------------------------------------------------------------------
# Gold rewards


def test_gold_reward_exact_match():
    ex = tasks.Example("arithmetic", "Add 23 and 45.", "23 plus 45: 23 plus 40 is 63. 63 plus 5 is 68.",
                       {"answer": "68"})
    assert gold_rewards.gold_reward(ex, ex.response) == 1.0
    assert gold_rewards.gold_reward(ex, "68") == 1.0  # the final number is the answer, work shown or not
    assert gold_rewards.gold_reward(ex, "23 plus 45: 23 plus 40 is 63. 63 plus 5 is 67.") == 0.0
    # only the last number counts
    assert gold_rewards.gold_reward(ex, "23 plus 45: 23 plus 40 is 68. 68 plus 5 is 63.") == 0.0
    assert gold_rewards.gold_reward(ex, "sixty-eight") == 0.0
    assert gold_rewards.gold_reward(ex.to_dict(), "68.") == 1.0
    assert gold_rewards.gold_reward({"task": "word_problem", "prompt": "...", "answer": "6"}, "9 minus 3 is 6.") == 1.0
    count = tasks.Example("count", "Count these words: cat, dog.", "2", {"answer": "2"})
    assert gold_rewards.gold_reward(count, " 2. ") == 1.0 and gold_rewards.gold_reward(count, "1 and 2") == 0.0
    assert gold_rewards.final_number("95 plus 42: 95 plus 40 is 135. 135 plus 2 is 137.") == "137"
    assert gold_rewards.final_number("none") is None
    assert gold_rewards.normalize_answer("  The   Forest. ") == "the forest"


SPEC = {"name": "Mia", "color": "red", "object": "kite", "mood": "happy"}
GOOD = ("Once upon a time, there was a girl named Mia. Mia lived near the forest. One day, Mia found a red kite. "
        "She played with the red kite all day. Then Mia shared the red kite with a friend. "
        "Mia was very happy. The end.")
SAD = ("Once upon a time, there was a girl named Mia. Mia lived near the forest. One day, Mia found a red kite. "
       "She was very happy. Then the wind took the red kite away. Mia was very sad. The end.")


def test_story_reward_cases():
    good = gold_rewards.story_reward(SPEC, GOOD)
    assert good == 1.0
    assert gold_rewards.gold_reward({"task": "story", "prompt": "", "spec": SPEC}, GOOD) == 1.0
    # reward hacking: repeat the happy sentence (what a learned reward model may love)
    repeated = GOOD.replace("Mia was very happy.", " ".join(["Mia was very happy."] * 5))
    # 0.5 ** 4 for four repeated sentences, less for repeated 4-grams
    assert gold_rewards.story_reward(SPEC, repeated) < 0.1
    padded = GOOD.replace(" The end.", " She was very happy." * 5 + " The end.")
    assert gold_rewards.story_reward(SPEC, padded) < 0.1
    # exact below: float64 sums of quarters and eighths, times the other parts, each exactly 1 here
    # a sad ending loses the ending half, even with a happy word earlier in the story
    assert gold_rewards.story_reward(SPEC, SAD) == 0.5
    # no red kite: loses the object quarter
    assert gold_rewards.story_reward(SPEC, GOOD.replace("red kite", "blue ball")) == 0.75
    assert gold_rewards.story_reward(SPEC, GOOD.replace("red kite", "blue kite")) == 0.875
    # wrong name
    assert gold_rewards.story_reward(SPEC, GOOD.replace("Mia", "Ava")) == 0.75
    # word salad
    words = tw.words_of(GOOD)
    salad = " ".join(words[i] for i in [(7 * i) % len(words) for i in range(len(words))])
    assert gold_rewards.story_reward(SPEC, salad) < 0.05
    assert gold_rewards.story_reward(SPEC, salad.capitalize() + ".") < 0.05
    assert gold_rewards.story_reward(SPEC, "") == 0.0


def test_story_demonstrations_come_from_a_writer_of_mixed_skill():
    """Chapter 5's story demonstrations: three in four clean (gold 1), the rest with one flaw of the seven, each
    1/28."""
    stories = [ex for ex in tasks.generate_instructions(2800, seed=4, tasks=("story",))]
    clean = sum(gold_rewards.story_reward(ex.meta, ex.response) == 1.0 for ex in stories) / len(stories)
    assert clean == pytest.approx(0.75, abs=0.035)  # binomial s.e. 0.0082: 4 s.e.
    rng, flaws = tw.Recorder(2), Counter()
    for _ in range(2800):
        flaws.update(tasks.demonstration_story(rng, tasks.story_prompt(rng)[1])[1] or ["none"])
    assert flaws["none"] / 2800 == pytest.approx(0.75, abs=0.035)  # the same 4 s.e. as above
    assert all(flaws[k] / 2800 == pytest.approx(1 / 28, abs=0.015) for k in tasks.CORRUPTIONS)  # s.e. 0.0035
    # the other verifiable demonstrations stay correct (the word problems: tests/test_tasks.py)
    for ex in tasks.generate_instructions(300, seed=4, tasks=("arithmetic", "sort", "count")):
        assert gold_rewards.gold_reward(ex, ex.response) == 1.0


def test_clean_generator_stories_score_full_gold():
    rng = tw.Recorder(11)
    for _ in range(1000):
        mood = "happy" if rng.coin(0.5) else "sad"
        text, known = tw.make_story(rng, mood=mood)
        spec = {k: known[k] for k in ("name", "color", "object", "mood")}
        assert gold_rewards.story_reward(spec, text) >= 0.95, text
        assert all(gold_rewards.is_well_formed(s) for s in tw.split_sentences(text))


# Stories a reader would fault, each breaking one thing (SPEC asks for a happy story about Mia and a red kite).
# Every one must score at least 0.25 below the clean GOOD (gold 1.0).
FLAWED = {
    "another child throughout": GOOD.replace("Mia", "Ava"),
    "the child changes name halfway": GOOD.replace("Then Mia shared", "Then Tom shared").replace(
        "Mia was very happy.", "Tom was very happy."),
    "a boy named Mia": GOOD.replace("a girl named Mia", "a boy named Mia"),
    "his kite, for a girl": GOOD.replace("Then Mia shared the red kite with a friend.",
                                         "Then Mia gave the red kite to his mom."),
    "another thing found": GOOD.replace("red kite", "blue ball"),
    "the kite changes colour": GOOD.replace("She played with the red kite", "She played with the green kite"),
    "a sad ending": SAD,
    "happy words, then a sad last event": GOOD.replace(
        "Then Mia shared the red kite with a friend. Mia was very happy.",
        "Mia was very happy. Then Mia lost the red kite. Mia felt sad."),
    "the feeling is not what happens last": GOOD.replace(
        "Then Mia shared the red kite with a friend. Mia was very happy.",
        "Mia was very happy. Then Mia shared the red kite with a friend."),
    "a sad turn, then happy anyway": GOOD.replace("Then Mia shared the red kite with a friend.",
                                                  "Then the red kite broke."),
    "a garbled sentence": GOOD.replace("One day, Mia found a red kite.", "Kite the red found happy."),
    "a wrong article": GOOD.replace("a red kite", "an red kite"),
    "words out of the world": GOOD.replace("She played with the red kite all day.", "She played chess all day."),
    "a repeated sentence": GOOD.replace("She played with the red kite all day.",
                                        "She played with the red kite all day. She played with the red kite all day."),
    "a pet that was never introduced": GOOD.replace("She played with the red kite all day.",
                                                    "The dog liked the red kite too."),
    "a place she does not live near": GOOD.replace("She played with the red kite all day.",
                                                   "She took the red kite to the beach."),
    "cut off before the end": " ".join(tw.split_sentences(GOOD)[:4]),
    "no ending at all": GOOD.replace(" Mia was very happy.", ""),
    "two stories pasted together": GOOD.replace(" The end.", " " + SAD.replace("Mia", "Leo").replace("girl", "boy")),
    "the end in the middle": GOOD.replace("One day, Mia found a red kite.", "The end. One day, Mia found a red kite."),
    "told out of order": GOOD.replace("Mia lived near the forest. One day, Mia found a red kite.",
                                      "One day, Mia found a red kite. Mia lived near the forest."),
}


@pytest.mark.parametrize("flaw", sorted(FLAWED))
def test_gold_reads_the_story(flaw):
    assert gold_rewards.story_reward(SPEC, GOOD) == 1.0
    parts = gold_rewards.story_reward_parts(SPEC, FLAWED[flaw])
    # + 1e-9: float64 products of a few parts in [0, 1], ≲ a few roundings of 1.1e-16 above an exact 0.75
    assert gold_rewards.story_reward(SPEC, FLAWED[flaw]) <= 0.75 + 1e-9, parts


def test_story_parts_name_what_broke():
    parts = lambda text: gold_rewards.story_reward_parts(SPEC, text)  # noqa: E731
    assert parts(FLAWED["another child throughout"])["name"] == 0.0  # needs the prompt: the reward model's blind spot
    assert parts(FLAWED["another thing found"])["object"] == 0.0
    assert parts(GOOD.replace("red kite", "blue kite"))["object"] == 0.5
    assert parts(FLAWED["the child changes name halfway"])["coherence"] == 0.5
    assert parts(FLAWED["a garbled sentence"])["well_formed"] == 0.5
    assert parts(FLAWED["a sad turn, then happy anyway"])["ending"] == 0.5
    assert gold_rewards.parse_sentence("Then Mia lost the red kite.") == (
        "sad_turn", {"name": "Mia", "color": "red", "object": "kite"})
    assert gold_rewards.parse_sentence("One day, Mia found an orange kite.") == (
        "find", {"when": "One day", "name": "Mia", "verb": "found", "color": "orange", "object": "kite"})
    assert gold_rewards.parse_sentence("Kite the red found happy.") is None
    assert gold_rewards.parse_sentence("One day, Mia found an red kite.") is None
    assert gold_rewards.story_problems([p for p in map(gold_rewards.parse_sentence, tw.split_sentences(GOOD))]) == []


def test_story_reward_length_penalty():
    short = "There was a girl named Mia. Mia got a red kite. Mia felt happy. The end."
    parts = gold_rewards.story_reward_parts(SPEC, short)
    assert parts["length"] == len(tw.words_of(short)) / gold_rewards.STORY_WORDS[0]  # exact: the same division
    long_story = GOOD.replace(" The end.", " It was a sunny day. She took the red kite to the park." * 4 + " The end.")
    assert gold_rewards.story_reward(SPEC, long_story) < 0.2
