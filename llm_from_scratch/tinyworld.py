"""TinyWorld: the course's offline, synthetic data, generated from a seed.

TinyWorld is a small made-up world: about twenty children (each "he" or "she"),
fifteen animals, thirty objects, ten colors, fifteen places, some feelings and
weather. Every word it can write sits in the lists below (`vocabulary()` returns
them all). From this world we generate, deterministically from a seed:

* pretraining text: short stories, lists of facts and arithmetic sentences;
* instruction examples (prompt -> response) for supervised fine-tuning (SFT);
* a hidden "human preference" for stories (`story_reward`), preference pairs
  labelled by it through Bradley-Terry noise, and prompt sets for RL.

Because we wrote the generator, we know things we never know about real data.

1. The entropy floor. Every random decision goes through a `Recorder`, which adds
   the log-probability of what it picked to `rng.logp`:
       choice(seq)        log(1 / len(seq))
       weighted(x, w)     log(w_i / sum(w))
       randint(a, b)      log(1 / (b - a + 1))
       coin(p)            log(p)  or  log(1 - p)
   A document's logp is the sum over its decisions, i.e. log P(choices). The
   grammar is built so that the *text determines the choices*: the strings
   offered at every decision are different, a story always ends with the fixed
   sentence "The end." and every sentence template is recognisable from its
   words, so you can parse a document back into the exact decisions that made
   it. Then no two choice sequences give the same text, and
       P(text) = P(choices) = exp(logp).
   Any model q has expected loss E[-log q(text)] >= E[-log P(text)] (Gibbs'
   inequality), so the corpus average
       floor = sum_docs(-logp) / sum_docs(tokens(text) + 1)
   is the lowest cross-entropy per token any model can reach on this data (the
   +1 is the end-of-document token, which is part of the sequence; documents are
   independent, so context from earlier documents does not help). The tokenizer
   must be deterministic (one token sequence per text), as BPE is. Reaching the
   floor needs copying: a story mentions its name and its colored object again.

2. The Bayes ceiling. The gold reward r(story) is a fixed formula. Labels of a
   pair (a, b) are noisy, as human labels are: a is chosen with probability
       p = sigmoid(beta * (r_a - r_b))              (Bradley-Terry)
   Even a reward model that knows r exactly predicts the label with accuracy
   max(p, 1 - p) on that pair, so mean(max(p, 1 - p)) over the pairs is the best
   accuracy any reward model can reach: `bayes_accuracy`.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llm_from_scratch.checkpoint import atomic_write_text, read_jsonl  # the project's one atomic writer and JSONL reader

# ----------------------------------------------------------------------------
# The world. Every choice list holds distinct strings (this keeps text -> choices unique).

NAMES = {  # name -> pronoun
    "Mia": "she", "Leo": "he", "Ava": "she", "Max": "he", "Lily": "she", "Tom": "he", "Zoe": "she",
    "Sam": "he", "Emma": "she", "Ben": "he", "Lucy": "she", "Jack": "he", "Anna": "she", "Finn": "he",
    "Rosa": "she", "Omar": "he", "Nina": "she", "Theo": "he", "Ella": "she", "Noah": "he",
}
NAME_LIST = list(NAMES)
PRONOUNS = {"she": ("she", "her", "her", "girl"), "he": ("he", "him", "his", "boy")}  # subject, object, possessive, kid

ANIMALS = {  # animal -> (plural, sound, home, legs)
    "cat": ("cats", "meow", "houses", 4), "dog": ("dogs", "woof", "houses", 4),
    "bird": ("birds", "tweet", "trees", 2), "fish": ("fish", None, "the water", 0),
    "frog": ("frogs", "ribbit", "ponds", 4), "duck": ("ducks", "quack", "ponds", 2),
    "rabbit": ("rabbits", None, "holes", 4), "horse": ("horses", "neigh", "barns", 4),
    "cow": ("cows", "moo", "barns", 4), "pig": ("pigs", "oink", "barns", 4),
    "sheep": ("sheep", "baa", "fields", 4), "owl": ("owls", "hoot", "trees", 2),
    "bear": ("bears", "growl", "caves", 4), "mouse": ("mice", "squeak", "holes", 4),
    "lion": ("lions", "roar", None, 4),
}
ANIMAL_LIST = list(ANIMALS)

OBJECTS = {  # object -> plural
    "kite": "kites", "ball": "balls", "book": "books", "apple": "apples", "boat": "boats", "hat": "hats",
    "cup": "cups", "drum": "drums", "car": "cars", "doll": "dolls", "box": "boxes", "bike": "bikes",
    "train": "trains", "balloon": "balloons", "block": "blocks", "shell": "shells", "flower": "flowers",
    "cookie": "cookies", "sock": "socks", "shoe": "shoes", "bell": "bells", "leaf": "leaves",
    "star": "stars", "key": "keys", "bag": "bags", "cake": "cakes", "egg": "eggs",
    "umbrella": "umbrellas", "crayon": "crayons", "robot": "robots",
}
OBJECT_LIST = list(OBJECTS)
TOYS = ["kite", "ball", "doll", "drum", "block", "robot", "balloon", "train", "car", "boat"]

COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "black", "brown"]
PLACES = ["the park", "the forest", "the beach", "the river", "the farm", "the lake", "the hill", "the sea",
          "the garden", "the school", "the zoo", "the town", "the woods", "the big city", "the old castle"]
HAPPY_FEELINGS = ["happy", "glad", "proud", "excited", "cheerful", "joyful"]
SAD_FEELINGS = ["sad", "upset", "unhappy", "lonely", "gloomy", "grumpy"]
WEATHER = ["sunny", "rainy", "windy", "cloudy", "snowy", "cold", "warm", "foggy"]
ACTIONS = ["ran", "jumped", "played", "sang", "danced", "walked", "swam", "rested"]
SIZES = ["little", "big", "small", "fluffy", "tiny", "young", "funny", "brave"]  # no vowel starts: "a {size}"
WHEN = ["One day", "One morning", "One evening", "One night"]
FIND_VERBS = {"found": "find", "got": "get", "saw": "see"}  # past -> base (for questions)

# ----------------------------------------------------------------------------
# Story grammar. A template's {fields} are filled from what the story already knows
# (name, thing, place, ...) or, if unknown, chosen from STORY_SLOTS through the Recorder.

OPENINGS = ["Once upon a time, there was a {kid} named {name}.", "There was a {kid} named {name}.",
            "Long ago, there lived a {kid} named {name}."]
PLACE_SENTENCE = "{name} lived near {place}."
PET_SENTENCE = "{name} had a {size} {animal}."
FIND_SENTENCE = "{when}, {name} {verb} {a_thing}."
MIDDLES = [  # 0-2 of these, without repetition; none starts with "Then"
    "{Pron} was very {happy}.", "{Pron} played with the {thing} all day.", "{Pron} showed the {thing} to {friend}.",
    "It was a {weather} day.", "{Pron} took the {thing} to {place}.", "The {animal} liked the {thing} too.",
    "{Pron} {action} with the {animal}.",
]
HAPPY_TURNS = ["Then {name} shared the {thing} with a friend.",
               "Then the sun came out and {name} played with the {thing}.",
               "Then {name} and the {animal} played with the {thing}.", "Then {name} gave the {thing} to {poss} mom."]
SAD_TURNS = ["Then the wind took the {thing} away.", "Then the {thing} broke.", "Then {name} lost the {thing}.",
             "Then the {animal} ran away with the {thing}.", "Then it started to rain and the {thing} got wet."]
ENDINGS = ["{name} was very {feel}.", "{name} felt {feel}."]
CLOSING = "The end."
STORY_SLOTS = {"happy": HAPPY_FEELINGS, "weather": WEATHER, "action": ACTIONS, "size": SIZES, "when": WHEN,
               "verb": list(FIND_VERBS)}
P_PLACE, P_PET, P_HAPPY, MAX_MIDDLE = 0.75, 0.5, 0.5, 2  # a story has 5 to 9 sentences

# ----------------------------------------------------------------------------
# Facts and arithmetic for pretraining.

NUMBER_WORDS = {0: "no", 2: "two", 4: "four"}


def article(phrase: str) -> str:
    """'a red kite', 'an orange kite', 'an owl'."""
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _build_facts() -> list[str]:
    facts = []
    for animal, (plural, sound, home, legs) in ANIMALS.items():
        facts.append(f"{article(animal).capitalize()} is an animal.")
        facts.append(f"{article(animal).capitalize()} has {NUMBER_WORDS[legs]} legs.")
        if sound:
            facts.append(f"{plural.capitalize()} say {sound}.")
        if home:
            facts.append(f"{plural.capitalize()} live in {home}.")
    facts += [f"{article(toy).capitalize()} is a toy." for toy in TOYS]
    facts += ["You can read a book.", "You can eat an apple.", "You can eat a cookie.", "You can eat a cake.",
              "You can fly a kite.", "You can kick a ball.", "You can ride a bike.", "You can wear a hat.",
              "You wear shoes on your feet.", "You wear socks on your feet.", "A boat floats on the water.",
              "A car has four wheels.", "A bike has two wheels.", "An umbrella keeps you dry.", "A key opens a door.",
              "A cup holds milk.", "Eggs come from hens.", "A bell can ring.", "Stars shine at night.",
              "The sun is yellow.", "The sky is blue.", "Grass is green.", "Snow is white.", "Milk is white.",
              "Leaves are green.", "The night sky is black.", "Many apples are red.", "Mud is brown.",
              "Some flowers are pink.", "When it rains, the grass gets wet.", "When it snows, the ground turns white.",
              "When it is windy, kites can fly high.", "When it is sunny, the day is warm.", "Clouds bring rain."]
    return list(dict.fromkeys(facts))  # drop duplicates, keep order


FACTS = _build_facts()
PRETRAIN_KINDS, PRETRAIN_WEIGHTS = ("story", "facts", "arithmetic"), (45, 5, 50)
FACTS_PER_DOC = (2, 4)
ARITH_PER_DOC, ARITH_MAX, ARITH_OPS = (1, 3), 99, ("plus", "minus")
DOC_SEPARATOR = "<|endoftext|>"

# ----------------------------------------------------------------------------
# Instruction templates (kept here so that vocabulary() sees every word).

TASKS = ("arithmetic", "word_problem", "sort", "reverse", "count", "qa", "story")
ARITH_PROMPTS = {"plus": ["Add {a} and {b}.", "What is {a} plus {b}?"],
                 "minus": ["Subtract {b} from {a}.", "What is {a} minus {b}?"]}
LIST_PROMPTS = {"sort": "Sort these words: {words}.", "reverse": "Reverse these words: {words}.",
                "count": "Count these words: {words}."}
LIST_LENGTH = (3, 6)
LIST_POOL = ANIMAL_LIST + OBJECT_LIST + COLORS
QA_PROMPT = "Story: {story}\nQuestion: {question}"
QA_QUESTIONS = {"color": "What color was the {object}?", "place": "Where did {name} live?",
                "find": "What did {name} {verb_base}?", "animal": "What animal did {name} have?",
                "feel": "How did {name} feel at the end?"}
# The SFT training mix: the worked tasks (sums, word problems) take the most examples to learn. Word problems
# weigh most: turning a story's events into sums is the one skill pretraining does not teach at all.
SFT_WEIGHTS = {"arithmetic": 3, "word_problem": 4, "sort": 1, "reverse": 1, "count": 1, "qa": 1, "story": 1}
# The held-out set: word problems weigh 4 (about 600 of 1,500), so that one greedy evaluation's standard error of
# the accuracy is at most 2.1 points; 150 of each other task.
SFT_VAL_WEIGHTS = {"arithmetic": 1, "word_problem": 4, "sort": 1, "reverse": 1, "count": 1, "qa": 1, "story": 1}
STORY_PROMPTS = ["Write a happy story about {name} and {a_thing}.", "Write a story about {name} and {a_thing}."]

# Word problems. Difficulty knobs, read at call time (so they can be tuned or monkeypatched).
WP_STEPS = (2, 4)          # number of additions/subtractions
WP_MAX_QUANTITY = 20       # no count (start, step, total) ever exceeds this
WP_DISTRACTOR_P = 0.3      # chance of one sentence about another child's count
# One reading only: the child is called "she"/"her" (or "he"/"him") only right after a sentence about that child
# alone; after a sentence that names anyone else, the child is named again ("Leo has 15 cars. Tom finds 2 more cars.").
WP_START = "{name} has {n} {items}."
WP_ADD = ["{Subj} finds {k} more {items}.", "{friend} gives {obj} {k} more {items}.",
          "Then {subj} buys {k} more {items}."]
WP_SUB = ["Then {subj} gives {k} {items} to {friend}.", "{Subj} loses {k} {items}."]
WP_DISTRACTOR = "{other} has {d} {items}."
WP_QUESTION = "How many {items} does {name} have now?"


# ----------------------------------------------------------------------------
# The Recorder: a random.Random that keeps the log-probability of its choices.

class Recorder:
    """Wraps random.Random(seed); self.logp (natural log, <= 0) sums the log-probability of every choice."""

    def __init__(self, seed: int | str = 0):
        self.rng = random.Random(seed)
        self.logp = 0.0

    def choice(self, seq):
        self.logp += math.log(1.0 / len(seq))
        return seq[self.rng.randrange(len(seq))]

    def weighted(self, items, weights):
        total = float(sum(weights))
        r = self.rng.random() * total
        for item, w in zip(items, weights):
            if r < w:
                self.logp += math.log(w / total)
                return item
            r -= w
        item, w = [(i, w) for i, w in zip(items, weights) if w > 0][-1]  # only reached by float round-off
        self.logp += math.log(w / total)
        return item

    def randint(self, a: int, b: int) -> int:
        self.logp += math.log(1.0 / (b - a + 1))
        return self.rng.randint(a, b)

    def coin(self, p: float) -> bool:
        heads = self.rng.random() < p
        self.logp += math.log(p if heads else 1.0 - p)
        return heads


def pick_distinct(rng: Recorder, pool: list, k: int) -> list:
    """k different items of pool, one rng.choice at a time (each from what is left)."""
    left, out = list(pool), []
    for _ in range(k):
        item = rng.choice(left)
        left.remove(item)
        out.append(item)
    return out


_FIELD = re.compile(r"\{(\w+)\}")


def _fill(rng: Recorder, template: str, known: dict, slots: dict) -> str:
    """Format template; unknown fields are chosen from slots and remembered in known."""
    for name in _FIELD.findall(template):
        if name not in known:
            known[name] = rng.choice(slots[name])
    return template.format(**known)


def _usable(template: str, known: dict, slots: dict) -> bool:
    return all(f in known or f in slots for f in _FIELD.findall(template))


# ----------------------------------------------------------------------------
# Pretraining documents

@dataclass
class Sample:
    text: str
    logp: float  # log P(text), natural log
    kind: str    # "story", "facts" or "arithmetic"


def make_story(rng: Recorder, name: str | None = None, color: str | None = None, obj: str | None = None,
               mood: str | None = None) -> tuple[str, dict]:
    """A 5-9 sentence story; arguments left as None are chosen by rng. Returns (text, what was chosen)."""
    name = name or rng.choice(NAME_LIST)
    color = color or rng.choice(COLORS)
    obj = obj or rng.choice(OBJECT_LIST)
    mood = mood or ("happy" if rng.coin(P_HAPPY) else "sad")
    subj, _, poss, kid = PRONOUNS[NAMES.get(name, "she")]
    known = {"name": name, "color": color, "object": obj, "mood": mood, "kid": kid, "Pron": subj.capitalize(),
             "poss": poss, "thing": f"{color} {obj}", "a_thing": article(f"{color} {obj}")}
    slots = dict(STORY_SLOTS, friend=[n for n in NAME_LIST if n != name],
                 feel=HAPPY_FEELINGS if mood == "happy" else SAD_FEELINGS)
    sentences = [_fill(rng, rng.choice(OPENINGS), known, slots)]
    if rng.coin(P_PLACE):
        known["place"] = rng.choice(PLACES)
        sentences.append(_fill(rng, PLACE_SENTENCE, known, slots))
    if rng.coin(P_PET):
        known["animal"] = rng.choice(ANIMAL_LIST)
        sentences.append(_fill(rng, PET_SENTENCE, known, slots))
    sentences.append(_fill(rng, FIND_SENTENCE, known, slots))
    middles = [t for t in MIDDLES if _usable(t, known, slots)]  # templates needing a place/pet only if we have one
    for template in pick_distinct(rng, middles, rng.randint(0, min(MAX_MIDDLE, len(middles)))):
        sentences.append(_fill(rng, template, known, slots))
    turns = [t for t in (HAPPY_TURNS if mood == "happy" else SAD_TURNS) if _usable(t, known, slots)]
    sentences.append(_fill(rng, rng.choice(turns), known, slots))
    sentences.append(_fill(rng, rng.choice(ENDINGS), known, slots))
    sentences.append(CLOSING)
    return " ".join(sentences), known


def facts_document(rng: Recorder) -> str:
    return " ".join(rng.choice(FACTS) for _ in range(rng.randint(*FACTS_PER_DOC)))


def worked_steps(a: int, op: str, b: int) -> str:
    """How the tiny world writes a sum: the problem, then the tens of b, then its ones, one sentence each.

    worked_steps(95, "plus", 42) == "95 plus 42: 95 plus 40 is 135. 135 plus 2 is 137."
    worked_steps(7, "minus", 3) == "7 minus 3: 7 minus 0 is 7. 7 minus 3 is 4."   (always two steps: one shape)

    Each step changes one or two digits of the running number and finds its operands a few tokens back.
    "95 plus 42 is 137" in one go needs the carry out of the ones before the first digit is written,
    all within one forward pass: writing intermediate results gives the model more tokens, so more
    computation, per answer (a "scratchpad": Nye et al., 2021, "Show your work").

    The problem comes first ("95 plus 42:") so that pretraining itself teaches the one move an
    answer to a question needs: fetching b's digits from where the problem is stated. Without it b is
    never written whole in pretraining, and SFT had to learn to fetch the ones digit of b from the
    prompt on its own, which some runs did and others did not (arithmetic from 26% to 92%)."""
    tens, ones = b // 10 * 10, b % 10
    mid = a + tens if op == "plus" else a - tens
    end = mid + ones if op == "plus" else mid - ones
    return f"{a} {op} {b}: {a} {op} {tens} is {mid}. {mid} {op} {ones} is {end}."


def draw_sum(rng: Recorder) -> tuple[int, str, int]:
    """(a, op, b): a sum or a difference of two numbers in 0..ARITH_MAX, never negative."""
    op = rng.choice(ARITH_OPS)
    a = rng.randint(0, ARITH_MAX)
    b = rng.randint(0, ARITH_MAX) if op == "plus" else rng.randint(0, a)
    return a, op, b


def arithmetic_sentence(rng: Recorder) -> str:
    """One sum or difference, worked in steps."""
    return worked_steps(*draw_sum(rng))


def arithmetic_document(rng: Recorder) -> str:
    return " ".join(arithmetic_sentence(rng) for _ in range(rng.randint(*ARITH_PER_DOC)))


def pretraining_sample(rng: Recorder) -> Sample:
    """One document; its logp counts every decision, including the choice of kind."""
    before, rng.logp = rng.logp, 0.0
    kind = rng.weighted(PRETRAIN_KINDS, PRETRAIN_WEIGHTS)
    if kind == "story":
        text = make_story(rng)[0]
    elif kind == "facts":
        text = facts_document(rng)
    else:
        text = arithmetic_document(rng)
    logp = rng.logp
    rng.logp = before + logp
    return Sample(text, logp, kind)


def generate_pretraining(n_chars: int, seed: int | str = 0) -> list[Sample]:
    """Documents until their texts hold at least n_chars characters (separators not counted)."""
    rng, samples, total = Recorder(seed), [], 0
    while total < n_chars:
        samples.append(pretraining_sample(rng))
        total += len(samples[-1].text)
    return samples


def entropy_floor(samples: list[Sample], count_tokens) -> float:
    """Nats per token no model can beat: sum(-logp) / sum(count_tokens(text) + 1); +1 is the EOS token."""
    return sum(-s.logp for s in samples) / sum(count_tokens(s.text) + 1 for s in samples)


def nats_per_char(samples: list[Sample]) -> float:
    """The floor for a character-level model: sum(-logp) / sum(len(text) + 1), the separator counted as 1 symbol."""
    return entropy_floor(samples, len)


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
    distractor_at = rng.randint(1, n_events + 1) if rng.coin(p_distract) else None  # before this event (or the question)
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
# Gold rewards

def normalize_answer(s: str) -> str:
    s = " ".join(s.strip().lower().split())
    return s[:-1].rstrip() if s.endswith(".") else s


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in re.findall(r"[^.?!]+[.?!]?", text) if s.strip()]


def words_of(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+|\d+", text)


STORY_WEIGHTS = {"name": 0.25, "object": 0.25, "ending": 0.5}  # the additive part of story_reward
STORY_WORDS = (20, 90)        # outside this many words the score shrinks linearly
REPEAT_PENALTY = 0.5          # multiplied in once per repeated sentence
GRAMMAR_PENALTY = 0.5         # multiplied in once per sentence the grammar cannot produce
COHERENCE_PENALTY = 0.5       # multiplied in once per kind of inconsistency (see story_problems)
GRAM_TOLERANCE = 0.1          # share of repeated word 4-grams a normal story may have (coreference repeats some)

# The story grammar's sentences, by the part of the story they play, in the order a story tells them:
# opening, [place], [pet], find, 0-2 middles, turn, ending, "The end."
STORY_PARTS = {"opening": OPENINGS, "place": [PLACE_SENTENCE], "pet": [PET_SENTENCE], "find": [FIND_SENTENCE],
               "middle": MIDDLES, "happy_turn": HAPPY_TURNS, "sad_turn": SAD_TURNS, "ending": ENDINGS,
               "closing": [CLOSING]}
STORY_ORDER = re.compile(r"opening (place )?(pet )?find (middle ){0,2}(happy|sad)_turn ending closing")
_SLOT_VALUES = {  # what each {field} of a template may be; thing and a_thing are parsed into color + object
    "name": NAME_LIST, "friend": NAME_LIST, "kid": ["girl", "boy"], "Pron": ["She", "He"], "poss": ["her", "his"],
    "place": PLACES, "animal": ANIMAL_LIST, "feel": HAPPY_FEELINGS + SAD_FEELINGS, **STORY_SLOTS}
_ALTS = {k: "|".join(sorted(map(re.escape, v), key=len, reverse=True)) for k, v in _SLOT_VALUES.items()}
_THING = rf"(?P<color>{'|'.join(COLORS)}) (?P<object>{'|'.join(sorted(OBJECT_LIST, key=len, reverse=True))})"


def _template_regex(template: str) -> re.Pattern:
    """'{name} had a {size} {animal}.' -> a regex whose named groups capture each slot's value."""
    parts = re.split(r"(\{\w+\})", template)
    out = []
    for p in parts:
        field_name = p[1:-1] if p.startswith("{") else None
        if field_name == "thing":
            out.append(_THING)
        elif field_name == "a_thing":
            out.append(rf"(?P<article>an?) {_THING}")
        elif field_name:
            out.append(f"(?P<{field_name}>{_ALTS[field_name]})")
        else:
            out.append(re.escape(p))
    return re.compile("".join(out))


