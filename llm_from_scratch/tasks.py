"""The tiny world's tasks: instruction examples for SFT, the story demonstrator, and the prompt sets for RL.

Seven tasks (TASKS), each an Example: a prompt, the demonstrated response, and in `meta` what the gold reward needs
(gold_rewards.py grades them):

    arithmetic     "Add 95 and 42." -> the sum worked in steps (tinyworld.worked_steps), whose last number, 137,
                   is the answer
    word_problem   "Mia has 5 apples. She finds 13 more apples. She loses 2 apples. How many apples does Mia have
                   now?" -> one worked sum per event, each after the event's sentence restated ("She finds 13 more
                   apples. 5 plus 13: ..."). No count goes below 0 or above WP_MAX_QUANTITY, and a pronoun
                   stands for the child only right after a sentence about the child alone (one reading only)
    sort, reverse, count
                   3-6 distinct words of LIST_POOL -> sorted, reversed, or how many
    qa             a generated story and a question answered by one or two of its words
    story          "Write a happy story about Mia and a red kite." -> a demonstration by a writer of mixed skill

The held-out split is a function of the prompt alone: a prompt is "val" iff crc32(prompt) % 10 == 0, so no train
prompt is ever a val prompt (the SFT examples, the preference pairs and the RL prompts all use this split).

The word-problem demonstrator (demonstration_word_problem) has a habit a verifier can catch: it reads "Then she gives
3 apples to Leo." as a gain in 2 of 3 such events (WP_MISREAD_P), each sum's arithmetic right; classify_word_problem
sorts any wrong answer into a slip, a strategy (an event's verb read the wrong way), an events error (an event added,
dropped or misread) or a malformed one. The habit is what chapter 7's RL from verifiable rewards can select.

The story demonstrator (demonstration_story) is a writer of mixed skill, as human demonstrators are: with probability
21/28 = 3/4 it writes what was asked, otherwise one flaw (CORRUPTIONS), each of the seven kinds with probability 1/28.
That is the room above SFT that the reward model, best-of-N, RL and DPO must use. The same corruptions make the
candidate stories of the preference pairs (preferences.py).

The RL prompt sets (rl_prompts) come from the train side of the split: "verifiable" (arithmetic and word problems,
RL from verifiable rewards) and "stories" (RLHF). Every random decision goes through tinyworld's Recorder.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import asdict, dataclass, field

from llm_from_scratch.tinyworld import (
    ANIMAL_LIST,
    ARITH_PROMPTS,
    COLORS,
    FIND_VERBS,
    LIST_PROMPTS,
    NAME_LIST,
    NAMES,
    OBJECT_LIST,
    OBJECTS,
    PRONOUNS,
    QA_PROMPT,
    QA_QUESTIONS,
    STORY_PROMPTS,
    WP_ADD,
    WP_DISTRACTOR,
    WP_QUESTION,
    WP_START,
    WP_SUB,
    Recorder,
    article,
    draw_sum,
    make_story,
    pick_distinct,
    split_sentences,
    words_of,
    worked_steps,
)

# ----------------------------------------------------------------------------
# The tasks, their mix and their difficulty knobs

TASKS = ("arithmetic", "word_problem", "sort", "reverse", "count", "qa", "story")
LIST_LENGTH = (3, 6)
LIST_POOL = ANIMAL_LIST + OBJECT_LIST + COLORS
# The SFT training mix: the worked tasks (sums, word problems) take the most examples to learn. Word problems
# weigh most: turning a story's events into sums is the one skill pretraining does not teach at all.
SFT_WEIGHTS = {"arithmetic": 3, "word_problem": 4, "sort": 1, "reverse": 1, "count": 1, "qa": 1, "story": 1}
# The held-out set: word problems weigh 4 (about 600 of 1,500), so that one greedy evaluation's standard error of
# the accuracy is at most 2.1 points; 150 of each other task.
SFT_VAL_WEIGHTS = {"arithmetic": 1, "word_problem": 4, "sort": 1, "reverse": 1, "count": 1, "qa": 1, "story": 1}
# Word problems. Difficulty knobs, read at call time (so they can be tuned or monkeypatched).
WP_STEPS = (2, 3)          # number of additions/subtractions
WP_MAX_QUANTITY = 20       # no count (start, step, total) ever exceeds this
WP_DISTRACTOR_P = 0.3      # chance of one sentence about another child's count
# Each event sentence's kind, by template (tinyworld.WP_ADD / WP_SUB, in order): True -> the gains
WP_EVENT_KINDS = {True: ("finds", "given", "buys"), False: ("gives", "loses")}


# ----------------------------------------------------------------------------
# Instruction examples

@dataclass
class Example:
    task: str
    prompt: str
    response: str
    meta: dict = field(default_factory=dict)  # what the gold reward needs: {"answer": ...} or a story spec

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Example:
        return cls(d["task"], d["prompt"], d["response"], dict(d.get("meta", {})))


def _verifiable(task: str, prompt: str, answer) -> Example:
    return Example(task, prompt, str(answer), {"answer": str(answer)})


def make_arithmetic(rng: Recorder) -> Example:
    """'Add 95 and 42.' -> '95 plus 42: 95 plus 40 is 135. 135 plus 2 is 137.'; the answer (137) is the last number."""
    a, op, b = draw_sum(rng)
    prompt = rng.choice(ARITH_PROMPTS[op]).format(a=a, b=b)
    return Example("arithmetic", prompt, worked_steps(a, op, b), {"answer": str(a + b if op == "plus" else a - b)})


def _items(k: int, obj: str) -> str:
    return obj if k == 1 else OBJECTS[obj]


def make_word_problem(rng: Recorder, steps: tuple[int, int] | None = None, max_quantity: int | None = None,
                      distractor_p: float | None = None) -> Example:
    """'Mia has 5 apples. She finds 13 more apples. She loses 2 apples. How many ...?' -> the count, worked
    event by event by the demonstrator (demonstration_word_problem, which sometimes follows a wrong strategy), each
    sum after the sentence it works: 'She finds 13 more apples. 5 plus 13: 5 plus 10 is 15. 15 plus 3 is 18. She
    loses 2 apples. 18 minus 2: 18 minus 0 is 18. 18 minus 2 is 16.'
    No count goes below 0. A pronoun stands for the child only right after a sentence about the child alone.
    meta["answer"] is always the right count."""
    lo, hi = steps or WP_STEPS
    top = max_quantity or WP_MAX_QUANTITY
    p_distract = WP_DISTRACTOR_P if distractor_p is None else distractor_p
    name, obj = rng.choice(NAME_LIST), rng.choice(OBJECT_LIST)
    subj, objp, _, _ = PRONOUNS[NAMES[name]]
    friend = rng.choice([n for n in NAME_LIST if n != name])
    n_events = rng.randint(lo, hi)
    # the distractor comes right before this event (or before the question)
    distractor_at = rng.randint(1, n_events + 1) if rng.coin(p_distract) else None
    start = count = rng.randint(1, top)
    sentences, events, said = [WP_START.format(n=count, items=_items(count, obj), name=name)], [], []
    alone = True  # did the last sentence speak of the child alone?
    for event in range(1, n_events + 2):
        if event == distractor_at:
            other = rng.choice([n for n in NAME_LIST if n not in (name, friend)])
            d = rng.randint(1, top)
            sentences.append(WP_DISTRACTOR.format(other=other, d=d, items=_items(d, obj)))
            events.append(("other", d))
            alone = False
        if event > n_events:
            break
        add = count == 0 or (count < top and rng.coin(0.5))
        k = rng.randint(1, top - count) if add else rng.randint(1, count)
        count += k if add else -k
        templates = WP_ADD if add else WP_SUB
        template = rng.choice(templates)
        events.append((WP_EVENT_KINDS[add][templates.index(template)], k))
        words = {"subj": subj if alone else name, "Subj": subj.capitalize() if alone else name,
                 "obj": objp if alone else name, "friend": friend}
        sentences.append(template.format(k=k, items=_items(k, obj), **words))
        said.append(sentences[-1])
        alone = "{friend}" not in template
    sentences.append(WP_QUESTION.format(items=OBJECTS[obj], name=name))
    response, _ = demonstration_word_problem(rng, start, events, said)
    return Example("word_problem", " ".join(sentences), response, {"answer": str(count)})


def make_list_task(task: str, rng: Recorder) -> Example:
    words = pick_distinct(rng, LIST_POOL, rng.randint(*LIST_LENGTH))
    prompt = LIST_PROMPTS[task].format(words=", ".join(words))
    answer = {"sort": ", ".join(sorted(words)), "reverse": ", ".join(reversed(words)), "count": str(len(words))}[task]
    return _verifiable(task, prompt, answer)


def make_qa(rng: Recorder) -> Example:
    """A generated story, then a question answered by one or two words of it."""
    story, s = make_story(rng)
    answers = {"color": s["color"], "find": s["a_thing"], "feel": s["feel"]}
    if "place" in s:
        answers["place"] = s["place"]
    if "animal" in s:
        answers["animal"] = s["animal"]
    kind = rng.choice([k for k in QA_QUESTIONS if k in answers])
    question = QA_QUESTIONS[kind].format(verb_base=FIND_VERBS[s["verb"]], **s)
    return _verifiable("qa", QA_PROMPT.format(story=story, question=question), answers[kind])


def story_prompt(rng: Recorder) -> tuple[str, dict]:
    """('Write a happy story about Mia and a red kite.', spec). The plain variant also wants a happy story."""
    spec = {"name": rng.choice(NAME_LIST), "color": rng.choice(COLORS), "object": rng.choice(OBJECT_LIST),
            "mood": "happy"}
    prompt = rng.choice(STORY_PROMPTS).format(name=spec["name"], a_thing=article(f"{spec['color']} {spec['object']}"))
    return prompt, spec


def make_story_example(rng: Recorder) -> Example:
    """A story prompt and its demonstration by the mixed-skill writer (demonstration_story): the room above SFT."""
    prompt, spec = story_prompt(rng)
    text, _ = demonstration_story(rng, spec)
    return Example("story", prompt, text, spec)


def make_example(task: str, rng: Recorder, word_problem_options: dict | None = None) -> Example:
    if task == "arithmetic":
        return make_arithmetic(rng)
    if task == "word_problem":
        return make_word_problem(rng, **(word_problem_options or {}))
    if task in LIST_PROMPTS:
        return make_list_task(task, rng)
    if task == "qa":
        return make_qa(rng)
    if task == "story":
        return make_story_example(rng)
    raise ValueError(f"unknown task {task!r}; choose from {TASKS}")


HELDOUT_BUCKETS = 10  # a prompt is "val" iff crc32(prompt) % 10 == 0, so train and val prompts never meet


def prompt_split(prompt: str) -> str:
    return "val" if zlib.crc32(prompt.encode()) % HELDOUT_BUCKETS == 0 else "train"


def generate_instructions(n: int, seed: int | str = 0, tasks: tuple = TASKS, weights: list | None = None,
                          split: str | None = None, word_problem_options: dict | None = None) -> list[Example]:
    """n examples, tasks drawn with weights (default equal). split="train"/"val" keeps only that side's prompts."""
    rng, out = Recorder(seed), []
    weights = weights or [1] * len(tasks)
    while len(out) < n:
        ex = make_example(rng.weighted(tasks, weights), rng, word_problem_options)
        if split is None or prompt_split(ex.prompt) == split:
            out.append(ex)
    return out


