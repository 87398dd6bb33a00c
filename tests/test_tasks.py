"""Tests for llm_from_scratch.tasks: the instruction examples and the RL prompts, their answers recomputed
independently."""

import json
import math
import re
from collections import Counter

import pytest

from llm_from_scratch import tasks
from llm_from_scratch import tinyworld as tw

# ----------------------------------------------------------------------------
# The worked-sum parser of test_tinyworld.py (each test file runs alone in tests/test_standalone.py)

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
    verifiable = ("arithmetic", "word_problem", "sort", "reverse", "count")
    for ex in tasks.generate_instructions(3000, seed=5, tasks=verifiable):
        seen[ex.task] += 1
        if ex.task == "arithmetic":
            (a, op, b, c), = _parse_sums(ex.response)  # one sum, worked in steps
            assert int(ex.meta["answer"]) == c == _solve_arithmetic(ex.prompt) >= 0
            assert ex.prompt in (f"Add {a} and {b}.", f"What is {a} plus {b}?") if op == "plus" else \
                ex.prompt in (f"Subtract {b} from {a}.", f"What is {a} minus {b}?")
        elif ex.task == "word_problem":  # one worked sum per event, by the demonstrator: right or a wrong strategy
            said = re.findall(r"[A-Z][^.?]*\. ", ex.response)  # each event's sentence, restated before its sum
            events = [s.strip() for s in re.findall(r"[^.?]+[.?]", ex.prompt)[1:-1] if not re.match(r" ?\w+ has ", s)]
            assert [s.strip() for s in said] == events
            sums = _parse_sums(re.sub(r"[A-Z][^.?]*\. ", "", ex.response))
            assert all(sums[i][3] == sums[i + 1][0] for i in range(len(sums) - 1))  # each continues the last
            assert sums[0][0] == int(re.match(r"\w+ has (\d+)", ex.prompt).group(1))
            assert int(ex.meta["answer"]) == _solve_word_problem(ex.prompt)
            kind = tasks.classify_word_problem(ex.prompt, ex.response)
            assert kind in ("right", "strategy") and (kind == "right") == (sums[-1][3] == int(ex.meta["answer"]))
        else:
            assert ex.response == ex.meta["answer"]
            words = re.fullmatch(r"\w+ these words: (.*)\.", ex.prompt).group(1).split(", ")
            assert 3 <= len(words) <= 6 and len(set(words)) == len(words)
            expected = {"sort": ", ".join(sorted(words)), "reverse": ", ".join(words[::-1]),
                        "count": str(len(words))}[ex.task]
            assert ex.response == expected
    assert min(seen.values()) > 400


# A word problem with an event the demonstrator misreads ("gives ... to"), another child's count, and a loss
PROBLEM = ("Mia has 10 apples. Leo gives her 3 more apples. Tom has 5 apples. Then Mia gives 4 apples to Leo. "
           "Mia loses 2 apples. How many apples does Mia have now?")
EVENTS = [("given", 3), ("other", 5), ("gives", 4), ("loses", 2)]  # right: 10 + 3 - 4 - 2 = 7


def test_word_problem_events_reads_every_template_back():
    assert tasks.word_problem_events(PROBLEM) == (10, EVENTS)
    assert tasks.solution_plan(EVENTS) == [("plus", 3), ("minus", 4), ("minus", 2)]  # the other child's left out
    assert tasks.solution_plan(EVENTS, frozenset({2})) == [("plus", 3), ("plus", 4), ("minus", 2)]
    rng = tw.Recorder(8)
    for _ in range(500):  # the sums the right plan works are the problem's answer
        ex = tasks.make_word_problem(rng, distractor_p=0.5)
        start, events = tasks.word_problem_events(ex.prompt)
        plan = tasks.solution_plan(events)
        assert start + sum(k if op == "plus" else -k for op, k in plan) == int(ex.meta["answer"])
        assert {kind for kind, _ in events} <= {"finds", "given", "buys", "gives", "loses", "other"}
        # the demonstration restates each of the child's own events before working it, in order
        said = [m.group(0).split(". ")[0] + "." for m in tasks.WORKED_STEP.finditer(ex.response)]
        assert said == tasks.event_sentences(ex.prompt) and len(said) == len(plan)
        assert tasks.classify_word_problem(ex.prompt, ex.response) in ("right", "strategy")