_TEMPLATES = [(part, _template_regex(t)) for part, ts in STORY_PARTS.items() for t in ts]


def parse_sentence(sentence: str) -> tuple[str, dict] | None:
    """(the part it plays, its slot values) for a sentence the story grammar can produce, else None.
    'Then Mia lost the red kite.' -> ('sad_turn', {'name': 'Mia', 'color': 'red', 'object': 'kite'})"""
    for part, regex in _TEMPLATES:
        m = regex.fullmatch(sentence)
        if m:
            slots = {k: v for k, v in m.groupdict().items() if v is not None}
            if "article" in slots and article(f"{slots['color']} {slots['object']}")[:2].strip() != slots.pop("article"):
                return None  # "a orange kite"
            return part, slots
    return None


def is_well_formed(sentence: str) -> bool:
    """Is this a sentence the story grammar can produce (parsed against its templates and slot values)?"""
    return parse_sentence(sentence) is not None


def story_problems(parsed: list[tuple[str, dict]]) -> list[str]:
    """What a reader finds inconsistent in a story's grammatical sentences (each kind named once):
    "order"   the parts are not told in the grammar's order (opening, [place], [pet], find, middles, turn, ending, end)
    "child"   another child takes the protagonist's place ({name} is not the opening's child throughout)
    "gender"  girl/boy, she/he or her/his disagree with the protagonist
    "thing"   the colored thing changes (every mention must be the one found)
    "animal"  an animal is mentioned that was not introduced as the pet (or the pet changes)
    "place"   a place is gone to that is not where the child lives (or no home was said)
(A turn and an ending of different moods is the ending part's business: see story_reward_parts.)"""
    if not parsed:
        return ["order"]
    problems = []
    if not STORY_ORDER.fullmatch(" ".join(part for part, _ in parsed)):
        problems.append("order")
    child = next((s["name"] for _, s in parsed if "name" in s), None)
    if any(s.get("name", child) != child for _, s in parsed):
        problems.append("child")
    pron = NAMES.get(child, "she")
    expected = {"kid": PRONOUNS[pron][3], "Pron": PRONOUNS[pron][0].capitalize(), "poss": PRONOUNS[pron][2]}
    if any(s[k] != v for _, s in parsed for k, v in expected.items() if k in s):
        problems.append("gender")
    things = {(s["color"], s["object"]) for _, s in parsed if "object" in s}
    if len(things) > 1:
        problems.append("thing")
    pets = [s["animal"] for part, s in parsed if part == "pet"]
    if any(s["animal"] not in pets[:1] for part, s in parsed if "animal" in s) or len(set(pets)) > 1:
        problems.append("animal")
    homes = [s["place"] for part, s in parsed if part == "place"]
    if any(s["place"] not in homes[:1] for part, s in parsed if "place" in s) or len(set(homes)) > 1:
        problems.append("place")
    return problems