# ----------------------------------------------------------------------------
# The word-problem demonstrator: a wrong strategy a verifier can catch

# Real worked solutions come from people of mixed skill, and some of their mistakes are not slips but a wrong way of
# reading the problem. The demonstrator has one such habit (data/README.md says why): it reads "Then she gives 3
# apples to Leo." as a gain, as if "gives" always meant getting, in 2 of 3 of these events (WP_MISREAD_P). So the SFT
# model learns the misreading as its most likely one, and answers those problems wrong when greedy, while its samples
# still read the event right about 1 time in 3: a behaviour RL from a verifier can select. Each sum's arithmetic stays
# right, and the other tasks' demonstrations are all right.
WP_MISREAD_P = 2 / 3
WP_ERROR_CLASSES = ("right", "slip", "strategy", "events", "malformed")


def solution_plan(events: list[tuple[str, int]], misread: frozenset = frozenset()) -> list[tuple[str, int]]:
    """The sums a solution works, in order, as (op, k), one per event of the child's own (the other child's count is
    left out): the right plan, with the events whose indices are in `misread` worked the other way."""
    gains = WP_EVENT_KINDS[True]
    return [("plus" if (kind in gains) != (i in misread) else "minus", k)
            for i, (kind, k) in enumerate(events) if kind != "other"]