def test_word_problem_demonstrator_misreads_at_its_stated_rate():
    """"Then Mia gives 4 apples to Leo." worked as a gain with probability WP_MISREAD_P: within 4 binomial standard
    errors of n = 4,000 draws (a rate off by 0.03 fails); the response works that plan, and the classifier calls it
    a strategy error exactly when the event was misread."""
    n, misread = 4000, 0
    for seed in range(n):
        response, flaws = tasks.demonstration_word_problem(tw.Recorder(seed), 10, EVENTS)
        misread += flaws
        assert response == tasks.work_plan(10, tasks.solution_plan(EVENTS, frozenset({2} if flaws else ())))
        assert tasks.classify_word_problem(PROBLEM, response) == ("strategy" if flaws else "right")
    p = tasks.WP_MISREAD_P
    assert abs(misread / n - p) < 4 * math.sqrt(p * (1 - p) / n), misread / n


def test_every_gives_event_is_misread_on_its_own():
    # two "gives ... to" events: each misread independently, so both, one or none (p², 2p(1-p), (1-p)²)
    events, n, seen = [("gives", 2), ("finds", 3), ("gives", 1)], 3000, Counter()
    for seed in range(n):
        seen[tasks.demonstration_word_problem(tw.Recorder(seed), 10, events)[1]] += 1
    p = tasks.WP_MISREAD_P
    for k, share in ((2, p * p), (1, 2 * p * (1 - p)), (0, (1 - p) ** 2)):
        assert abs(seen[k] / n - share) < 4 * math.sqrt(share * (1 - share) / n), (k, seen[k] / n, share)


def test_a_misreading_that_passes_99_is_not_made():
    events = [("gives", 20), ("finds", 20), ("gives", 20), ("finds", 20)]  # misread: 20 + 20 + 20 + 20 + 20 = 100
    said = ["Then Mia gives 20 apples to Leo.", "She finds 20 more apples.", "Then she gives 20 apples to Leo.",
            "She finds 20 more apples."]
    for seed in range(300):
        response, flaws = tasks.demonstration_word_problem(tw.Recorder(seed), 20, events, said)
        assert int(response.split()[-1].rstrip(".")) <= 99
        if flaws == 0:  # the fallback is the right plan, each event still restated
            assert response == tasks.work_plan(20, tasks.solution_plan(events), said)
            assert response.startswith(said[0]) and all(s in response for s in said)


def _work(start, *plan):
    return tasks.work_plan(start, list(plan))


SAID = ["Leo gives her 3 more apples.", "Then Mia gives 4 apples to Leo.", "Mia loses 2 apples."]


def _said(start, *plan):  # as the demonstrator writes: each sum after the sentence it works
    return tasks.work_plan(start, list(plan), SAID)


@pytest.mark.parametrize("response, kind", [
    (_work(10, ("plus", 3), ("minus", 4), ("minus", 2)), "right"),
    (_said(10, ("plus", 3), ("minus", 4), ("minus", 2)), "right"),
    (_said(10, ("plus", 3), ("plus", 4), ("minus", 2)), "strategy"),
    (_said(10, ("plus", 3), ("minus", 1), ("minus", 2)), "events"),  # the sentence copied, its number not
    (_said(10, ("plus", 3), ("minus", 4), ("minus", 2)) + " Tom has 5 apples.", "malformed"),  # ends on a sentence
    ("10 plus 3: 10 plus 0 is 10. 10 plus 3 is 13. 13 minus 4: 13 minus 0 is 13. 13 minus 4 is 9. "
     "9 minus 2: 9 minus 0 is 9. 9 minus 2 is 6.", "slip"),
    ("10 plus 3: 10 plus 0 is 10. 10 plus 3 is 14. 14 minus 4: 14 minus 0 is 14. 14 minus 4 is 10. "
     "10 minus 2: 10 minus 0 is 10. 10 minus 2 is 8.", "slip"),  # a slip carried on: the sums still the right ones
    (_work(10, ("plus", 3), ("plus", 4), ("minus", 2)), "strategy"),  # the demonstrator's habit: "gives" as a gain
    (_work(10, ("minus", 3), ("minus", 4), ("minus", 2)), "strategy"),  # "Leo gives her 3 more" as a loss
    (_work(10, ("plus", 3), ("minus", 4), ("plus", 2)), "strategy"),  # "loses" as a gain
    (_work(10, ("plus", 3), ("plus", 5), ("minus", 4), ("minus", 2)), "events"),  # the other child's apples counted
    (_work(10, ("plus", 3), ("minus", 4)), "events"),  # stopped before the last event
    (_work(10, ("plus", 3), ("minus", 1), ("minus", 2)), "events"),  # a number misread
    (_work(5, ("plus", 3), ("minus", 4), ("minus", 2)), "events"),  # the right sums from another start (Tom's 5)
    ("7", "right"),  # as the gold reward reads it: the last number
    ("10 plus 3 is 13. 13 minus 4 is 9. 9 minus 2 is 7.", "right"),
    ("12", "malformed"),
    ("10 plus 3: 10 plus 0 is 10. 10 plus", "malformed"),
    ("", "malformed"),
])
def test_classify_word_problem(response, kind):
    assert tasks.classify_word_problem(PROBLEM, response) == kind


