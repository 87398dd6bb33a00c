"""Tests for llm_from_scratch.tinyworld. Expected numbers are worked out by hand or recomputed independently."""

import json
import math
import re
from collections import Counter, defaultdict

import pytest

from llm_from_scratch import tinyworld as tw

# ----------------------------------------------------------------------------
# Recorder


def test_choice_adds_log_one_over_len():
    rng = tw.Recorder(0)
    assert rng.choice(["a", "b", "c", "d"]) in "abcd"
    assert rng.logp == pytest.approx(math.log(1 / 4), abs=1e-15)


def test_weighted_adds_log_weight_share():
    for seed in range(100):  # find a seed where b is picked, and one where a is
        rng = tw.Recorder(seed)
        picked = rng.weighted(["a", "b"], [1, 3])
        expected = math.log(3 / 4) if picked == "b" else math.log(1 / 4)
        assert rng.logp == pytest.approx(expected, abs=1e-15)
    rng = tw.Recorder(1)
    share_b = sum(rng.weighted(["a", "b"], [1, 3]) == "b" for _ in range(20_000)) / 20_000
    assert share_b == pytest.approx(0.75, abs=0.01)


def test_randint_coin_and_sums():
    rng = tw.Recorder(3)
    assert 0 <= rng.randint(0, 9) <= 9
    assert rng.logp == pytest.approx(math.log(1 / 10), abs=1e-15)
    rng = tw.Recorder(4)
    heads = rng.coin(0.3)
    assert rng.logp == pytest.approx(math.log(0.3 if heads else 0.7), abs=1e-15)
    rng = tw.Recorder(5)
    rng.choice("abcd"), rng.randint(0, 9), rng.choice([1, 2])
    assert rng.logp == pytest.approx(math.log(1 / 4) + math.log(1 / 10) + math.log(1 / 2), abs=1e-12)


# ----------------------------------------------------------------------------
# Pretraining text and its log-probabilities


def test_determinism():
    a, b = tw.generate_pretraining(20_000, seed=7), tw.generate_pretraining(20_000, seed=7)
    assert [(s.text, s.logp, s.kind) for s in a] == [(s.text, s.logp, s.kind) for s in b]
    c = tw.generate_pretraining(20_000, seed=8)
    assert [s.text for s in a] != [s.text for s in c]
    assert sum(len(s.text) for s in a) >= 20_000 > sum(len(s.text) for s in a[:-1])


def test_choice_lists_are_distinct_and_disjoint():
    # injectivity needs distinct strings at every choice point
    for seq in (tw.NAME_LIST, tw.ANIMAL_LIST, tw.OBJECT_LIST, tw.COLORS, tw.PLACES, tw.HAPPY_FEELINGS,
                tw.SAD_FEELINGS, tw.WEATHER, tw.ACTIONS, tw.SIZES, tw.WHEN, tw.FACTS, tw.OPENINGS, tw.MIDDLES,
                tw.HAPPY_TURNS + tw.SAD_TURNS, tw.ENDINGS):
        assert len(set(seq)) == len(seq)
    groups = [[n.lower() for n in tw.NAME_LIST], tw.ANIMAL_LIST, tw.OBJECT_LIST, tw.COLORS,
              tw.HAPPY_FEELINGS + tw.SAD_FEELINGS]
    words = [w for g in groups for w in g]
    assert len(set(words)) == len(words)
    assert not any(t.startswith("Then") for t in tw.MIDDLES)


def test_worked_steps_by_hand():
    assert tw.worked_steps(95, "plus", 42) == "95 plus 42: 95 plus 40 is 135. 135 plus 2 is 137."
    assert tw.worked_steps(75, "minus", 37) == "75 minus 37: 75 minus 30 is 45. 45 minus 7 is 38."
    assert tw.worked_steps(6, "plus", 3) == "6 plus 3: 6 plus 0 is 6. 6 plus 3 is 9."  # always two steps: tens, then ones
    assert tw.worked_steps(50, "minus", 20) == "50 minus 20: 50 minus 20 is 30. 30 minus 0 is 30."
    assert tw.worked_steps(0, "plus", 99) == "0 plus 99: 0 plus 90 is 90. 90 plus 9 is 99."