def work_plan(start: int, plan: list[tuple[str, int]], said: list[str] | None = None) -> str | None:
    """The worked sums of a plan from `start` (tinyworld.worked_steps), each after the sentence of the event it works
    when `said` holds them (one per sum), or None when a count leaves 0..99."""
    count, work = start, []
    for i, (op, k) in enumerate(plan):
        step = worked_steps(count, op, k)
        work.append(f"{said[i]} {step}" if said else step)
        count += k if op == "plus" else -k
        if not 0 <= count <= 99:
            return None
    return " ".join(work)


def demonstration_word_problem(rng: Recorder, start: int, events: list[tuple[str, int]],
                               said: list[str] | None = None) -> tuple[str, int]:
    """The SFT demonstration of a word problem: each "gives ... to" event misread as a gain with probability
    WP_MISREAD_P, then the plan worked, each sum after its event's sentence (`said`: the sentences of the child's own
    events, in order; event_sentences). Returns (response, how many events it misread); a misread plan whose count
    would pass 99 is worked right instead.
    Why restate each sentence: the sum then takes its number from the sentence just copied, not from the n-th event
    of the prompt, a place a 4-layer model loses from one SFT seed to the next (data/README.md)."""
    misread = frozenset(i for i, (kind, _) in enumerate(events) if kind == "gives" and rng.coin(WP_MISREAD_P))
    work = work_plan(start, solution_plan(events, misread), said)
    return (work, len(misread)) if work is not None else (work_plan(start, solution_plan(events), said), 0)


