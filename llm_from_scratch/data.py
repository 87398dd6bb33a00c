"""Turning token streams into training batches.

Language modelling is next-token prediction: from a window of T+1 consecutive tokens
w_0 .. w_T we take the input x = w_0 .. w_{T-1} and the targets y = w_1 .. w_T, so the
logits at position t are scored against token t+1. `TokenWindowDataset` cuts a long
token stream into such windows, `stride` tokens apart (stride = T: no overlap, every
token is a target once; a smaller stride gives overlapping windows and more of them).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from llm_from_scratch.course import REPO_ROOT, quick_mode, runs_root
from llm_from_scratch.tokenizer import pad_right


class TokenWindowDataset(Dataset):
    """Windows of `context_length + 1` tokens from one long stream, `stride` tokens apart."""

    def __init__(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, context_length: int,
                 stride: int | None = None):
        if context_length < 1:
            raise ValueError(f"TokenWindowDataset: context_length must be ≥ 1, got {context_length}")
        stride = context_length if stride is None else stride
        if stride < 1:
            raise ValueError(f"TokenWindowDataset: stride must be ≥ 1, got {stride}")
        self.tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)  # (N,)
        if self.tokens.ndim != 1:
            raise ValueError(f"TokenWindowDataset: expected a 1-D token stream, got shape {tuple(self.tokens.shape)}")
        if len(self.tokens) < context_length + 1:
            raise ValueError(
                f"TokenWindowDataset: {len(self.tokens)} tokens cannot fill one window of "
                f"context_length + 1 = {context_length + 1} tokens; use more text or a shorter context"
            )
        self.context_length = context_length
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.tokens) - (self.context_length + 1)) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window i (negative i counts from the end): the T+1 tokens w_0 .. w_T from position i · stride,
        returned as x = w_0 .. w_{T-1} and y = w_1 .. w_T, each (T,): y[t] is the token after x[t]."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = (i % len(self)) * self.stride
        window = self.tokens[start : start + self.context_length + 1]  # (T+1,)
        return window[:-1], window[1:]  # x (T,), y (T,)


def read_text(path: str | Path) -> str:
    """A UTF-8 corpus from disk (`--text PATH`), with errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--text: {path} does not exist or is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--text: {path} is not UTF-8 text (byte {err.start}: {err.reason})") from err
    if not text.strip():
        raise ValueError(f"--text: {path} is empty")
    return text


def python_stdlib_text(max_chars: int = 1_000_000) -> str:
    """Real English-and-code text that exists on every machine with Python: the standard library's own sources.

    The top-level `*.py` files of the stdlib, in sorted order, concatenated up to `max_chars` characters.
    Nobody on this project wrote it, so it is a fair test of a tokenizer trained elsewhere.
    """
    parts, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def tinyworld_dir(quick: bool | None = None) -> Path:
    """Where the tiny world's datasets live: `data/tinyworld/` for real runs, `<runs root>/data/` for quick ones
    (so a smoke run never replaces the real datasets)."""
    quick = quick_mode() if quick is None else quick
    return runs_root(quick) / "data" if quick else REPO_ROOT / "data" / "tinyworld"


class WindowSampler:
    """Random training windows, a fresh batch for every step: batch(step) -> x, y of shape (B, T).

    The windows of step s are drawn with a generator seeded by (seed, s), so any step's batch can be
    recomputed from the step number alone: a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, context_length: int, batch_size: int,
                 seed: int = 0):
        self.tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)  # (N,)
        if len(self.tokens) < context_length + 1:
            raise ValueError(f"WindowSampler: {len(self.tokens)} tokens cannot fill one window of {context_length + 1}")
        self.context_length, self.batch_size, self.seed = context_length, batch_size, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """B windows of T+1 consecutive tokens, each starting anywhere a whole window fits, drawn with a generator
        seeded by (seed, step): x = window[:, :-1], y = window[:, 1:], each (B, T)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.context_length, (self.batch_size,), generator=g)  # (B,)
        offsets = torch.arange(self.context_length + 1)  # (T+1,)
        windows = self.tokens[starts[:, None] + offsets]  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]


def document_windows(tokens: Sequence[int] | np.ndarray | torch.Tensor, eos_id: int, context_length: int,
                     batch_size: int, pad_id: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Validation batches of whole documents, each window starting at a document boundary.

    A random window starts mid-document: its first tokens have lost the context that fixed them, so no
    model can reach the document-level entropy floor on it. Here every window is one EOS (the boundary)
    followed by whole documents, each with its closing EOS, packed while they fit in context_length + 1
    tokens: x = window[:-1], y = window[1:], padded targets -100. Every document that fits a window is
    scored exactly once, every one of its tokens from its own start, so the mean loss is comparable with
    the floor Σ(−log p(doc)) / Σ(tokens + 1). Returns (batches, documents that did not fit and were left out).
    """
    stream = torch.as_tensor(np.asarray(tokens), dtype=torch.long).tolist()
    docs, start = [], 0
    for i, t in enumerate(stream):
        if t == eos_id:
            docs.append(stream[start:i + 1])  # the document and its EOS
            start = i + 1
    if start < len(stream):
        docs.append(stream[start:] + [eos_id])
    rows, row, skipped = [], [eos_id], 0
    for doc in docs:
        if 1 + len(doc) > context_length + 1:
            skipped += 1
            continue
        if len(row) + len(doc) > context_length + 1:
            rows.append(row)
            row = [eos_id]
        row = row + doc
    if len(row) > 1:
        rows.append(row)
    batches = []
    for k in range(0, len(rows), batch_size):
        ids, mask, _ = pad_right(rows[k:k + batch_size], pad_id)  # (B, T+1)
        x, y = ids[:, :-1], ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        batches.append((x, y))
    return batches, skipped


# ----------------------------------------------------------------------------- chat data (chapters 5 and 6)


def sft_collate(examples: list[tuple[list[int], int]], pad_id: int,
                train_on_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (token ids, prompt length) pairs into inputs x (B, T) and targets y (B, T).

    y[t] = ids[t + 1], the next token; it is -100 (no loss) where that token is padding or, unless
    `train_on_prompt`, part of the prompt: the model learns to answer, not to write questions.
    """
    T = max(len(ids) for ids, _ in examples) - 1
    x = torch.full((len(examples), T), pad_id, dtype=torch.long)
    y = torch.full((len(examples), T), -100, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(examples):
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = len(ids) - 1
        x[i, :n] = ids[:-1]
        y[i, :n] = ids[1:]
        if not train_on_prompt:
            y[i, : n_prompt - 1] = -100  # targets 1 .. n_prompt-1 are prompt tokens
    return x, y


def preference_collate(pairs: list[tuple[list[int], list[int]]],
                       pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen ids, rejected ids) pairs -> one right-padded batch of 2B rows, chosen first then rejected
    (one forward pass scores both): ids (2B, T), attention mask (2B, T), last real token index (2B,)."""
    return pad_right([c for c, _ in pairs] + [r for _, r in pairs], pad_id)