def story_reward_parts(spec: dict, text: str) -> dict[str, float]:
    """Each part in [0, 1], read off the story parsed against the grammar (see story_reward for how they combine):
    name        1 if the protagonist (the child the story opens with) is the asked child, else 0
    object      1 if the thing found is the asked colored object, 0.5 if only the object is right, else 0
    ending      1 if the last thing before "The end." is an ending of the asked mood after a turn of that mood,
                0.5 if the feeling is right but the turn is not, else 0
    well_formed 0.5 per sentence the grammar cannot produce ("Kite the red found happy.")
    coherence   0.5 per kind of inconsistency (story_problems: a second protagonist, a changing thing, ...)
    repetition  0.5 per repeated sentence, less for many repeated word 4-grams
    length      1 within STORY_WORDS words, shrinking linearly outside
    name and object need the prompt: a reward model that reads only the story cannot see them."""
    sentences, words = split_sentences(text), words_of(text)
    parsed = [p for p in map(parse_sentence, sentences) if p is not None]
    protagonist = next((s["name"] for part, s in parsed if part == "opening"), None)
    found = next(((s["color"], s["object"]) for part, s in parsed if part == "find"), None)
    target = spec.get("mood", "happy")
    ending = 0.0
    tail = [p for p in parsed if p[0] != "closing"]
    if tail and tail[-1][0] == "ending" and sentences and sentences[-1] == CLOSING:
        feel_mood = "happy" if tail[-1][1]["feel"] in HAPPY_FEELINGS else "sad"
        turns = [part[:-5] for part, _ in tail if part.endswith("_turn")]
        if feel_mood == target:
            ending = 1.0 if turns and turns[-1] == target else 0.5
    lower = [w.lower() for w in words]
    grams = [tuple(lower[i:i + 4]) for i in range(len(lower) - 3)]
    repeated_grams = 1 - len(set(grams)) / len(grams) if grams else 0.0
    gram_penalty = max(0.0, 1.0 - 2 * max(0.0, repeated_grams - GRAM_TOLERANCE))
    repeated_sentences = len(sentences) - len(set(sentences))
    lo, hi = STORY_WORDS
    n = len(words)
    return {
        "name": 1.0 if protagonist == spec["name"] else 0.0,
        "object": 1.0 if found == (spec["color"], spec["object"]) else 0.5 if found and found[1] == spec["object"] else 0.0,
        "ending": ending,
        "well_formed": GRAMMAR_PENALTY ** (len(sentences) - len(parsed)) if sentences else 0.0,
        "coherence": COHERENCE_PENALTY ** len(story_problems(parsed)),
        "repetition": REPEAT_PENALTY ** repeated_sentences * gram_penalty,
        "length": 1.0 if lo <= n <= hi else n / lo if n < lo else max(0.0, 1.0 - (n - hi) / hi),
    }