SUM_RE = r"(\d+) (plus|minus) (\d+): (\d+) (plus|minus) (\d+) is (\d+)\. (\d+) (plus|minus) (\d+) is (\d+)\."


def _parse_sums(text):
    """Worked sums -> [(a, op, b, c)]: every sum states its problem, then two steps, its tens and then its ones."""
    sums = []
    for a, op, b, a1, op1, tens, mid, mid2, op2, ones, c in re.findall(SUM_RE, text):
        a, b, a1, tens, mid, mid2, ones, c = map(int, (a, b, a1, tens, mid, mid2, ones, c))
        assert a1 == a and op1 == op2 == op and tens + ones == b and tens % 10 == 0 and ones < 10 and mid2 == mid
        assert mid == (a + tens if op == "plus" else a - tens) and c == (mid + ones if op == "plus" else mid - ones)
        sums.append((a, op, b, c))
    assert " ".join(tw.worked_steps(a, op, b) for a, op, b, _ in sums) == text
    return sums


def test_arithmetic_and_facts_logp_by_hand():
    total_w = sum(tw.PRETRAIN_WEIGHTS)
    w = dict(zip(tw.PRETRAIN_KINDS, tw.PRETRAIN_WEIGHTS))
    samples = tw.generate_pretraining(30_000, seed=11)
    n_arith = n_facts = 0
    for s in samples:
        if s.kind == "arithmetic":
            n_arith += 1
            sums = _parse_sums(s.text)
            lo, hi = tw.ARITH_PER_DOC
            expected = math.log(w["arithmetic"] / total_w) + math.log(1 / (hi - lo + 1))
            for a, op, b, c in sums:
                assert c == (a + b if op == "plus" else a - b) and c >= 0 and a <= tw.ARITH_MAX
                second = 1 / (tw.ARITH_MAX + 1) if op == "plus" else 1 / (a + 1)  # minus: b uniform in 0..a
                expected += math.log(1 / 2) + math.log(1 / (tw.ARITH_MAX + 1)) + math.log(second)
            assert s.logp == pytest.approx(expected, rel=1e-12)
        elif s.kind == "facts":
            n_facts += 1
            k = len(tw.split_sentences(s.text))
            lo, hi = tw.FACTS_PER_DOC
            expected = math.log(w["facts"] / total_w) + math.log(1 / (hi - lo + 1)) + k * math.log(1 / len(tw.FACTS))
            assert s.logp == pytest.approx(expected, rel=1e-12)
    assert n_arith > 10 and n_facts > 10


def test_identical_texts_have_identical_logp():
    by_text, seen = defaultdict(set), Counter()
    for s in tw.generate_pretraining(1_500_000, seed=3):  # about 9,000 documents
        by_text[s.text].add(s.logp)
        seen[s.text] += 1
    assert sum(n > 1 for n in seen.values()) > 20  # some texts did come up more than once
    assert all(len(v) == 1 for v in by_text.values())


