"""A mutation study of the whole library: plant one plausible bug at a time and see whether the tests notice.

What it is. A *mutation* is a one-line edit of the library that a person could plausibly write by mistake: a mask
shifted by one, a missing 1/sqrt(d), a `.detach()` dropped from a reference log-prob, left padding where the code
expects right padding, a resume that forgets the optimizer state. For each mutation in the catalogue below, this
script edits a throwaway copy of the repository, runs the tests that are relevant to it, and records whether they
fail (the mutation is *caught*) or still pass (it *survived*). The mutation score, caught / total, measures how
much of the library's behaviour the tests actually pin down, which line coverage cannot: a line can be executed
by a test that would pass whatever the line computed.

How to run it (from the repository root; the working tree itself is never edited):

    python benchmarks/mutation_study.py                   # the whole catalogue, one mutation at a time
    python benchmarks/mutation_study.py --list            # print the catalogue
    python benchmarks/mutation_study.py --only dpo        # the mutations whose id or description contain "dpo"
    python benchmarks/mutation_study.py --jobs 2 --out /tmp/mutations.json

The whole catalogue (over 100 mutations) takes about 5 minutes on a 2-core CPU with --jobs 1: each mutation runs
its relevant test files with `pytest -x -m "not slow"`, and most are killed by the first failing test in a few
seconds. The copy of `llm_from_scratch/`, `tests/`, `pyproject.toml` and `data/` is made once, at the start of each
run, in a temporary folder (one per job); before any mutation the relevant tests run once unmutated, and the study
refuses to go on unless that baseline is green. It also refuses to run when the `old` text of a mutation does not
occur exactly once in its file (the library changed: update the catalogue).

How to read a survivor. Every surviving mutation is one of two things:
  * an *equivalent* mutation: the edit does not change what the library computes (for instance a guard that
    another layer repeats), so no test could tell. Such a record carries an `equivalent` note saying why; the note
    is written only after checking it (by reading the code paths and comparing outputs), never as an excuse;
  * a *missing test*: the library computes something different and nothing checks it. Write the test.
The project's tests are expected to catch every non-equivalent mutation in this catalogue: a survivor without an
`equivalent` note is a gap in the test suite, not a tolerance.

A timeout (the tests ran longer than --timeout seconds, e.g. a loop that no longer ends) counts as caught and is
reported separately.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPIED = ("llm_from_scratch", "tests", "pyproject.toml", "data")  # what a test run needs (data/ only if present)
CATEGORIES = ("masks", "scales", "shifts", "offsets", "signs", "reductions", "detach", "padding", "schedules",
              "resume", "wiring", "checkpoint")

# the test files each part of the library is checked by, most direct first (pytest -x stops at the first failure)
TOKENIZER = ["tests/test_tokenizer.py"]
DATA = ["tests/test_data.py", "tests/test_train.py", "tests/test_sft.py"]
ATTENTION = ["tests/test_attention.py", "tests/test_model.py", "tests/test_generation.py"]
MODEL = ["tests/test_model.py", "tests/test_generation.py", "tests/test_reward_model.py", "tests/test_dpo.py"]
GENERATION = ["tests/test_generation.py", "tests/test_policy_gradient.py", "tests/test_ppo.py", "tests/test_dpo.py",
              "tests/test_sft.py", "tests/test_arena.py"]
TRAIN = ["tests/test_train.py", "tests/test_sft.py", "tests/test_arena.py"]
CHECKPOINT = ["tests/test_checkpoint.py", "tests/test_train.py", "tests/test_tokenizer.py",
              "tests/test_reward_model.py"]
SFT = ["tests/test_sft.py", "tests/test_arena.py"]
REWARD = ["tests/test_reward_model.py", "tests/test_ppo.py"]
PG = ["tests/test_policy_gradient.py", "tests/test_ppo.py", "tests/test_arena.py"]
PPO = ["tests/test_ppo.py"]
DPO = ["tests/test_dpo.py"]
ARENA = ["tests/test_arena.py"]


@dataclass(frozen=True)
class Mutation:
    id: str  # module.function.what-goes-wrong
    module: str  # the file, relative to the repository root
    old: str  # text that occurs exactly once in the file, on one line
    new: str  # what replaces it (one line)
    category: str  # one of CATEGORIES
    tests: tuple[str, ...]  # the relevant test files
    description: str  # the bug, in words
    equivalent: str | None = None  # why no test could tell (only when checked)


def mutation(id, module, old, new, category, tests, description, equivalent=None) -> Mutation:
    return Mutation(id, f"llm_from_scratch/{module}.py", old, new, category, tuple(tests), description, equivalent)


CATALOGUE: list[Mutation] = [
    # ------------------------------------------------------------------------------------------------- tokenizer
    mutation("tokenizer.merge_pair.step-one", "tokenizer", "            i += 2", "            i += 1", "offsets",
             TOKENIZER, "after a merge only one token is skipped: the pair's second token stays"),
    mutation("tokenizer.learn_merges.count-sign", "tokenizer", "                pair_counts[p] -= freqs[w]",
             "                pair_counts[p] += freqs[w]", "signs", TOKENIZER,
             "the fast trainer adds the old pairs' counts instead of removing them"),
    mutation("tokenizer.pad_right.last-index", "tokenizer", "return ids, mask, mask.sum(dim=1) - 1",
             "return ids, mask, mask.sum(dim=1)", "offsets", TOKENIZER + ["tests/test_data.py"],
             "the last real token's index is one past it"),
    mutation("tokenizer.pad_right.ids-left", "tokenizer", "ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)",
             "ids[i, T - len(r):] = torch.as_tensor(r, dtype=torch.long)", "padding",
             TOKENIZER + ["tests/test_data.py", "tests/test_reward_model.py"],
             "pad_right puts the tokens on the right but the mask on the left"),
    mutation("tokenizer.encode_chat.prompt-length", "tokenizer",
             "return prompt_ids + tok.encode(response) + [tok.eos_id], len(prompt_ids)",
             "return prompt_ids + tok.encode(response) + [tok.eos_id], len(prompt_ids) - 1", "offsets",
             TOKENIZER + SFT + DPO, "the prompt length leaves out <|assistant|>: it becomes a response token"),
    mutation("tokenizer.gpt2.special-ids", "tokenizer", "specials[tok] = base.n_vocab + i",
             "specials[tok] = base.n_vocab + i + 1", "offsets", TOKENIZER,
             "GPT-2's extra special tokens leave a hole after the vocabulary"),
    # ------------------------------------------------------------------------------------------------- data
    mutation("data.WindowSampler.batch.unshifted", "data", "return windows[:, :-1], windows[:, 1:]",
             "return windows[:, :-1], windows[:, :-1]", "shifts", DATA,
             "pretraining targets are the inputs, not the next tokens"),
    mutation("data.WindowSampler.batch.last-window", "data",
             "starts = torch.randint(0, len(self.tokens) - self.context_length, ",
             "starts = torch.randint(0, len(self.tokens) - self.context_length - 1, ", "offsets", DATA,
             "the last window that fits the stream is never drawn"),
    mutation("data.TokenWindowDataset.len", "data",
             "return (len(self.tokens) - (self.context_length + 1)) // self.stride + 1",
             "return (len(self.tokens) - (self.context_length + 1)) // self.stride", "offsets", DATA,
             "one window too few"),
    mutation("data.document_windows.unshifted", "data", "x, y = ids[:, :-1], ids[:, 1:].masked_fill",
             "x, y = ids[:, :-1], ids[:, :-1].masked_fill", "shifts", DATA,
             "validation targets are the inputs, not the next tokens"),
    mutation("data.document_windows.pad-mask-shift", "data", "ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)",
             "ids[:, 1:].masked_fill(mask[:, :-1] == 0, -100)", "padding", DATA,
             "the first padding target is scored (mask read one column early)"),
    mutation("data.document_windows.fit", "data", "if len(row) + len(doc) > context_length + 1:",
             "if len(row) + len(doc) >= context_length + 1:", "offsets", DATA,
             "a document that fills a window exactly starts a new window"),
    mutation("data.sft_collate.prompt-mask", "data", "y[i, : n_prompt - 1] = -100", "y[i, : n_prompt] = -100",
             "masks", DATA, "the response's first token is masked out with the prompt"),
    mutation("data.sft_collate.unshifted", "data", "        y[i, :n] = ids[1:]", "        y[i, :n] = ids[:-1]",
             "shifts", DATA, "SFT targets are the inputs, not the next tokens"),
    # ------------------------------------------------------------------------------------------------- attention
    mutation("attention.sdpa.unscaled", "attention", "is_causal=mask is None and S == T",
             "is_causal=mask is None and S == T, scale=1.0", "scales", ATTENTION,
             "the fused path forgets 1/sqrt(d)"),
    mutation("attention.explicit.scale-by-d", "attention", "(1.0 / math.sqrt(q.size(-1)))", "(1.0 / q.size(-1))",
             "scales", ATTENTION, "scores scaled by 1/d instead of 1/sqrt(d)"),
    mutation("attention.explicit.softmax-dim", "attention", "weights = F.softmax(scores, dim=-1)",
             "weights = F.softmax(scores, dim=-2)", "reductions", ATTENTION, "softmax over the queries, not the keys"),
    mutation("attention.causal_mask.no-cache-offset", "attention", ".tril(diagonal=S - T)", ".tril(diagonal=0)",
             "offsets", ATTENTION, "the causal mask ignores the cached positions"),
    mutation("attention.sdpa.is-causal-with-cache", "attention", "is_causal=mask is None and S == T",
             "is_causal=mask is None", "masks", ATTENTION,
             "one new token after a cache gets is_causal (top-left aligned): it sees only the first key"),
    mutation("attention.sdpa.chunk-after-cache-unmasked", "attention", "if mask is None and T > 1 and S != T:",
             "if mask is None and T > 1 and S == T:", "masks", ATTENTION,
             "several new tokens after cached ones get no causal mask: they see each other's future"),
    mutation("attention.KVCache.advance-one", "attention", "self.length += n", "self.length += 1", "offsets",
             ATTENTION, "the cache advances by one position whatever the number of new tokens"),
    # ------------------------------------------------------------------------------------------------- model
    mutation("model.Block.post-norm", "model", "x = x + self.attn(self.ln_1(x), mask, kv_cache)",
             "x = self.ln_1(x + self.attn(x, mask, kv_cache))", "wiring", MODEL,
             "the attention sublayer is post-norm (original Transformer), not GPT-2's pre-norm"),
    mutation("model.Block.mlp-reads-ln_1", "model", "x = x + self.mlp(self.ln_2(x))", "x = x + self.mlp(self.ln_1(x))",
             "wiring", MODEL, "the MLP reads the attention's LayerNorm (ln_2 never used)"),
    mutation("model.trunk.positions-count-padding", "model",
             "pos = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, past:]",
             "pos = torch.arange(past, S, device=idx.device).unsqueeze(0).expand(B, -1)", "padding", MODEL,
             "with padding, position ids count the pad tokens (a left-padded row does not start at 0)"),
    mutation("model.trunk.padded-positions-ignore-cache", "model", "clamp(min=0)[:, past:]", "clamp(min=0)[:, :T]",
             "offsets", MODEL, "with a mask and a cache, new tokens get the position ids of the first T tokens"),
    mutation("model.trunk.cache-positions-restart", "model",
             "pos = torch.arange(past, S, device=idx.device).unsqueeze(0)",
             "pos = torch.arange(0, T, device=idx.device).unsqueeze(0)", "offsets", MODEL,
             "without a mask, cached decoding restarts the position ids at 0"),
    mutation("model.trunk.pad-keys-visible", "model", "mask = causal_mask(T, S, idx.device) & keep[:, None, :]",
             "mask = causal_mask(T, S, idx.device) & torch.ones_like(keep)[:, None, :].bool()", "padding", MODEL,
             "real tokens attend to padding keys"),
    mutation("model.self_mask.no-roll", "model", ".roll(S - T, dims=1)", ".roll(0, dims=1)", "offsets", MODEL,
             "after a cache, each query's forced self-key is the wrong (possibly padding) key"),
    mutation("model.trunk.no-mask-after-cache", "model",
             "mask = None if past == 0 or T == 1 else causal_mask(T, S, idx.device)", "mask = None", "masks", MODEL,
             "without padding, the trunk leaves the causal mask after a cache to the attention layer",
             equivalent="CausalSelfAttention builds the same mask itself when it gets mask=None: the sdpa path adds "
                        "causal_mask(T, S) when T > 1 and S != T (and one query after a cache may see every key), and "
                        "explicit_attention uses causal_mask(T, S) whenever mask is None; so the trunk's own mask is a "
                        "duplicate and dropping it changes no output (checked: chunked cached forwards give the same "
                        "logits bit for bit with either attn_impl)"),
    mutation("model.init.residual-scale", "model", "std=0.02 / math.sqrt(2 * config.n_layer)",
             "std=0.02 / math.sqrt(config.n_layer)", "scales", MODEL,
             "residual projections initialised with 1/sqrt(L), not 1/sqrt(2L)"),
    # ------------------------------------------------------------------------------------------------- generation
    mutation("generation.left_pad.ids-right", "generation",
             "ids[i, P - len(p):] = torch.as_tensor(p, dtype=torch.long)",
             "ids[i, :len(p)] = torch.as_tensor(p, dtype=torch.long)", "padding", GENERATION,
             "prompts padded on the right while the mask says left"),
    mutation("generation.generate.prefill-mask-dropped", "generation",
             "logits = model(ids, attention_mask=None if all_real else mask, kv_cache=cache)[:, -1]",
             "logits = model(ids, attention_mask=None, kv_cache=cache)[:, -1]", "padding", GENERATION,
             "the prompt pass of a left-padded batch runs without its attention mask"),
    mutation("generation.sample_next.temperature-multiplies", "generation",
             "logits = filter_logits(logits.float() / temperature, top_k, top_p)",
             "logits = filter_logits(logits.float() * temperature, top_k, top_p)", "scales", GENERATION,
             "logits multiplied by the temperature instead of divided"),
    mutation("generation.filter_logits.top-p-strict", "generation", "drop_sorted = mass_before >= top_p",
             "drop_sorted = mass_before > top_p", "masks", GENERATION,
             "top-p keeps one token too many when the nucleus reaches p exactly"),
    mutation("generation.generate.completion-after-eos", "generation",
             "seq[:, end], seq_mask[:, end] = token, (~finished).long()",
             "seq[:, end], seq_mask[:, end] = token, torch.ones_like(token)", "masks", GENERATION,
             "padding after a row's EOS is marked as real completion tokens"),
    mutation("generation.generate.finished-forgotten", "generation", "finished |= token == eos_id",
             "finished = token == eos_id", "masks", GENERATION,
             "a row that ended is forgotten at the next step and resumes after its EOS"),
    mutation("generation.generate.completion-mask-prompt", "generation", "completion_mask[:, :P] = 0",
             "completion_mask[:, :P - 1] = 0", "offsets", GENERATION,
             "the completion mask includes the prompt's last token"),
    mutation("generation.generate.decode-mask-after-eos", "generation",
             "full_mask = None if all_real and not bool(finished.any()) else seq_mask[:, :end]",
             "full_mask = None if all_real else seq_mask[:, :end]", "masks", GENERATION,
             "without prompt padding, the padding written after a finished row's EOS is not masked",
             equivalent="only a finished row can have padding after its prompt, and a finished row's later logits "
                        "are never used (its tokens are overwritten with pad_id and its mask with 0); attention never "
                        "mixes rows, so the other rows' logits are unchanged (checked: generate gives identical "
                        "sequences and masks with and without the edit on random models and prompts)"),
    mutation("generation.sequence_logprobs.no-temperature", "generation",
             "logp = token_logprobs(logits.float() / temperature, ids[:, 1:])",
             "logp = token_logprobs(logits.float(), ids[:, 1:])", "scales", GENERATION,
             "log-probs ignore the sampling temperature"),
    mutation("generation.sequence_logprobs.unshifted", "generation",
             "attention_mask=None if all_real else attention_mask)[:, :-1]",
             "attention_mask=None if all_real else attention_mask)[:, 1:]", "shifts", GENERATION,
             "column t scores token t+1 with the logits of position t+1"),
    mutation("generation.sequence_logprobs.first-token-scored", "generation",
             "logp = logp * (attention_mask[:, 1:] * attention_mask[:, :-1]).to(logp.dtype)",
             "logp = logp * attention_mask[:, 1:].to(logp.dtype)", "masks", GENERATION,
             "a left-padded row's first real token gets a log-prob from a padding prefix"),
    mutation("generation.sequence_logprobs.mask-ignored", "generation",
             "all_real = attention_mask is None or bool(attention_mask.all())", "all_real = True", "padding",
             GENERATION, "padded rows are scored without their attention mask"),
    # ------------------------------------------------------------------------------------------------- train
    mutation("train.lr_at.warmup-from-zero", "train", "return cfg.lr * (step + 1) / cfg.warmup_steps",
             "return cfg.lr * step / cfg.warmup_steps", "schedules", TRAIN,
             "warmup starts at learning rate 0 (step 0 does nothing)"),
    mutation("train.lr_at.cosine-progress", "train",
             "progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)",
             "progress = step / max(1, cfg.max_steps)", "schedules", TRAIN,
             "the cosine's progress counts the warmup steps"),
    mutation("train.train.lr-restarts-on-resume", "train", "lr = lr_at(step, cfg)", "lr = lr_at(step - start, cfg)",
             "schedules", TRAIN, "a resumed run starts the schedule (warmup) again"),
    mutation("train.accumulate.not-divided", "train", "(loss / K).backward()", "loss.backward()", "scales", TRAIN,
             "accumulated gradients are K times too large"),
    mutation("train.accumulate.loss-summed", "train", "return loss_sum / K, tokens", "return loss_sum, tokens",
             "reductions", TRAIN, "the reported loss is the sum over micro-batches"),
    mutation("train.accumulate.token-count", "train", "tokens += int((y != -100).sum())", "tokens += y.numel()",
             "masks", TRAIN, "ignored targets (-100) are counted as tokens seen"),
    mutation("train.evaluate.mean-of-batch-means", "train", "n = int((y != -100).sum())", "n = 1", "reductions",
             TRAIN, "validation loss averages the batches' means instead of every target token"),
    mutation("train.resume.rng-not-restored", "train", "        _set_rng_state(rng)", "        pass", "resume", TRAIN,
             "a resumed run does not restore the RNG state (other dropout masks)"),
    mutation("train.resume.optimizer-not-restored", "train", 'optimizer.load_state_dict(state["optimizer"])', "pass",
             "resume", TRAIN, "a resumed run starts AdamW's moments from zero"),
    mutation("train.resume.weights-not-restored", "train", 'load_state(model, out_dir / "last" / "model.safetensors")',
             "pass", "resume", TRAIN, "a resumed run keeps the freshly initialised weights"),
    mutation("train.resume.counters-reset", "train",
             'start, tokens_seen, best_val, rng = state["step"], state["tokens_seen"], state["best_val"], state["rng"]',
             'start, tokens_seen, best_val, rng = state["step"], 0, float("inf"), state["rng"]', "resume", TRAIN,
             "a resumed run forgets the tokens seen and the best validation loss"),
    mutation("train.resume.rng-captured-once", "train",
             "rng = _rng_state()  # the state a resumed run must restore to replay this step exactly",
             "pass  # rng: the state from before the loop", "resume", TRAIN,
             "an interrupt saves the RNG state of the run's start, not of the interrupted step"),
    mutation("train.interrupt.saves-current-step", "train",
             "save_checkpoint(out_dir, model, optimizer, next_step, "
             "rng if next_step == step else _rng_state(), extra())",
             "save_checkpoint(out_dir, model, optimizer, step, rng, extra())", "resume", TRAIN,
             "an interrupt after a step's update saves that step as the next one: the resumed run repeats it"),
    mutation("train.checkpoint.step-before-update", "train",
             "save_checkpoint(out_dir, model, optimizer, done, _rng_state(), extra())",
             "save_checkpoint(out_dir, model, optimizer, step, _rng_state(), extra())", "resume", TRAIN,
             "a periodic checkpoint records the step just done as the next one"),
    mutation("train.load_gpt.overrides-ignored", "train", "GPT(GPTConfig(**{**config, **overrides}))",
             "GPT(GPTConfig(**{**overrides, **config}))", "checkpoint", TRAIN,
             "load_gpt's overrides (attn_impl, dropout) lose to the checkpoint's config"),
    # ------------------------------------------------------------------------------------------------- checkpoint
    mutation("checkpoint.atomic.write-in-place", "checkpoint",
             'fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")',
             "fd, tmp = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), str(path)", "resume", CHECKPOINT,
             "atomic_write_bytes writes the target in place (a crash leaves half a file)"),
    mutation("checkpoint.atomic.no-fsync", "checkpoint", "os.fsync(f.fileno())", "pass", "resume", CHECKPOINT,
             "the temp file is renamed over the target before its bytes reach the disk"),
    mutation("checkpoint.save_train_state.not-atomic", "checkpoint", "return atomic_write_bytes(path, buf.getvalue())",
             "return Path(path).write_bytes(buf.getvalue()) and Path(path)", "resume", CHECKPOINT,
             "train_state.pt is written in place, not atomically"),
    # ------------------------------------------------------------------------------------------------- sft
    mutation("sft.SFTBatches.fit-off-by-one", "sft", "if len(e[0]) - 1 <= context_length]",
             "if len(e[0]) <= context_length]", "offsets", SFT,
             "an example of exactly context + 1 tokens (context input/target pairs) is dropped"),
    mutation("sft.SFTBatches.block-order-sorted", "sft", "start = order[slot] * self.batch_size",
             "start = slot * self.batch_size", "offsets", SFT,
             "the batches of a length-sorted block are served shortest first, not in a shuffled order"),
    mutation("sft.SFTBatches.train-on-prompt-dropped", "sft",
             "sft_collate([self.examples[i] for i in self.indices(step)], self.pad_id, self.train_on_prompt)",
             "sft_collate([self.examples[i] for i in self.indices(step)], self.pad_id)", "masks", SFT,
             "SFTBatches(train_on_prompt=True) still masks the prompt"),
    mutation("sft.response_logprobs.position-offset", "sft", "pos = torch.arange(1, ids.size(1), device=device)[None]",
             "pos = torch.arange(0, ids.size(1) - 1, device=device)[None]", "offsets", SFT,
             "the response starts one column late: its first token is not counted"),
    mutation("sft.response_logprobs.padding-counted", "sft", "is_response = (pos >= start) & mask[:, 1:].bool()",
             "is_response = pos >= start", "padding", SFT, "padding after a short response is counted as response"),
    # ------------------------------------------------------------------------------------------------- reward model
    mutation("reward_model.forward.last-by-count", "reward_model",
             "last = (attention_mask.bool() * torch.arange(1, T + 1, device=ids.device)).argmax(-1)",
             "last = attention_mask.sum(-1) - 1", "padding", REWARD,
             "the last real token is found by counting: right for right padding only"),
    mutation("reward_model.forward.arange-from-zero", "reward_model", "torch.arange(1, T + 1, device=ids.device)",
             "torch.arange(0, T, device=ids.device)", "offsets", REWARD,
             "positions counted from 0 when finding the last real token",
             equivalent="argmax of mask * [0 .. T-1] is still the last real column: the values strictly increase "
                        "along the real tokens, and the only tie (all zeros, when the one real token sits at column 0 "
                        "or the row has none) resolves to the first index, 0, which is what [1 .. T] gives too "
                        "(torch.argmax returns the first maximal index; checked on every mask of width <= 8)"),
    mutation("reward_model.forward.trunk-without-mask", "reward_model", "h = self.gpt.trunk(ids, attention_mask)",
             "h = self.gpt.trunk(ids)", "padding", REWARD, "the reward model reads padded rows without their mask"),
    mutation("reward_model.bradley_terry.sign", "reward_model",
             "return -F.logsigmoid(chosen_rewards - rejected_rewards).mean()",
             "return -F.logsigmoid(rejected_rewards - chosen_rewards).mean()", "signs", REWARD,
             "the loss prefers the rejected response"),
    mutation("reward_model.center.sign", "reward_model", "rm.head.bias -= mean", "rm.head.bias += mean", "signs",
             REWARD, "centring adds the mean instead of removing it"),
    mutation("reward_model.score_rows.order", "reward_model",
             "return by_length[torch.argsort(torch.tensor(order, device=device))]",
             "return by_length[torch.tensor(order, device=device)]", "offsets", REWARD,
             "length-sorted rewards put back with the permutation instead of its inverse"),
    mutation("reward_model.train.chosen-rejected-swapped", "reward_model",
             "r_c, r_r = r[: cfg.batch_size], r[cfg.batch_size:]",
             "r_r, r_c = r[: cfg.batch_size], r[cfg.batch_size:]", "signs", REWARD,
             "train_reward_model takes the rejected rows for the chosen ones"),
    # ------------------------------------------------------------------------------------------------- policy gradient
    mutation("policy_gradient.rloo.divide-by-k", "policy_gradient",
             "others = (r.sum(dim=1, keepdim=True) - r) / (k - 1)",
             "others = (r.sum(dim=1, keepdim=True) - r) / k", "scales", PG,
             "the leave-one-out baseline divides by k instead of k - 1"),
    mutation("policy_gradient.grpo.batch-std", "policy_gradient", "adv = adv / (r.std(dim=1, keepdim=True) + eps)",
             "adv = adv / (r.std() + eps)", "reductions", PG, "GRPO scales by the batch's std, not the group's"),
    mutation("policy_gradient.aggregate.sum-over-sequences", "policy_gradient",
             "return masked_sum(per_token, mask, dim=1).mean()", "return masked_sum(per_token, mask, dim=1).sum()",
             "reductions", PG, "aggregate('sum') sums over sequences instead of averaging them"),
    mutation("policy_gradient.masked_whiten.var-over-padding", "policy_gradient",
             "var = masked_mean((x - mean) ** 2, mask)", "var = ((x - mean) ** 2).mean()", "padding", PG,
             "whitening's variance counts the padding"),
    mutation("policy_gradient.kl_k3.direction", "policy_gradient", "return torch.expm1(-d) + d",
             "return torch.expm1(d) - d", "signs", PG, "k3 estimates KL(ref || pi) instead of KL(pi || ref)"),
    mutation("policy_gradient.pg_loss.sign", "policy_gradient", "per_token = -advantages.detach().unsqueeze(1) * logp",
             "per_token = advantages.detach().unsqueeze(1) * logp", "signs", PG,
             "the surrogate is maximised: the policy moves away from rewarded samples"),
    mutation("policy_gradient.pg_loss.advantages-not-detached", "policy_gradient",
             "per_token = -advantages.detach().unsqueeze(1) * logp", "per_token = -advantages.unsqueeze(1) * logp",
             "detach", PG, "gradients flow into the advantages (they must be constants)"),
    mutation("policy_gradient.clipped.old-not-detached", "policy_gradient",
             "ratio = torch.exp(logp - old_logp.detach())",
             "ratio = torch.exp(logp - old_logp)", "detach", PG,
             "gradients flow through the old log-probs of the clipped ratio"),
    mutation("policy_gradient.pg_update.old-logp-not-detached", "policy_gradient", "old_logp = logp.detach()",
             "old_logp = logp", "detach", PG, "pg_update keeps the graph on the old log-probs",
             equivalent="every use of old_logp in pg_update is already cut from the graph elsewhere: "
                        "clipped_policy_loss detaches old_logp, the advantages built from the KL-adjusted score are "
                        "detached by policy_gradient_loss and clipped_policy_loss, and the metrics call .item(); the "
                        "losses and gradients are identical (checked: every ALGOS update gives bit-identical weights "
                        "with and without the edit)"),
    mutation("policy_gradient.pg_update.kl-penalty-sign", "policy_gradient",
             "score = ro.rewards - cfg.beta * seq_kl if", "score = ro.rewards + cfg.beta * seq_kl if", "signs", PG,
             "the KL to the reference is added to the reward (kl_in='reward') instead of subtracted"),
    mutation("policy_gradient.pg_update.kl-loss-detached", "policy_gradient",
             "loss = loss + cfg.beta * aggregate(kl_k3(logp, ro.ref_logp) * mask",
             "loss = loss + cfg.beta * aggregate(kl_k3(logp.detach(), ro.ref_logp) * mask", "detach", PG,
             "the k3 penalty in the loss (kl_in='loss', GRPO) sends no gradient"),
    mutation("policy_gradient.pg_update.no-temperature", "policy_gradient",
             "logp = sequence_logprobs(policy, ro.sequences, ro.attention_mask, ro.temperature) * mask  # (B, T-1)",
             "logp = sequence_logprobs(policy, ro.sequences, ro.attention_mask) * mask  # (B, T-1)", "scales", PG,
             "pg_update scores the samples at temperature 1 whatever they were sampled at"),
    mutation("policy_gradient.rollout.ref-no-temperature", "policy_gradient",
             "ref_logp = sequence_logprobs(reference, gen.sequences, gen.attention_mask, temperature) * mask",
             "ref_logp = sequence_logprobs(reference, gen.sequences, gen.attention_mask) * mask", "scales", PG,
             "the reference's log-probs ignore the sampling temperature"),
    mutation("policy_gradient.rollout.mask-unshifted", "policy_gradient", "mask = gen.completion_mask[:, 1:]",
             "mask = gen.completion_mask[:, :-1]", "shifts", PG,
             "the rollout's mask is not shifted to the log-prob columns"),
    mutation("policy_gradient.rollout.eos-penalty-sign", "policy_gradient",
             "rewards = rewards - missing_eos_penalty * (~ended).float()",
             "rewards = rewards + missing_eos_penalty * (~ended).float()", "signs", PG,
             "a completion cut off before its EOS gains the penalty"),
    # ------------------------------------------------------------------------------------------------- ppo
    mutation("ppo.gae.value-not-masked", "ppo", "next_value = values[:, t] * mask[:, t]", "next_value = values[:, t]",
             "masks", PPO, "GAE bootstraps from the value of padding after the episode ended"),
    mutation("ppo.gae.no-gamma-in-trace", "ppo", "next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]",
             "next_advantage = (delta + lam * next_advantage) * mask[:, t]", "scales", PPO,
             "the GAE trace decays by lambda only, not gamma * lambda"),
    mutation("ppo.per_token_rewards.kl-sign", "ppo", "rewards = -kl_coef * (logp - ref_logp) * mask.to(logp.dtype)",
             "rewards = kl_coef * (logp - ref_logp) * mask.to(logp.dtype)", "signs", PPO,
             "the per-token KL is a bonus, not a penalty"),
    mutation("ppo.last_token_index.from-one", "ppo",
             "positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)",
             "positions = torch.arange(1, mask.size(1) + 1, device=mask.device).expand_as(mask)", "offsets", PPO,
             "the score lands one column after the last real token"),
    mutation("ppo.kl_controller.sign", "ppo", "self.value *= 1 + error * n_steps / self.horizon",
             "self.value *= 1 - error * n_steps / self.horizon", "schedules", PPO,
             "the adaptive KL coefficient falls when the KL is too high"),
    mutation("ppo.kl_controller.one-sample", "ppo", 'kl_ctl.update(metrics["objective/kl"], B)',
             'kl_ctl.update(metrics["objective/kl"], 1)', "schedules", PPO,
             "the KL controller is told one sample per batch instead of B"),
    mutation("ppo.values-unshifted", "ppo", "return logp, values[:, :-1], entropy",
             "return logp, values[:, 1:], entropy", "shifts", PPO,
             "the value of column t is read after the action, not before"),
    mutation("ppo.logprobs.no-temperature", "ppo", "logits = logits[:, :-1].float() / temperature",
             "logits = logits[:, :-1].float()", "scales", PPO, "PPO's log-probs ignore the sampling temperature"),
    mutation("ppo.policy-mask-dropped", "ppo", "mask = None if bool(attention_mask.all()) else attention_mask",
             "mask = None", "padding", PPO, "the policy reads left-padded rollouts without their mask"),
    mutation("ppo.old-logp-unmasked", "ppo",
             "old_logp[rows], old_values[rows] = logp * mask[rows], values * mask[rows]",
             "old_logp[rows], old_values[rows] = logp, values", "masks", PPO,
             "the old log-probs and values keep their values off the completion mask"),
    mutation("ppo.whiten-over-padding", "ppo", "advantages = masked_whiten(advantages, mask)",
             "advantages = masked_whiten(advantages, torch.ones_like(mask))", "padding", PPO,
             "advantages are whitened over prompt and padding columns too"),
    mutation("ppo.entropy-never-differentiable", "ppo", "z = logits if entropy_grad else logits.detach()",
             "z = logits.detach()", "detach", PPO, "the entropy bonus (ent_coef > 0) sends no gradient"),
    mutation("ppo.value-loss-summed", "ppo",
             "loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask)",
             "loss = 0.5 * masked_sum(torch.maximum(unclipped_error, clipped_error), mask)", "reductions", PPO,
             "the value loss sums over tokens instead of averaging"),
    # ------------------------------------------------------------------------------------------------- dpo
    mutation("dpo.loss.reference-not-detached", "dpo", "chosen_ratio = policy_chosen_logps - ref_chosen_logps.detach()",
             "chosen_ratio = policy_chosen_logps - ref_chosen_logps", "detach", DPO,
             "gradients flow into the reference's chosen log-probs"),
    mutation("dpo.loss.margin-sign", "dpo", "h = chosen_ratio - rejected_ratio", "h = rejected_ratio - chosen_ratio",
             "signs", DPO, "the margin prefers the rejected response"),
    mutation("dpo.loss.ipo-target", "dpo", "losses = (h - 1 / (2 * beta)) ** 2", "losses = (h - 1 / beta) ** 2",
             "scales", DPO, "IPO's target margin is 1/beta instead of 1/(2 beta)"),
    mutation("dpo.preference_batch.completion-start", "dpo",
             "completion = ((position >= start) & mask[:, 1:].bool()).long()",
             "completion = ((position > start) & mask[:, 1:].bool()).long()", "offsets", DPO,
             "the response's first token is left out of the completion mask"),
    mutation("dpo.preference_batch.padding-shift", "dpo", "& mask[:, 1:].bool()).long()",
             "& mask[:, :-1].bool()).long()",
             "padding", DPO, "the completion mask reads the attention mask one column early"),
    mutation("dpo.reference_logps.order", "dpo",
             "out[rows] = torch.stack(frozen_logps(reference, *batch), dim=1).cpu()",
             "out[i:i + len(rows)] = torch.stack(frozen_logps(reference, *batch), dim=1).cpu()", "offsets", DPO,
             "cached reference log-probs stay in length order, not the pairs' order"),
    mutation("dpo.step.summed-loss", "dpo", "losses.mean().backward()", "losses.sum().backward()", "reductions", DPO,
             "dpo_step backpropagates the sum of the pair losses, not their mean"),
    # ------------------------------------------------------------------------------------------------- arena
    mutation("arena.keep_top.lowest", "arena", "order = torch.argsort(-scores.double(), dim=1, stable=True)[:, :keep]",
             "order = torch.argsort(scores.double(), dim=1, stable=True)[:, :keep]", "signs", ARENA,
             "RFT keeps the lowest-scored samples"),
    mutation("arena.best_of_n_weights.rank-offset", "arena", "math.comb(i - 1, n - 1) / math.comb(m, n)",
             "math.comb(i, n - 1) / math.comb(m, n)", "offsets", ARENA,
             "best-of-N weights count subsets with the rank itself included"),
    mutation("arena.curve.se-without-sqrt", "arena", "(g.std() / math.sqrt(g.numel())).item()",
             "(g.std() / g.numel()).item()", "scales", ARENA, "the standard error divides by N, not sqrt(N)"),
    mutation("arena.rft.trains-on-prompt", "arena",
             "x, y = sft_collate([examples[i] for i in order[start:start + cfg.batch_size]], tok.pad_id)",
             "x, y = sft_collate([examples[i] for i in order[start:start + cfg.batch_size]], tok.pad_id, True)",
             "masks", ARENA, "RFT fine-tunes on the prompt tokens too"),
    mutation("arena.rft.unusable-ranked", "arena", "torch.where(usable, scores, torch.full_like(scores, -math.inf))",
             "scores", "masks", ARENA, "a cut-off sample can take a kept slot (and is then dropped)"),
]


# ----------------------------------------------------------------------------------------------------- the study


@dataclass
class Result:
    id: str
    module: str
    category: str
    description: str
    tests: list[str]
    line_number: int
    line_before: str
    line_after: str
    outcome: str  # "caught", "survived" or "timeout"
    seconds: float
    returncode: int | None
    caught_by: str  # the first FAILED/ERROR line of pytest's summary, if any
    equivalent: str | None


def line_of(text: str, old: str, new: str) -> tuple[int, str, str]:
    """The 1-based number of the line holding `old`, that line, and the line once `old` is replaced by `new`."""
    at = text.index(old)
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    end = len(text) if end == -1 else end
    line = text[start:end]
    return text.count("\n", 0, at) + 1, line, line.replace(old, new, 1)


def check_catalogue(mutations: list[Mutation], root: Path) -> list[str]:
    """Every problem with the catalogue against the files under `root` (empty: fine)."""
    problems, seen = [], set()
    for m in mutations:
        if m.id in seen:
            problems.append(f"{m.id}: duplicate id")
        seen.add(m.id)
        if m.category not in CATEGORIES:
            problems.append(f"{m.id}: unknown category {m.category!r}")
        if "\n" in m.old or "\n" in m.new or m.old == m.new or not m.old:
            problems.append(f"{m.id}: old and new must be different single lines")
        for t in m.tests:
            if not (root / t).is_file():
                problems.append(f"{m.id}: no test file {t}")
        path = root / m.module
        if not path.is_file():
            problems.append(f"{m.id}: no module {m.module}")
            continue
        n = path.read_text(encoding="utf-8").count(m.old)
        if n != 1:
            problems.append(f"{m.id}: the old text occurs {n} times in {m.module} (must be exactly once): {m.old!r}")
    return problems


def make_copy(source: Path, into: Path) -> Path:
    """A throwaway repository with what the tests need, without bytecode caches."""
    into.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in COPIED:
        src = source / name
        if src.is_dir():
            shutil.copytree(src, into / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, into / name)
    return into


def pytest_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(copy), PYTHONHASHSEED="0",
               # no .pyc: a mutated and a restored module can share size and mtime second, and a stale cache would
               # run the wrong code
               PYTHONDONTWRITEBYTECODE="1", LLMFS_RUNS_DIR=str(copy / "runs"), MPLBACKEND="Agg")
    env.pop("LLMFS_QUICK", None)
    return env


def run_pytest(copy: Path, tests: list[str], timeout: float) -> tuple[str, int | None, float, str]:
    """Run the tests in the copy: (outcome "passed" / "failed" / "timeout", exit code, seconds, output)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", *tests]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=copy, env=pytest_env(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: pytest and anything it started
        out, _ = proc.communicate()
        return "timeout", None, time.perf_counter() - t0, out
    return ("passed" if proc.returncode == 0 else "failed"), proc.returncode, time.perf_counter() - t0, out


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if re.match(r"^(FAILED|ERROR) ", line):
            return line.strip()
    return ""