def _sentences(prompt: str) -> list[str]:
    return [s.strip() for s in re.findall(r"[^.?]+[.?]", prompt)]


def event_sentences(prompt: str) -> list[str]:
    """The sentences of a word problem's events of the child's own, in order (what a demonstration restates)."""
    _, events = word_problem_events(prompt)
    return [s for s, (kind, _) in zip(_sentences(prompt)[1:-1], events) if kind != "other"]


def word_problem_events(prompt: str) -> tuple[int, list[tuple[str, int]]]:
    """Read a word problem back into (start, events): the inverse of make_word_problem's sentences."""
    sentences = _sentences(prompt)
    start = int(re.fullmatch(r"\w+ has (\d+) \w+\.", sentences[0]).group(1))
    events = []
    for s in sentences[1:-1]:
        k = int(re.search(r"\d+", s).group())
        if re.fullmatch(r"\w+ has \d+ \w+\.", s):
            events.append(("other", k))
        elif " finds " in s:
            events.append(("finds", k))
        elif " buys " in s:
            events.append(("buys", k))
        elif " loses " in s:
            events.append(("loses", k))
        elif re.search(r" gives \d+ \w+ to ", s):
            events.append(("gives", k))
        else:  # "Leo gives her 3 more apples."
            events.append(("given", k))
    return start, events


WORKED_SUM = re.compile(r"(\d+) (plus|minus) (\d+): \d+ (?:plus|minus) \d+ is \d+\. \d+ (?:plus|minus) \d+ is (\d+)\.")
WORKED_STEP = re.compile(r"(?:[A-Z][^.?]*\. )?" + WORKED_SUM.pattern)  # a sum, after the sentence it works