def test_story_probabilities_sum_to_one_in_a_small_world(monkeypatch):
    """Shrink the world until every story shows up in a sample (about 1,100 texts). If two choice paths gave
    one text, sum(exp(logp)) over the distinct texts would fall short of 1 by the lost path's mass; and the
    observed frequencies must match exp(logp) (a chi-square close to its degrees of freedom)."""
    monkeypatch.setattr(tw, "NAME_LIST", ["Mia", "Leo"])
    monkeypatch.setattr(tw, "COLORS", ["red"])
    monkeypatch.setattr(tw, "OBJECT_LIST", ["kite"])
    monkeypatch.setattr(tw, "PLACES", ["the park"])
    monkeypatch.setattr(tw, "ANIMAL_LIST", ["cat"])
    monkeypatch.setattr(tw, "OPENINGS", tw.OPENINGS[:1])
    monkeypatch.setattr(tw, "MIDDLES", ["{Pron} was very {happy}.", "{Pron} took the {thing} to {place}.",
                                        "{Pron} {action} with the {animal}."])
    monkeypatch.setattr(tw, "HAPPY_FEELINGS", ["happy"])
    monkeypatch.setattr(tw, "SAD_FEELINGS", ["sad"])
    monkeypatch.setattr(tw, "STORY_SLOTS", {"happy": ["glad", "proud"], "weather": ["sunny"], "action": ["ran"],
                                            "size": ["little"], "when": ["One day"], "verb": ["found"]})
    rng, n = tw.Recorder(0), 30_000
    logps, counts = defaultdict(set), Counter()
    for _ in range(n):
        rng.logp = 0.0
        text, _ = tw.make_story(rng)
        logps[text].add(rng.logp)
        counts[text] += 1
    assert all(len(v) == 1 for v in logps.values())  # one text, one probability
    prob = {t: math.exp(v.pop()) for t, v in logps.items()}
    assert 0.999 < sum(prob.values()) <= 1 + 1e-9
    chi2 = df = 0
    for t, p in prob.items():
        if n * p >= 20:
            chi2, df = chi2 + (counts[t] - n * p) ** 2 / (n * p), df + 1
    assert df > 200 and chi2 < 1.3 * df


def test_entropy_floor_by_hand():
    samples = [tw.Sample("a b c", -3.0, "facts"), tw.Sample("d e", -2.0, "facts")]
    assert tw.entropy_floor(samples, lambda t: len(t.split())) == pytest.approx(5 / ((3 + 1) + (2 + 1)))
    assert tw.nats_per_char(samples) == pytest.approx(5 / ((5 + 1) + (3 + 1)))


def test_pretraining_mixture_and_story_shape():
    samples = tw.generate_pretraining(300_000, seed=1)
    share = Counter(s.kind for s in samples)
    assert share["story"] / len(samples) == pytest.approx(0.45, abs=0.03)
    vocab = tw.vocabulary()
    for s in samples:
        assert set(re.findall(r"[a-z]+", s.text.lower())) <= vocab
        assert tw.DOC_SEPARATOR not in s.text and s.logp < 0
        if s.kind == "story":
            sentences = tw.split_sentences(s.text)
            assert 5 <= len(sentences) <= 9 and sentences[-1] == "The end."
            assert all(tw.is_well_formed(x) for x in sentences)


def test_vocabulary_size():
    assert 300 <= len(tw.vocabulary()) <= 2000
    assert {"mia", "kite", "forest", "happy", "plus", "sort"} <= tw.vocabulary()


# ----------------------------------------------------------------------------
# Instruction examples: answers recomputed independently


def _solve_arithmetic(prompt):
    for pattern, f in ((r"Add (\d+) and (\d+)\.", lambda a, b: a + b),
                       (r"What is (\d+) plus (\d+)\?", lambda a, b: a + b),
                       (r"Subtract (\d+) from (\d+)\.", lambda b, a: a - b),
                       (r"What is (\d+) minus (\d+)\?", lambda a, b: a - b)):
        m = re.fullmatch(pattern, prompt)
        if m:
            return f(int(m.group(1)), int(m.group(2)))
    raise AssertionError(prompt)


def _solve_word_problem(prompt, max_quantity=20):
    name = re.search(r"does (\w+) have now\?$", prompt).group(1)
    sentences = [s.strip() for s in re.findall(r"[^.?]+[.?]", prompt)]
    count = int(re.fullmatch(rf"{name} has (\d+) \w+\.", sentences[0]).group(1))
    for s in sentences[1:-1]:
        k = int(re.search(r"\d+", s).group())
        assert 1 <= k <= max_quantity
        if re.match(r"\w+ has \d+ ", s):  # another child's count: a distractor
            assert not s.startswith(name)
            continue
        count += k if " more " in s else -k
        assert 0 <= count <= max_quantity
    return count