def run_mutation(m: Mutation, copies: queue.Queue, pristine: dict[str, str], timeout: float) -> Result:
    copy = copies.get()
    path = copy / m.module
    original = pristine[m.module]
    number, before, after = line_of(original, m.old, m.new)
    try:
        path.write_text(original.replace(m.old, m.new, 1), encoding="utf-8")
        status, code, seconds, out = run_pytest(copy, list(m.tests), timeout)
    finally:
        path.write_text(original, encoding="utf-8")
        copies.put(copy)
    outcome = {"passed": "survived", "failed": "caught", "timeout": "timeout"}[status]
    return Result(m.id, m.module, m.category, m.description, list(m.tests), number, before, after, outcome,
                  round(seconds, 2), code, first_failure(out), m.equivalent)


def print_catalogue(mutations: list[Mutation], root: Path) -> None:
    for m in mutations:
        text = (root / m.module).read_text(encoding="utf-8")
        where = ""
        if text.count(m.old) == 1:
            number, before, after = line_of(text, m.old, m.new)
            where = f"{m.module}:{number}\n    - {before.strip()}\n    + {after.strip()}"
        else:
            where = f"{m.module}: OLD TEXT NOT FOUND EXACTLY ONCE"
        note = f"\n    equivalent: {m.equivalent}" if m.equivalent else ""
        print(f"{m.id}  [{m.category}]  {m.description}\n    {where}\n    tests: {' '.join(m.tests)}{note}")
    counts = {c: sum(m.category == c for m in mutations) for c in CATEGORIES}
    print(f"\n{len(mutations)} mutations: " + ", ".join(f"{c} {n}" for c, n in counts.items() if n))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--only", metavar="SUBSTRING", help="only the mutations whose id or description contain it")
    parser.add_argument("--jobs", type=int, default=1,
                        help="mutations tested at once, each in its own copy (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run (default 600)")
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON")
    args = parser.parse_args()

    mutations = CATALOGUE
    if args.only:
        key = args.only.lower()
        mutations = [m for m in CATALOGUE if key in m.id.lower() or key in m.description.lower()]
        if not mutations:
            print(f"no mutation matches {args.only!r}", file=sys.stderr)
            return 2
    if args.list:
        print_catalogue(mutations, REPO)
        return 0
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    t_start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="mutation_study_"))
    try:
        first = make_copy(REPO, workdir / "copy0")
        problems = check_catalogue(mutations, first)
        if problems:
            print("the catalogue does not fit the library; fix these first:", *problems, sep="\n  ", file=sys.stderr)
            return 2
        pristine = {m.module: (first / m.module).read_text(encoding="utf-8") for m in mutations}

        # the copy, not the working tree, must be what the tests import
        probe = subprocess.run([sys.executable, "-c", "import llm_from_scratch; print(llm_from_scratch.__file__)"],
                               cwd=first, env=pytest_env(first), capture_output=True, text=True, check=False)
        if Path(probe.stdout.strip()).resolve().parent != (first / "llm_from_scratch").resolve():
            print(f"the tests would import llm_from_scratch from {probe.stdout.strip() or probe.stderr}, not the copy",
                  file=sys.stderr)
            return 2

        tests = sorted({t for m in mutations for t in m.tests})
        print(f"baseline: {len(tests)} test files, unmutated, in {first}", flush=True)
        status, code, seconds, out = run_pytest(first, tests, args.timeout)
        if status != "passed":
            print(out[-6000:], file=sys.stderr)
            print(f"the baseline is not green ({status}, exit code {code}): fix the tests before a mutation study",
                  file=sys.stderr)
            return 1
        print(f"baseline green in {seconds:.0f} s; {len(mutations)} mutations, {args.jobs} at a time", flush=True)

        copies: queue.Queue = queue.Queue()
        copies.put(first)
        for j in range(1, args.jobs):
            copies.put(make_copy(first, workdir / f"copy{j}"))

        results: list[Result] = []
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_mutation, m, copies, pristine, args.timeout) for m in mutations]
            for future in as_completed(futures):
                r = future.result()
                results.append(r)
                print(f"[{len(results):3d}/{len(mutations)}] {r.outcome:8s} {r.id:58s} {r.seconds:6.1f} s"
                      + (f"  {r.caught_by[:90]}" if r.caught_by else ""), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    order = {m.id: i for i, m in enumerate(CATALOGUE)}
    results.sort(key=lambda r: order[r.id])
    elapsed = time.perf_counter() - t_start
    caught = sum(r.outcome != "survived" for r in results)
    timeouts = sum(r.outcome == "timeout" for r in results)
    survivors = [r for r in results if r.outcome == "survived"]
    equivalent = [r for r in survivors if r.equivalent]
    total = len(results)

    print(f"\nmutation score: {caught} / {total} caught ({100 * caught / total:.1f}%)"
          + (f", of which {timeouts} by timeout" if timeouts else ""))
    if equivalent:
        print(f"  without the {len(equivalent)} equivalent mutations: {caught} / {total - len(equivalent)} "
              f"({100 * caught / max(1, total - len(equivalent)):.1f}%)")
    print(f"time: {elapsed / 60:.1f} min")
    for c in CATEGORIES:
        mine = [r for r in results if r.category == c]
        if mine:
            print(f"  {c:11s} {sum(r.outcome != 'survived' for r in mine):3d} / {len(mine)}")
    if survivors:
        print(f"\n{len(survivors)} survivors:")
    for r in survivors:
        print(f"\n{r.id}  [{r.category}]  {r.module}:{r.line_number}\n  {r.description}\n"
              f"  - {r.line_before.strip()}\n  + {r.line_after.strip()}")
        print(f"  equivalent: {r.equivalent}" if r.equivalent else "  NOT EQUIVALENT: a missing test")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "caught": caught, "total": total, "timeouts": timeouts, "score": caught / total,
            "equivalent_survivors": len(equivalent), "seconds": round(elapsed, 1), "jobs": args.jobs,
            "results": [asdict(r) for r in results]}, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
