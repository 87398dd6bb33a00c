"""Tests for llm_from_scratch.tinyworld: the Recorder, the world, its pretraining text and their
log-probabilities. Expected numbers are worked out by hand or recomputed independently."""

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
    assert rng.logp == math.log(1 / 4)  # exact: 0.0 + math.log(1.0 / 4), the same float64 operations as here


def test_weighted_adds_log_weight_share():
    for seed in range(100):  # find a seed where b is picked, and one where a is
        rng = tw.Recorder(seed)
        picked = rng.weighted(["a", "b"], [1, 3])
        expected = math.log(3 / 4) if picked == "b" else math.log(1 / 4)
        assert rng.logp == expected  # exact: 0.0 + math.log(w / 4.0), the same float64 quotient and log as here
    rng = tw.Recorder(1)
    share_b = sum(rng.weighted(["a", "b"], [1, 3]) == "b" for _ in range(20_000)) / 20_000
    assert share_b == pytest.approx(0.75, abs=0.01)  # sampling, not rounding: sd √(0.75·0.25/20,000) ≈ 0.003


def test_randint_coin_and_sums():
    rng = tw.Recorder(3)
    assert 0 <= rng.randint(0, 9) <= 9
    # exact, here and below: the Recorder adds the same float64 logs to 0.0, in the same order as these sums
    assert rng.logp == math.log(1 / 10)
    rng = tw.Recorder(4)
    heads = rng.coin(0.3)
    assert rng.logp == math.log(0.3 if heads else 0.7)  # 1.0 - 0.3 is the double 0.7
    rng = tw.Recorder(5)
    rng.choice("abcd"), rng.randint(0, 9), rng.choice([1, 2])
    assert rng.logp == math.log(1 / 4) + math.log(1 / 10) + math.log(1 / 2)


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
    # always two steps: tens, then ones
    assert tw.worked_steps(6, "plus", 3) == "6 plus 3: 6 plus 0 is 6. 6 plus 3 is 9."
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
            # float64, ≤ 11 negative logs (no cancellation) added in another order: ≲ 11·1.1e-16 ≈ 1.2e-15 relative
            assert s.logp == pytest.approx(expected, rel=1e-12)
        elif s.kind == "facts":
            n_facts += 1
            k = len(tw.split_sentences(s.text))
            lo, hi = tw.FACTS_PER_DOC
            expected = math.log(w["facts"] / total_w) + math.log(1 / (hi - lo + 1)) + k * math.log(1 / len(tw.FACTS))
            assert s.logp == pytest.approx(expected, rel=1e-12)  # as above: float64 sums in another order
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
    # above: float64, ~1,100 exps (each ≲ 1e-15 relative off) summed: ≲ 1e-13 over 1; below: the mass of the stories
    # that 30,000 draws missed (sampling, not rounding)
    assert 0.999 < sum(prob.values()) <= 1 + 1e-9
    chi2 = df = 0
    for t, p in prob.items():
        if n * p >= 20:
            chi2, df = chi2 + (counts[t] - n * p) ** 2 / (n * p), df + 1
    assert df > 200 and chi2 < 1.3 * df


def test_entropy_floor_by_hand():
    samples = [tw.Sample("a b c", -3.0, "facts"), tw.Sample("d e", -2.0, "facts")]
    # exact: 3.0 + 2.0 and the integer counts are exact doubles, and one division rounds as it does here
    assert tw.entropy_floor(samples, lambda t: len(t.split())) == 5 / ((3 + 1) + (2 + 1))
    assert tw.nats_per_char(samples) == 5 / ((5 + 1) + (3 + 1))


def test_vocabulary_size():
    assert 300 <= len(tw.vocabulary()) <= 2000
    assert {"mia", "kite", "forest", "happy", "plus", "sort"} <= tw.vocabulary()