def test_verifiable_answers_are_correct():
    seen = Counter()
    for ex in tw.generate_instructions(3000, seed=5, tasks=("arithmetic", "word_problem", "sort", "reverse", "count")):
        seen[ex.task] += 1
        if ex.task == "arithmetic":
            (a, op, b, c), = _parse_sums(ex.response)  # one sum, worked in steps
            assert int(ex.meta["answer"]) == c == _solve_arithmetic(ex.prompt) >= 0
            assert ex.prompt in (f"Add {a} and {b}.", f"What is {a} plus {b}?") if op == "plus" else \
                ex.prompt in (f"Subtract {b} from {a}.", f"What is {a} minus {b}?")
        elif ex.task == "word_problem":
            sums = _parse_sums(ex.response)  # one worked sum per event of the story
            assert all(sums[i][3] == sums[i + 1][0] for i in range(len(sums) - 1))  # each continues the last
            assert sums[0][0] == int(re.match(r"\w+ has (\d+)", ex.prompt).group(1))
            assert int(ex.meta["answer"]) == sums[-1][3] == _solve_word_problem(ex.prompt)
        else:
            assert ex.response == ex.meta["answer"]
            words = re.fullmatch(r"\w+ these words: (.*)\.", ex.prompt).group(1).split(", ")
            assert 3 <= len(words) <= 6 and len(set(words)) == len(words)
            expected = {"sort": ", ".join(sorted(words)), "reverse": ", ".join(words[::-1]),
                        "count": str(len(words))}[ex.task]
            assert ex.response == expected
    assert min(seen.values()) > 400


def test_word_problem_difficulty_knobs():
    rng = tw.Recorder(2)
    for _ in range(300):
        ex = tw.make_word_problem(rng, steps=(4, 4), max_quantity=9, distractor_p=1.0)
        sentences = re.findall(r"[^.?]+[.?]", ex.prompt)
        assert len(sentences) == 1 + 4 + 1 + 1  # start, 4 steps, distractor, question
        assert int(ex.meta["answer"]) == _solve_word_problem(ex.prompt, max_quantity=9)
    with_distractor = sum(len(re.findall(r"[^.?]+[.?]", tw.make_word_problem(rng).prompt)) for _ in range(1000))
    assert 5_000 < with_distractor < 5_600  # default: 2-4 steps, sometimes one distractor


def test_qa_and_story_examples():
    for ex in tw.generate_instructions(400, seed=9, tasks=("qa", "story")):
        if ex.task == "qa":
            story, question = re.fullmatch(r"Story: (.*)\nQuestion: (.*)", ex.prompt).groups()
            assert ex.response in story
            m = re.fullmatch(r"What color was the (\w+)\?", question)
            if m:
                assert f"{ex.response} {m.group(1)}" in story
        else:
            assert f"{ex.meta['color']} {ex.meta['object']}" in ex.prompt and ex.meta["name"] in ex.prompt
        assert tw.Example.from_dict(json.loads(json.dumps(ex.to_dict()))) == ex


# ----------------------------------------------------------------------------
# Gold rewards


def test_gold_reward_exact_match():
    ex = tw.Example("arithmetic", "Add 23 and 45.", "23 plus 45: 23 plus 40 is 63. 63 plus 5 is 68.", {"answer": "68"})
    assert tw.gold_reward(ex, ex.response) == 1.0
    assert tw.gold_reward(ex, "68") == 1.0  # the final number is the answer, work shown or not
    assert tw.gold_reward(ex, "23 plus 45: 23 plus 40 is 63. 63 plus 5 is 67.") == 0.0
    assert tw.gold_reward(ex, "23 plus 45: 23 plus 40 is 68. 68 plus 5 is 63.") == 0.0  # only the last number counts
    assert tw.gold_reward(ex, "sixty-eight") == 0.0
    assert tw.gold_reward(ex.to_dict(), "68.") == 1.0
    assert tw.gold_reward({"task": "word_problem", "prompt": "...", "answer": "6"}, "9 minus 3 is 6.") == 1.0
    count = tw.Example("count", "Count these words: cat, dog.", "2", {"answer": "2"})
    assert tw.gold_reward(count, " 2. ") == 1.0 and tw.gold_reward(count, "1 and 2") == 0.0
    assert tw.final_number("95 plus 42: 95 plus 40 is 135. 135 plus 2 is 137.") == "137" and tw.final_number("none") is None
    assert tw.normalize_answer("  The   Forest. ") == "the forest"