def test_word_problem_difficulty_knobs():
    rng = tw.Recorder(2)
    for _ in range(300):
        ex = tasks.make_word_problem(rng, steps=(4, 4), max_quantity=9, distractor_p=1.0)
        sentences = re.findall(r"[^.?]+[.?]", ex.prompt)
        assert len(sentences) == 1 + 4 + 1 + 1  # start, 4 steps, distractor, question
        assert int(ex.meta["answer"]) == _solve_word_problem(ex.prompt, max_quantity=9)
    with_distractor = sum(len(re.findall(r"[^.?]+[.?]", tasks.make_word_problem(rng).prompt)) for _ in range(1000))
    # default: 2-3 steps, sometimes one distractor: 1,000 x (2 + 2.5 + 0.3) = 4,800 sentences, s.d. about 22
    assert 4_700 < with_distractor < 4_900


def test_qa_and_story_examples():
    for ex in tasks.generate_instructions(400, seed=9, tasks=("qa", "story")):
        if ex.task == "qa":
            story, question = re.fullmatch(r"Story: (.*)\nQuestion: (.*)", ex.prompt).groups()
            assert ex.response in story
            m = re.fullmatch(r"What color was the (\w+)\?", question)
            if m:
                assert f"{ex.response} {m.group(1)}" in story
        else:
            assert f"{ex.meta['color']} {ex.meta['object']}" in ex.prompt and ex.meta["name"] in ex.prompt
        assert tasks.Example.from_dict(json.loads(json.dumps(ex.to_dict()))) == ex


# ----------------------------------------------------------------------------
# RL prompts, files


def test_rl_prompts():
    for row in tasks.rl_prompts("verifiable", 200, seed=1):
        solve = _solve_arithmetic if row["task"] == "arithmetic" else _solve_word_problem
        assert str(solve(row["prompt"])) == row["answer"]
    for row in tasks.rl_prompts("stories", 50, seed=1):
        assert row["task"] == "story" and row["spec"]["name"] in row["prompt"]
    with pytest.raises(ValueError, match="verifiable"):
        tasks.rl_prompts("chess", 5)


def test_word_problem_pronouns_have_one_reading():
    """'Tom has 1 car. Leo has 15 cars. He finds 15 more cars.': whose cars? A pronoun may stand for the child
    only right after a sentence that names nobody else."""
    names = set(tw.NAME_LIST)
    rng, pronouns_seen, names_again = tw.Recorder(3), 0, 0
    for _ in range(2000):
        ex = tasks.make_word_problem(rng)
        sentences = [s.strip() for s in re.findall(r"[^.?]+[.?]", ex.prompt)]
        child = re.fullmatch(r"(\w+) has \d+ \w+\.", sentences[0]).group(1)
        for before, s in zip(sentences, sentences[1:]):
            if re.search(r"\b([Ss]he|[Hh]e|her|him)\b", s):
                pronouns_seen += 1
                assert {w for w in re.findall(r"\w+", before) if w in names} <= {child}, (before, s)
            elif not s.startswith("How") and not re.match(r"\w+ has \d+", s) and child in s:
                names_again += 1
    assert pronouns_seen > 2000 and names_again > 500  # both forms occur
