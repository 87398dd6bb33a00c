"""GPT: the GPT-2 architecture, in one file.

    x_0 = E[tokens] + P[positions]                       token + learned position embeddings, (B, T, C)
    for each of n_layer blocks (pre-LayerNorm residual):
        x = x + Attention(LayerNorm(x))                  tokens exchange information (causally)
        x = x + MLP(LayerNorm(x))                        each token thinks alone: C -> 4C -> GELU -> C
    logits = LayerNorm(x) E^T                            the LM head is tied to the token embedding E

Initialisation follows GPT-2: weights ~ N(0, 0.02), biases 0, and the two projections that write into
the residual stream (attention and MLP outputs) ~ N(0, 0.02 / sqrt(2 n_layer)), so the residual
stream's variance does not grow with depth.

Padding: in a left-padded batch, position ids follow the attention mask (the first real token of
every row is position 0), and no token attends to padding, so a padded row computes exactly the
logits of the same row alone.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from llm_from_scratch.attention import ATTN_IMPLS, CausalSelfAttention, KVCache, causal_mask

PRESETS = {
    # trains on a 2-core CPU in minutes (about 0.9M parameters with the course's 768-token vocabulary)
    "tiny": dict(context_length=256, n_layer=4, n_head=4, n_embd=128),
    # about 10M parameters: a GPU, or a patient CPU
    "small": dict(context_length=256, n_layer=6, n_head=6, n_embd=384),
    # OpenAI's GPT-2 shapes, for GPU users (trained from scratch here: loading OpenAI's weights is not written yet)
    "gpt2-124m": dict(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50257, context_length=1024, n_layer=24, n_head=16, n_embd=1024),
}


@dataclass
class GPTConfig:
    vocab_size: int
    context_length: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    attn_impl: str = "sdpa"  # "explicit" computes the same thing step by step

    def __post_init__(self):
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"GPTConfig.attn_impl={self.attn_impl!r}: choose one of {ATTN_IMPLS}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named size ("tiny", "small", "gpt2-124m", "gpt2-medium"); `vocab_size` etc. as keyword overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}: choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, config.dropout, config.bias, config.attn_impl,
                                        layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """GPT-2's pre-norm residual block, (B, T, C) -> (B, T, C):
        x = x + attn(LN_1(x)), then x = x + MLP(LN_2(x)): each sublayer reads a normalised copy and adds to the
        stream."""
        x = x + self.attn(self.ln_1(x), mask, kv_cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings E
        self.wpe = nn.Embedding(config.context_length, config.n_embd)  # position embeddings P
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one matrix embeds tokens and scores them
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # projections into the residual stream
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab); logits at t score token t+1.

        attention_mask (B, S): 1 for real tokens, 0 for padding, over the cached positions AND the new
        ones (S = kv_cache.length + T). kv_cache: keys/values of earlier positions; updated in place.
        """
        return self.lm_head(self.trunk(idx, attention_mask, kv_cache))  # (B, T, vocab)

    def trunk(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None,
              kv_cache: KVCache | None = None) -> torch.Tensor:
        """Everything but the LM head: the final hidden states (B, T, C), after the last LayerNorm.
        Reward and value heads (chapters 6 and 8) read these."""
        B, T = idx.shape
        past = kv_cache.length if kv_cache is not None else 0
        S = past + T
        if S > self.config.context_length:
            raise ValueError(f"sequence of {S} tokens is longer than the context ({self.config.context_length} tokens)")
        if attention_mask is None:
            pos = torch.arange(past, S, device=idx.device).unsqueeze(0)  # (1, T)
            # None: the fast causal path (or, for one new token after a cache, nothing to hide)
            mask = None if past == 0 or T == 1 else causal_mask(T, S, idx.device)
        else:
            if attention_mask.shape != (B, S):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                                 f"expected (B, cached + new) = {(B, S)}")
            keep = attention_mask.bool()  # (B, S)
            pos = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, T): real tokens count from 0
            mask = causal_mask(T, S, idx.device) & keep[:, None, :]  # (B, T, S): causal, and never a pad key
            mask = mask | _self_mask(T, S, idx.device)  # a padding query sees itself, so its softmax stays finite
            mask = mask[:, None]  # (B, 1, T, S), broadcast over heads

        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.ln_f(x)  # (B, T, C)

    # --- bookkeeping
    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters (the tied head counted once); non_embedding drops the token and position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward), as in the PaLM paper's appendix:
        6 N for the matrix multiplies with the N non-embedding weights plus the LM head, and
        12 L C T for attention's scores and weighted sums (T = sequence length)."""
        c = self.config
        T = seq_len or c.context_length
        n_matmul = self.num_params(non_embedding=True) + c.vocab_size * c.n_embd  # + the (tied) LM head
        return 6 * n_matmul + 12 * c.n_layer * c.n_embd * T

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        p = self.wte.weight
        return KVCache(c.n_layer, batch_size, c.n_head, max_len or c.context_length, c.n_embd // c.n_head,
                       device=p.device, dtype=dtype or p.dtype)


def _self_mask(T: int, S: int, device) -> torch.Tensor:
    """(T, S) booleans, True where query i meets its own key (position S - T + i).

    Or-ed into the mask so that even a padding query sees one key: its softmax stays finite
    (its output is never used), and no NaN can leak into the real tokens."""
    return torch.eye(T, S, dtype=torch.bool, device=device).roll(S - T, dims=1)


@contextlib.contextmanager
def eval_mode(*models: nn.Module):
    """Dropout off inside the block; each model's own mode (train or eval) is restored after, even on an error."""
    was_training = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        yield
    finally:
        for m, mode in zip(models, was_training):
            m.train(mode)