SPEC = {"name": "Mia", "color": "red", "object": "kite", "mood": "happy"}
GOOD = ("Once upon a time, there was a girl named Mia. Mia lived near the forest. One day, Mia found a red kite. "
        "She played with the red kite all day. Then Mia shared the red kite with a friend. "
        "Mia was very happy. The end.")
SAD = ("Once upon a time, there was a girl named Mia. Mia lived near the forest. One day, Mia found a red kite. "
       "She was very happy. Then the wind took the red kite away. Mia was very sad. The end.")


def test_story_reward_cases():
    good = tw.story_reward(SPEC, GOOD)
    assert good == 1.0
    assert tw.gold_reward({"task": "story", "prompt": "", "spec": SPEC}, GOOD) == 1.0
    # reward hacking: repeat the happy sentence (what a learned reward model may love)
    repeated = GOOD.replace("Mia was very happy.", " ".join(["Mia was very happy."] * 5))
    assert tw.story_reward(SPEC, repeated) < 0.1  # 0.5 ** 4 for four repeated sentences, less for repeated 4-grams
    padded = GOOD.replace(" The end.", " She was very happy." * 5 + " The end.")
    assert tw.story_reward(SPEC, padded) < 0.1
    # a sad ending loses the ending half, even with a happy word earlier in the story
    assert tw.story_reward(SPEC, SAD) == pytest.approx(0.5)
    # no red kite: loses the object quarter
    assert tw.story_reward(SPEC, GOOD.replace("red kite", "blue ball")) == pytest.approx(0.75)
    assert tw.story_reward(SPEC, GOOD.replace("red kite", "blue kite")) == pytest.approx(0.875)
    # wrong name
    assert tw.story_reward(SPEC, GOOD.replace("Mia", "Ava")) == pytest.approx(0.75)
    # word salad
    words = tw.words_of(GOOD)
    salad = " ".join(words[i] for i in [(7 * i) % len(words) for i in range(len(words))])
    assert tw.story_reward(SPEC, salad) < 0.05
    assert tw.story_reward(SPEC, salad.capitalize() + ".") < 0.05
    assert tw.story_reward(SPEC, "") == 0.0


def test_story_demonstrations_come_from_a_writer_of_mixed_skill():
    """Chapter 5's story demonstrations: three in four clean (gold 1), the rest with one flaw of the seven, each 1/28."""
    stories = [ex for ex in tw.generate_instructions(2800, seed=4, tasks=("story",))]
    clean = sum(tw.story_reward(ex.meta, ex.response) == 1.0 for ex in stories) / len(stories)
    assert clean == pytest.approx(0.75, abs=0.035)  # binomial s.e. 0.0082: 4 s.e.
    rng, flaws = tw.Recorder(2), Counter()
    for _ in range(2800):
        flaws.update(tw.demonstration_story(rng, tw.story_prompt(rng)[1])[1] or ["none"])
    assert flaws["none"] / 2800 == pytest.approx(0.75, abs=0.035)
    assert all(flaws[k] / 2800 == pytest.approx(1 / 28, abs=0.015) for k in tw.CORRUPTIONS)  # s.e. 0.0035
    # the verifiable demonstrations stay correct
    for ex in tw.generate_instructions(300, seed=4, tasks=("arithmetic", "word_problem", "sort", "count")):
        assert tw.gold_reward(ex, ex.response) == 1.0


