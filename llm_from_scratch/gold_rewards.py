"""The gold rewards: the fixed formulas that grade every task, which we know because we wrote the world.

Verifiable tasks (gold_reward):
    arithmetic, word_problem   1 if the last number of the response is the answer (final_number), else 0
    sort, reverse, count, qa   1 if the response is the answer after normalize_answer (lowercase, single spaces,
                               no final period), else 0

Stories (story_reward): a hidden "human preference", in [0, 1]. The story is parsed back against the grammar that
wrote it (parse_sentence: a sentence -> the part of the story it plays and its slot values), then

    r = (0.25 name + 0.25 object + 0.5 ending) * well_formed * coherence * repetition * length

    name          1 if the child the story opens with is the asked child, else 0
    object        1 if the thing found is the asked colored object, 0.5 if only the object is right, else 0
    ending        1 if the last thing before "The end." is an ending of the asked mood after a turn of that mood,
                  0.5 if only the feeling is right, else 0
    well_formed   0.5 ** (sentences the grammar cannot produce)
    coherence     0.5 ** (kinds of inconsistency: order, child, gender, thing, animal, place; see story_problems)
    repetition    0.5 ** (repeated sentences) * max(0, 1 - 2 * max(0, share of repeated word 4-grams - 0.1))
    length        1 within 20-90 words; n / 20 below, max(0, 1 - (n - 90) / 90) above

The multiplicative parts make "She was very happy." said five times, or a story whose child changes name halfway,
score far below a real story: a policy can exploit a learned reward model, but not this one, which reads the story
against the grammar instead of looking for words. name and object need the prompt: a reward model that reads only
the story cannot see them.
"""

from __future__ import annotations

import re

from llm_from_scratch.tasks import Example
from llm_from_scratch.tinyworld import (
    ANIMAL_LIST,
    CLOSING,
    COLORS,
    ENDINGS,
    FIND_SENTENCE,
    HAPPY_FEELINGS,
    HAPPY_TURNS,
    MIDDLES,
    NAME_LIST,
    NAMES,
    OBJECT_LIST,
    OPENINGS,
    PET_SENTENCE,
    PLACE_SENTENCE,
    PLACES,
    PRONOUNS,
    SAD_FEELINGS,
    SAD_TURNS,
    STORY_SLOTS,
    article,
    split_sentences,
    words_of,
)

# ----------------------------------------------------------------------------
# Answers

def normalize_answer(s: str) -> str:
    s = " ".join(s.strip().lower().split())
    return s[:-1].rstrip() if s.endswith(".") else s


# ----------------------------------------------------------------------------
# The story reward

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
            if "article" in slots:
                a_or_an = article(f"{slots['color']} {slots['object']}")[:2].strip()
                if a_or_an != slots.pop("article"):
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
        "object": (1.0 if found == (spec["color"], spec["object"])
                   else 0.5 if found and found[1] == spec["object"] else 0.0),
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


# ----------------------------------------------------------------------------
# The gold reward of any task

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
