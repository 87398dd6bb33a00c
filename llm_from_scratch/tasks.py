"""The tiny world's tasks: instruction examples for SFT, the story demonstrator, and the prompt sets for RL.

Seven tasks (TASKS), each an Example: a prompt, the demonstrated response, and in `meta` what the gold reward needs
(gold_rewards.py grades them):

    arithmetic     "Add 95 and 42." -> the sum worked in steps (tinyworld.worked_steps), whose last number, 137,
                   is the answer
    word_problem   "Mia has 5 apples. She finds 13 more apples. She loses 2 apples. How many apples does Mia have
                   now?" -> one worked sum per event. No count goes below 0 or above WP_MAX_QUANTITY, and a pronoun
                   stands for the child only right after a sentence about the child alone (one reading only)
    sort, reverse, count
                   3-6 distinct words of LIST_POOL -> sorted, reversed, or how many
    qa             a generated story and a question answered by one or two of its words
    story          "Write a happy story about Mia and a red kite." -> a demonstration by a writer of mixed skill

The held-out split is a function of the prompt alone: a prompt is "val" iff crc32(prompt) % 10 == 0, so no train
prompt is ever a val prompt (the SFT examples, the preference pairs and the RL prompts all use this split).

The story demonstrator (demonstration_story) is a writer of mixed skill, as human demonstrators are: with probability
21/28 = 3/4 it writes what was asked, otherwise one flaw (CORRUPTIONS), each of the seven kinds with probability 1/28.
That is the room above SFT that the reward model, best-of-N, RL and DPO must use. The same corruptions make the
candidate stories of the preference pairs (preferences.py).

The RL prompt sets (rl_prompts) come from the train side of the split: "verifiable" (arithmetic and word problems,
RL from verifiable rewards) and "stories" (RLHF). Every random decision goes through tinyworld's Recorder.
"""

from __future__ import annotations

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
WP_STEPS = (2, 4)          # number of additions/subtractions
WP_MAX_QUANTITY = 20       # no count (start, step, total) ever exceeds this
WP_DISTRACTOR_P = 0.3      # chance of one sentence about another child's count


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
    event by event: '5 plus 13: 5 plus 10 is 15. 15 plus 3 is 18. 18 minus 2: 18 minus 0 is 18. 18 minus 2 is 16.'
    No count goes below 0. A pronoun stands for the child only right after a sentence about the child alone."""
    lo, hi = steps or WP_STEPS
    top = max_quantity or WP_MAX_QUANTITY
    p_distract = WP_DISTRACTOR_P if distractor_p is None else distractor_p
    name, obj = rng.choice(NAME_LIST), rng.choice(OBJECT_LIST)
    subj, objp, _, _ = PRONOUNS[NAMES[name]]
    friend = rng.choice([n for n in NAME_LIST if n != name])
    n_events = rng.randint(lo, hi)
    # the distractor comes right before this event (or before the question)
    distractor_at = rng.randint(1, n_events + 1) if rng.coin(p_distract) else None
    count = rng.randint(1, top)
    sentences, work = [WP_START.format(n=count, items=_items(count, obj), name=name)], []
    alone = True  # did the last sentence speak of the child alone?
    for event in range(1, n_events + 2):
        if event == distractor_at:
            other = rng.choice([n for n in NAME_LIST if n not in (name, friend)])
            d = rng.randint(1, top)
            sentences.append(WP_DISTRACTOR.format(other=other, d=d, items=_items(d, obj)))
            alone = False
        if event > n_events:
            break
        add = count == 0 or (count < top and rng.coin(0.5))
        k = rng.randint(1, top - count) if add else rng.randint(1, count)
        work.append(worked_steps(count, "plus" if add else "minus", k))
        count += k if add else -k
        template = rng.choice(WP_ADD if add else WP_SUB)
        words = {"subj": subj if alone else name, "Subj": subj.capitalize() if alone else name,
                 "obj": objp if alone else name, "friend": friend}
        sentences.append(template.format(k=k, items=_items(k, obj), **words))
        alone = "{friend}" not in template
    sentences.append(WP_QUESTION.format(items=OBJECTS[obj], name=name))
    return Example("word_problem", " ".join(sentences), " ".join(work), {"answer": str(count)})


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
