"""Supervised fine-tuning (SFT): teach the pretrained GPT to answer instructions.

Each example becomes one sequence in the chat template

    <|user|> prompt <|assistant|> response <|endoftext|>

and the loss is the usual next-token cross-entropy, but only over the response tokens R (the EOS
included, so the model learns to stop):

    L = -1/|R| Σ_{t ∈ R} log p(x_t | x_<t)

The template itself (`tokenizer.encode_chat`) lives with the special tokens it is made of. The prompt
is context, not something to imitate: its targets are -100 (`data.sft_collate`). Training reuses
chapter 4's loop; evaluation decodes greedily (batched, KV cache) and scores each task with
the tiny world's gold reward: the final number for sums and word problems (answered in worked steps),
exact match for the other verifiable tasks, the hidden preference for stories.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from llm_from_scratch.data import sft_collate
from llm_from_scratch.generation import generate, sequence_logprobs
from llm_from_scratch.gold_rewards import NUMBER_RUN, WORKED_TASKS, gold_reward
from llm_from_scratch.model import GPT, eval_mode
from llm_from_scratch.tasks import Example
from llm_from_scratch.tokenizer import Tokenizer, encode_chat, pad_right


class SFTBatches:
    """Templated examples, and a batch for every step: batch(step) is a function of (seed, step) alone, so a
    resumed run sees the same batches (as data.WindowSampler).

    Length grouping (group > 1, the default): a batch is padded to its longest row, and the tasks differ a lot
    in length (a sum is ~40 tokens, a QA prompt holds a whole story), so random batches would spend most of
    their compute on padding. Instead `group` batches' worth of examples are drawn at random, sorted by length
    and cut into `group` batches, served in a shuffled order: every batch holds examples of similar length.
    Each example is still drawn uniformly; group=1 gives plain random batches."""

    def __init__(self, tok: Tokenizer, examples: list, context_length: int, batch_size: int, seed: int = 0,
                 train_on_prompt: bool = False, group: int = 16):
        encoded = [encode_chat(tok, _field(e, "prompt"), _field(e, "response")) for e in examples]
        # a sequence of n tokens gives n - 1 (input, target) pairs: it fits if n - 1 <= context
        self.examples = [e for e in encoded if len(e[0]) - 1 <= context_length]
        self.dropped = len(encoded) - len(self.examples)
        if not self.examples:
            raise ValueError(f"SFTBatches: no example fits in the context of {context_length} tokens")
        if group < 1:
            raise ValueError(f"SFTBatches: group must be >= 1, got {group}")
        self.pad_id, self.batch_size, self.seed, self.train_on_prompt = tok.pad_id, batch_size, seed, train_on_prompt
        self.group = group

    def indices(self, step: int) -> list[int]:
        """The examples of batch `step`."""
        block, slot = divmod(step, self.group)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + block)
        pick = torch.randint(0, len(self.examples), (self.group * self.batch_size,), generator=g).tolist()
        pick.sort(key=lambda i: len(self.examples[i][0]))  # similar lengths side by side
        order = torch.randperm(self.group, generator=g).tolist()  # which slice of the sorted block each step gets
        start = order[slot] * self.batch_size
        return pick[start:start + self.batch_size]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sft_collate([self.examples[i] for i in self.indices(step)], self.pad_id, self.train_on_prompt)


def _field(example, name: str):
    return getattr(example, name) if hasattr(example, name) else example[name]


# ----------------------------------------------------------------------------- evaluation

NUMBER = NUMBER_RUN
STEP = r"\d+ (plus|minus) \d+ is \d+\."
SUM = rf"\d+ (plus|minus) \d+: {STEP} {STEP}"  # '95 plus 42: 95 plus 40 is 135. 135 plus 2 is 137.'
WORKED = re.compile(rf"{SUM}( {SUM})*")  # a sum worked in steps
SAID = r"([A-Z][^.?]*\. )"  # a word problem's event, restated before the sum that works it
WORKED_EVENTS = re.compile(rf"{SAID}?{SUM}( {SAID}?{SUM})*")  # word problems: one worked sum per event, the answer last
WORD_LIST = re.compile(r"[a-z]+(, [a-z]+)*")


def well_formed(task: str, response: str, ended: bool) -> bool:
    """Did the model stop (EOS) with an answer of the right shape for the task?"""
    if not ended:
        return False
    if task in WORKED_TASKS:
        return (WORKED_EVENTS if task == "word_problem" else WORKED).fullmatch(response) is not None
    if task == "count":
        return NUMBER.fullmatch(response) is not None
    if task in ("sort", "reverse"):
        return WORD_LIST.fullmatch(response) is not None
    if task == "qa":
        return 0 < len(response.split()) <= 4
    return response.endswith("The end.")  # story


@torch.no_grad()
def answer(model: GPT, tok: Tokenizer, prompts: list[str], max_new_tokens: int = 160, temperature: float = 0.0,
           batch_size: int = 64, generator: torch.Generator | None = None) -> list[tuple[str, bool]]:
    """(response text, ended with EOS) for each prompt; batched by similar length, KV cache on."""
    encoded = [encode_chat(tok, p)[0] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # similar lengths: little padding
    out: list[tuple[str, bool]] = [("", False)] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = [encoded[i] for i in idx]
        room = model.config.context_length - max(len(b) for b in batch)
        gen = generate(model, batch, min(max_new_tokens, room), temperature=temperature, eos_id=tok.eos_id,
                       pad_id=tok.pad_id, generator=generator)
        for i, completion in zip(idx, gen.completions()):
            ended = bool(completion) and completion[-1] == tok.eos_id
            out[i] = (tok.decode(completion[:-1] if ended else completion), ended)
    return out


def evaluate_tasks(model: GPT, tok: Tokenizer, examples: list, max_new_tokens: int = 160,
                   batch_size: int = 64) -> tuple[dict[str, dict[str, float]], list[dict]]:
    """Greedy answers to held-out examples -> per task: accuracy (mean gold reward: 1/0 for the verifiable
    tasks, the story score for stories), well_formed (share), n; plus one row per example (task, prompt, response,
    reward, well_formed)."""
    examples = [e if isinstance(e, Example) else Example.from_dict(e) for e in examples]
    answers = answer(model, tok, [e.prompt for e in examples], max_new_tokens, batch_size=batch_size)
    rows, per_task = [], defaultdict(list)
    for e, (response, ended) in zip(examples, answers):
        row = {"task": e.task, "prompt": e.prompt, "response": response, "target": e.response,
               "reward": gold_reward(e, response), "well_formed": well_formed(e.task, response, ended)}
        rows.append(row)
        per_task[e.task].append(row)
    summary = {task: {"accuracy": sum(r["reward"] for r in rs) / len(rs),
                      "well_formed": sum(r["well_formed"] for r in rs) / len(rs), "n": len(rs)}
               for task, rs in sorted(per_task.items())}
    return summary, rows


@torch.no_grad()
def response_logprobs(model: GPT, tok: Tokenizer, prompts: list[str], responses: list[str],
                      batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ log p(response tokens and EOS | prompt) under the model, and the number of those tokens: two (N,)
    tensors. Their ratio, the mean log-probability per token, is how unsurprised the model is by a response.
    A no-grad wrapper over generation.sequence_logprobs, dropout off."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    device = next(model.parameters()).device
    sums, counts = [], []
    with eval_mode(model):
        for i in range(0, len(prompts), batch_size):
            encoded = [encode_chat(tok, p, r) for p, r in zip(prompts[i:i + batch_size], responses[i:i + batch_size])]
            ids, mask, _ = (t.to(device) for t in pad_right([e for e, _ in encoded], tok.pad_id))
            lp = sequence_logprobs(model, ids, mask)  # (B, T-1): log p(token t+1 | tokens ≤ t), 0 on padding
            pos = torch.arange(1, ids.size(1), device=device)[None]  # (1, T-1): the position of each predicted token
            start = torch.tensor([n for _, n in encoded], device=device)[:, None]  # (B, 1): first response position
            is_response = (pos >= start) & mask[:, 1:].bool()  # (B, T-1): response tokens and the EOS
            sums.append((lp * is_response).sum(1).cpu())
            counts.append(is_response.sum(1).cpu())
    return torch.cat(sums), torch.cat(counts)