def story_reward(spec: dict, text: str) -> float:
    """The hidden human preference, in [0, 1]: the story is parsed against the grammar that wrote it, then
    (0.25 name + 0.25 colored object + 0.5 ending of the asked mood) x well_formed x coherence x repetition x length.
    The multiplicative parts make "She was very happy." said five times, or a story whose child changes name
    halfway, score far below a real story."""
    p = story_reward_parts(spec, text)
    content = sum(w * p[k] for k, w in STORY_WEIGHTS.items())
    return content * p["well_formed"] * p["coherence"] * p["repetition"] * p["length"]


WORKED_TASKS = ("arithmetic", "word_problem")  # answered in worked steps: the last number is the answer
NUMBER_RUN = re.compile(r"\d+")


def final_number(response: str) -> str | None:
    """The last number written in a response ('... 135 plus 2 is 137.' -> '137'), or None."""
    numbers = NUMBER_RUN.findall(response)
    return str(int(numbers[-1])) if numbers else None


def gold_reward(example: Example | dict, response: str) -> float:
    """Exact match of the final number for worked tasks (arithmetic, word problems), exact match after
    normalize_answer for the other verifiable tasks, story_reward for stories.
    Accepts an Example, its dict, or an rl_prompts dict."""
    if isinstance(example, Example):
        task, meta = example.task, example.meta
    else:
        task = example["task"]
        meta = example.get("meta") or example.get("spec") or {"answer": example.get("answer")}
    if task == "story":
        return story_reward(meta, response)
    if task in WORKED_TASKS:
        return 1.0 if final_number(response) == str(int(meta["answer"])) else 0.0
    return 1.0 if normalize_answer(response) == normalize_answer(str(meta["answer"])) else 0.0