def classify_word_problem(prompt: str, response: str) -> str:
    """What kind of answer a response to a word problem is (WP_ERROR_CLASSES):
    right      the final number is the answer (as the gold reward reads it: the last number written)
    slip       the right sums, in the right order, from the right start, with an arithmetic or copying slip
    strategy   the right events and numbers, but an event's verb read the wrong way (a gain worked as a loss, or
               a loss as a gain): the demonstrator's habit, or another misreading of the same kind
    events     other sums: another start, an event added (the other child's count) or dropped, a number misread
    malformed  a wrong final number that is not at the end of a chain of worked sums, each after its sentence or
               alone (or no number at all)"""
    start, events = word_problem_events(prompt)
    right = solution_plan(events)
    answer = start + sum(k if op == "plus" else -k for op, k in right)
    numbers = re.findall(r"\d+", response)
    if numbers and int(numbers[-1]) == answer:
        return "right"
    sums = WORKED_STEP.findall(response)
    if not sums or " ".join(m.group(0) for m in WORKED_STEP.finditer(response)) != response.strip():
        return "malformed"
    written = [(op, int(k)) for _, op, k, _ in sums]
    if int(sums[0][0]) != start or [k for _, k in written] != [k for _, k in right]:
        return "events"
    return "slip" if written == right else "strategy"


# ----------------------------------------------------------------------------
# The story demonstrator and the corruptions

CORRUPTIONS = ("wrong_name", "wrong_object", "sad_turn", "truncate", "repeat", "too_long", "garble")

# The SFT demonstrator: a writer of mixed skill, as human demonstrators are. Three in four of its stories are what
# was asked; the fourth has one flaw, each of the seven kinds equally often (1/28 = 3.6% of stories each).
DEMO_FLAW_WEIGHTS = {"none": 21, **{kind: 1 for kind in CORRUPTIONS}}


def demonstration_story(rng: Recorder, spec: dict) -> tuple[str, list[str]]:
    """The SFT demonstration of a story prompt: clean with probability 3/4, else one corruption drawn uniformly
    (DEMO_FLAW_WEIGHTS). Returns (text, corruptions)."""
    flaw = rng.weighted(list(DEMO_FLAW_WEIGHTS), list(DEMO_FLAW_WEIGHTS.values()))
    kinds = [] if flaw == "none" else [flaw]
    return corrupted_story(rng, spec, kinds), kinds


def corrupted_story(rng: Recorder, spec: dict, kinds: list[str]) -> str:
    """A story for spec written by the generator, then broken in each of the given ways (CORRUPTIONS)."""
    name, color, obj = spec["name"], spec["color"], spec["object"]
    if "wrong_name" in kinds:
        name = rng.choice([n for n in NAME_LIST if n != name])
    if "wrong_object" in kinds:
        color, obj = rng.choice(COLORS), rng.choice([o for o in OBJECT_LIST if o != obj])
    text, _ = make_story(rng, name, color, obj, "sad" if "sad_turn" in kinds else "happy")
    sents = split_sentences(text)
    if "truncate" in kinds:
        sents = sents[:rng.randint(2, len(sents) - 2)]
    if "repeat" in kinds:
        i = rng.randint(0, len(sents) - 1)
        sents[i:i + 1] = [sents[i]] * (1 + rng.randint(2, 4))
    if "too_long" in kinds:
        while len(words_of(" ".join(sents))) <= 100:  # another story's sentences pasted in the middle
            sents[-1:-1] = split_sentences(make_story(rng)[0])[1:-1]
    if "garble" in kinds:
        i = rng.randint(0, len(sents) - 1)
        words = [w.lower() for w in words_of(sents[i])]
        rng.rng.shuffle(words)  # no need to record probabilities here
        sents[i] = " ".join(words) + "."
    return " ".join(sents)


# ----------------------------------------------------------------------------
# RL prompt sets

RL_KINDS = ("verifiable", "stories")


def rl_prompts(kind: str, n: int, seed: int | str = 0) -> list[dict]:
    """Prompts from the train side of the prompt split (SFT val prompts stay unseen)."""
    if kind == "verifiable":
        return [{"task": e.task, "prompt": e.prompt, "answer": e.meta["answer"]}
                for e in generate_instructions(n, seed, tasks=("arithmetic", "word_problem"), split="train")]
    if kind == "stories":
        return [{"task": "story", "prompt": e.prompt, "spec": e.meta}
                for e in generate_instructions(n, seed, tasks=("story",), split="train")]
    raise ValueError(f"unknown rl_prompts kind {kind!r}; choose from {RL_KINDS}")
