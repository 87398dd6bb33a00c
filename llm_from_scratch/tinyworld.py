"""TinyWorld: the course's offline, synthetic world, and every sentence it can write.

TinyWorld is a small made-up world: about twenty children (each "he" or "she"),
fifteen animals, thirty objects, ten colors, fifteen places, some feelings and
weather. Every word it can write sits in the lists below (`vocabulary()` returns
them all). This module holds the world, its story grammar, the facts and worked
sums of pretraining, the prompt templates of its tasks, and the pretraining text,
generated deterministically from a seed. What is derived from the world sits in
the modules that follow it (all chapter 1, all standard library only):

* tasks.py          instruction examples (prompt -> response) for supervised
                    fine-tuning (SFT), and the prompt sets for RL;
* gold_rewards.py   the gold rewards: exact match for the verifiable tasks, a
                    hidden "human preference" for stories;
* preferences.py    story pairs labelled by the gold reward through Bradley-Terry
                    noise, and their Bayes ceiling;
* dataset_files.py  every dataset of the course, written to disk from one seed.

Because we wrote the generator, we know things we never know about real data: the
entropy floor of its text (below) and the Bayes ceiling of its preference labels
(preferences.py).

The entropy floor. Every random decision goes through a `Recorder`, which adds
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
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

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
# Instruction templates: every prompt and word-problem sentence the tasks can write (tasks.py fills them). They live
# here, with every other sentence of the world, so that vocabulary() sees every word.

ARITH_PROMPTS = {"plus": ["Add {a} and {b}.", "What is {a} plus {b}?"],
                 "minus": ["Subtract {b} from {a}.", "What is {a} minus {b}?"]}
LIST_PROMPTS = {"sort": "Sort these words: {words}.", "reverse": "Reverse these words: {words}.",
                "count": "Count these words: {words}."}
QA_PROMPT = "Story: {story}\nQuestion: {question}"
QA_QUESTIONS = {"color": "What color was the {object}?", "place": "Where did {name} live?",
                "find": "What did {name} {verb_base}?", "animal": "What animal did {name} have?",
                "feel": "How did {name} feel at the end?"}
STORY_PROMPTS = ["Write a happy story about {name} and {a_thing}.", "Write a story about {name} and {a_thing}."]

# Word problems (tasks.make_word_problem).
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
# Text helpers: sentences and words of a text (the gold rewards and the corruptions read stories with them)

def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in re.findall(r"[^.?!]+[.?!]?", text) if s.strip()]


def words_of(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+|\d+", text)


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