# ----------------------------------------------------------------------------
# Preference pairs labelled through Bradley-Terry noise

CORRUPTIONS = ("wrong_name", "wrong_object", "sad_turn", "truncate", "repeat", "too_long", "garble")
BT_BETA = 8.0


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def candidate_story(rng: Recorder, spec: dict) -> tuple[str, list[str]]:
    """A response to a story prompt: the story generator plus 0-2 corruptions. Returns (text, corruptions)."""
    kinds = pick_distinct(rng, CORRUPTIONS, rng.randint(0, 2))
    return corrupted_story(rng, spec, kinds), kinds


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


# ----------------------------------------------------------------------------
# Vocabulary

_VOCAB: set[str] = set()


def vocabulary() -> set[str]:
    """Every word (lowercased letters) the generators can write, prompts included."""
    return set(_vocab())


def _vocab() -> set[str]:  # built once, shared (do not modify)
    if not _VOCAB:
        texts = [*NAMES, *PRONOUNS, *(w for v in PRONOUNS.values() for w in v), *OBJECTS.values(), *OBJECTS,
                 *(str(x) for a, info in ANIMALS.items() for x in (a, *info) if x), *COLORS, *PLACES, *HAPPY_FEELINGS,
                 *SAD_FEELINGS, *WEATHER, *ACTIONS, *SIZES, *WHEN, *FIND_VERBS, *FIND_VERBS.values(), *OPENINGS,
                 PLACE_SENTENCE, PET_SENTENCE, FIND_SENTENCE, *MIDDLES, *HAPPY_TURNS, *SAD_TURNS, *ENDINGS, CLOSING,
                 *FACTS, *ARITH_OPS, "is", *(t for ts in ARITH_PROMPTS.values() for t in ts), *LIST_PROMPTS.values(),
                 QA_PROMPT, *QA_QUESTIONS.values(), *STORY_PROMPTS, WP_START, *WP_ADD, *WP_SUB, WP_DISTRACTOR,
                 WP_QUESTION, *NUMBER_WORDS.values()]
        for text in texts:
            _VOCAB.update(re.findall(r"[a-z]+", _FIELD.sub(" ", text).lower()))
    return _VOCAB