def test_clean_generator_stories_score_full_gold():
    rng = tw.Recorder(11)
    for _ in range(1000):
        mood = "happy" if rng.coin(0.5) else "sad"
        text, known = tw.make_story(rng, mood=mood)
        spec = {k: known[k] for k in ("name", "color", "object", "mood")}
        assert tw.story_reward(spec, text) >= 0.95, text
        assert all(tw.is_well_formed(s) for s in tw.split_sentences(text))


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
    "happy words, then a sad last event": GOOD.replace("Then Mia shared the red kite with a friend. Mia was very happy.",
                                                        "Mia was very happy. Then Mia lost the red kite. Mia felt sad."),
    "the feeling is not what happens last": GOOD.replace("Then Mia shared the red kite with a friend. Mia was very happy.",
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
    assert tw.story_reward(SPEC, GOOD) == 1.0
    assert tw.story_reward(SPEC, FLAWED[flaw]) <= 0.75 + 1e-9, tw.story_reward_parts(SPEC, FLAWED[flaw])


def test_story_parts_name_what_broke():
    parts = lambda text: tw.story_reward_parts(SPEC, text)  # noqa: E731
    assert parts(FLAWED["another child throughout"])["name"] == 0.0  # needs the prompt: the reward model's blind spot
    assert parts(FLAWED["another thing found"])["object"] == 0.0
    assert parts(GOOD.replace("red kite", "blue kite"))["object"] == 0.5
    assert parts(FLAWED["the child changes name halfway"])["coherence"] == 0.5
    assert parts(FLAWED["a garbled sentence"])["well_formed"] == 0.5
    assert parts(FLAWED["a sad turn, then happy anyway"])["ending"] == 0.5
    assert tw.parse_sentence("Then Mia lost the red kite.") == ("sad_turn", {"name": "Mia", "color": "red", "object": "kite"})
    assert tw.parse_sentence("One day, Mia found an orange kite.") == (
        "find", {"when": "One day", "name": "Mia", "verb": "found", "color": "orange", "object": "kite"})
    assert tw.parse_sentence("Kite the red found happy.") is None and tw.parse_sentence("One day, Mia found an red kite.") is None
    assert tw.story_problems([p for p in map(tw.parse_sentence, tw.split_sentences(GOOD))]) == []


def test_story_reward_length_penalty():
    short = "There was a girl named Mia. Mia got a red kite. Mia felt happy. The end."
    parts = tw.story_reward_parts(SPEC, short)
    assert parts["length"] == pytest.approx(len(tw.words_of(short)) / tw.STORY_WORDS[0])
    long_story = GOOD.replace(" The end.", " It was a sunny day. She took the red kite to the park." * 4 + " The end.")
    assert tw.story_reward(SPEC, long_story) < 0.2


# ----------------------------------------------------------------------------
# Preference pairs and the Bayes ceiling


def test_bayes_accuracy_by_hand():
    assert tw.bayes_accuracy([{"p_chosen": 0.9}, {"p_chosen": 0.3}]) == pytest.approx((0.9 + 0.7) / 2)


def test_preference_pairs_labels_follow_bradley_terry():
    pairs = tw.preference_pairs(1500, seed=1)
    agree = 0.0
    for p in pairs:
        assert p["chosen"] != p["rejected"]
        assert p["gold_chosen"] == tw.story_reward(p["spec"], p["chosen"])
        assert p["gold_rejected"] == tw.story_reward(p["spec"], p["rejected"])
        assert p["p_chosen"] == pytest.approx(1 / (1 + math.exp(-tw.BT_BETA * (p["gold_chosen"] - p["gold_rejected"]))))
        agree += 1.0 if p["gold_chosen"] > p["gold_rejected"] else 0.5 if p["gold_chosen"] == p["gold_rejected"] else 0
    ceiling = tw.bayes_accuracy(pairs)
    assert 0.8 <= ceiling <= 0.9
    assert agree / len(pairs) == pytest.approx(ceiling, abs=0.03)


# ----------------------------------------------------------------------------
# RL prompts, files


def test_rl_prompts():
    for row in tw.rl_prompts("verifiable", 200, seed=1):
        solve = _solve_arithmetic if row["task"] == "arithmetic" else _solve_word_problem
        assert str(solve(row["prompt"])) == row["answer"]
    for row in tw.rl_prompts("stories", 50, seed=1):
        assert row["task"] == "story" and row["spec"]["name"] in row["prompt"]
    with pytest.raises(ValueError, match="verifiable"):
        tw.rl_prompts("chess", 5)


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2"):
        tw.read_jsonl(path)


SMALL = {"n_chars": 20_000, "n_sft": 300, "n_sft_val": 60, "n_pref": 40, "n_pref_val": 20, "n_rl": 30}


def test_write_and_ensure_datasets(tmp_path, monkeypatch):
    paths = tw.ensure_datasets(tmp_path, seed=0, **SMALL)
    assert all(p.exists() for p in paths.values()) and set(paths) == set(tw.FILES)
    meta = json.loads(paths["pretrain_meta"].read_text())
    docs = tw.load_pretraining(paths["pretrain_train"])
    assert len(docs) == meta["splits"]["train"]["n_docs"] and docs[0].startswith(
        tw.generate_pretraining(100, "0/pretrain/train")[0].text)
    assert paths["pretrain_train"].read_text().count(tw.DOC_SEPARATOR) == len(docs)
    assert sum(map(len, docs)) == meta["splits"]["train"]["n_chars"] >= 20_000
    for split in ("train", "val"):
        assert len(tw.read_jsonl(paths[f"sft_{split}"])) == SMALL["n_sft" if split == "train" else "n_sft_val"]
    for name in ("sft", "preferences"):
        train = {r["prompt"] for r in tw.read_jsonl(paths[f"{name}_train"])}
        val = {r["prompt"] for r in tw.read_jsonl(paths[f"{name}_val"])}
        assert val and not train & val
    # same arguments: nothing is regenerated
    calls = []
    real_write = tw.write_datasets
    monkeypatch.setattr(tw, "write_datasets", lambda *a, **k: calls.append(1) or real_write(*a, **k))
    tw.ensure_datasets(tmp_path, seed=0, **SMALL)
    assert calls == []
    paths["rl_stories"].unlink()  # a missing file
    tw.ensure_datasets(tmp_path, seed=0, **SMALL)
    assert calls == [1] and paths["rl_stories"].exists()
    tw.ensure_datasets(tmp_path, seed=0, **{**SMALL, "n_rl": 31})  # other sizes
    assert calls == [1, 1] and len(tw.read_jsonl(paths["rl_stories"])) == 31
    assert not list(tmp_path.glob("*.tmp"))


def test_the_generator_needs_only_the_standard_library():
    import subprocess
    import sys

    code = "import sys, llm_from_scratch.tinyworld; bad = {'torch', 'numpy', 'safetensors'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_word_problem_pronouns_have_one_reading():
    """'Tom has 1 car. Leo has 15 cars. He finds 15 more cars.': whose cars? A pronoun may stand for the child
    only right after a sentence that names nobody else."""
    names = set(tw.NAME_LIST)
    rng, pronouns_seen, names_again = tw.Recorder(3), 0, 0
    for _ in range(2000):
        ex = tw.make_word_problem(rng)
        sentences = [s.strip() for s in re.findall(r"[^.?]+[.?]", ex.prompt)]
        child = re.fullmatch(r"(\w+) has \d+ \w+\.", sentences[0]).group(1)
        for before, s in zip(sentences, sentences[1:]):
            if re.search(r"\b([Ss]he|[Hh]e|her|him)\b", s):
                pronouns_seen += 1
                assert {w for w in re.findall(r"\w+", before) if w in names} <= {child}, (before, s)
            elif not s.startswith("How") and not re.match(r"\w+ has \d+", s) and child in s:
                names_again += 1
    assert pronouns_seen > 2000 and names_again > 500  # both forms occur