# ----------------------------------------------------------------------------
# Files on disk

FILES = {"pretrain_train": "pretrain_train.txt", "pretrain_val": "pretrain_val.txt",
         "pretrain_meta": "pretrain_meta.json", "sft_train": "sft_train.jsonl", "sft_val": "sft_val.jsonl",
         "preferences_train": "preferences_train.jsonl", "preferences_val": "preferences_val.jsonl",
         "rl_verifiable": "rl_verifiable.jsonl", "rl_stories": "rl_stories.jsonl"}
DEFAULT_SIZES = {"n_chars": 4_000_000, "val_fraction": 0.05, "n_sft": 20_000, "n_sft_val": 1_500,
                 "n_pref": 10_000, "n_pref_val": 1_000, "n_rl": 2_000}
QUICK_SIZES = {"n_chars": 200_000, "n_sft": 500, "n_sft_val": 100, "n_pref": 300, "n_pref_val": 100, "n_rl": 100}  # smoke runs
GENERATOR_VERSION = 10  # bump when the generator changes, so ensure_datasets regenerates


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write_datasets(data_dir: str | Path, seed: int = 0, **sizes) -> dict[str, Path]:
    """Generate every file into data_dir (sizes: any of DEFAULT_SIZES' keys). Returns {name: path}."""
    unknown = set(sizes) - set(DEFAULT_SIZES)
    if unknown:
        raise TypeError(f"unknown sizes {sorted(unknown)}; choose from {sorted(DEFAULT_SIZES)}")
    sizes = {**DEFAULT_SIZES, **sizes}
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: data_dir / v for k, v in FILES.items()}
    splits = {}
    for split, n_chars in (("train", sizes["n_chars"]), ("val", int(sizes["n_chars"] * sizes["val_fraction"]))):
        t0, split_seed = time.perf_counter(), f"{seed}/pretrain/{split}"
        samples = generate_pretraining(n_chars, split_seed)
        seconds = time.perf_counter() - t0
        atomic_write_text(paths[f"pretrain_{split}"], "".join(s.text + DOC_SEPARATOR for s in samples))
        nats = sum(-s.logp for s in samples)
        splits[split] = {"n_docs": len(samples), "n_chars": sum(len(s.text) for s in samples), "total_nats": nats,
                         "nats_per_char": nats_per_char(samples), "seed": split_seed, "seconds": round(seconds, 3)}
    for split, n in (("train", sizes["n_sft"]), ("val", sizes["n_sft_val"])):
        weights = [(SFT_WEIGHTS if split == "train" else SFT_VAL_WEIGHTS)[t] for t in TASKS]
        rows = [e.to_dict() for e in generate_instructions(n, f"{seed}/sft/{split}", weights=weights, split=split)]
        atomic_write_text(paths[f"sft_{split}"], _jsonl(rows))
    for split, n in (("train", sizes["n_pref"]), ("val", sizes["n_pref_val"])):
        atomic_write_text(paths[f"preferences_{split}"], _jsonl(preference_pairs(n, f"{seed}/pref/{split}", split=split)))
    for kind in RL_KINDS:
        atomic_write_text(paths[f"rl_{kind}"], _jsonl(rl_prompts(kind, sizes["n_rl"], f"{seed}/rl/{kind}")))
    meta = {"generator_version": GENERATOR_VERSION, "seed": seed, "sizes": sizes, "doc_separator": DOC_SEPARATOR,
            "splits": splits}
    atomic_write_text(paths["pretrain_meta"], json.dumps(meta, indent=2))  # written last: it marks a complete set
    return paths


def ensure_datasets(data_dir: str | Path, seed: int = 0, **sizes) -> dict[str, Path]:
    """Return the paths, regenerating if a file is missing or the meta's version, seed or sizes differ."""
    paths = {k: Path(data_dir) / v for k, v in FILES.items()}
    want = {**DEFAULT_SIZES, **sizes}
    if all(p.exists() for p in paths.values()):
        try:
            meta = json.loads(paths["pretrain_meta"].read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            meta = {}
        if (meta.get("generator_version"), meta.get("seed"), meta.get("sizes")) == (GENERATOR_VERSION, seed, want):
            return paths
    return write_datasets(data_dir, seed, **sizes)


def load_pretraining(path: str | Path) -> list[str]:
    """The documents of a pretrain_*.txt file (each one was followed by DOC_SEPARATOR)."""
    docs = Path(path).read_text(encoding="utf-8").split(DOC_SEPARATOR)
    return docs[:-1] if docs and docs[-1] == "" else docs


# python -m llm_from_scratch.tinyworld [DATA_DIR]: write the default files, print the numbers of data/README.md
if __name__ == "__main__":
    out = write_datasets(sys.argv[1] if len(sys.argv) > 1 else "data/tinyworld")
    meta = json.loads(out["pretrain_meta"].read_text())
    print(f"vocabulary: {len(vocabulary())} words")
    for split, m in meta["splits"].items():
        print(f"pretrain {split}: {m['n_docs']} docs, {m['n_chars']} chars, {m['nats_per_char']:.4f} nats/char, "
              f"{m['seconds']:.2f} s")
    for split in ("train", "val"):
        print(f"preferences {split}: bayes ceiling {bayes_accuracy(read_jsonl(out[f'preferences_{split}'])):.4f}")
