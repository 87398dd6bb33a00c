"""Causal multi-head self-attention, written out, with a fused fast path and a KV cache.

For each head h, with queries, keys and values Q_h = X W_q, K_h = X W_k, V_h = X W_v (head size d):

    Attention(Q, K, V) = softmax( Q K^T / sqrt(d) + M ) V

where M[i, j] = 0 if token i may look at token j and -inf otherwise. "Causal" means j <= i: a token
never sees the future, so one forward pass trains every position to predict its next token. The
heads' outputs are concatenated and mixed by an output projection.

Two implementations compute the same function:
  * attn_impl="explicit": the formula above, step by step (for reading, and for attention weights);
  * attn_impl="sdpa": torch.nn.functional.scaled_dot_product_attention, one fused kernel that never
    materialises the (T, T) score matrix when it can avoid it (flash / memory-efficient attention).

Masks. `mask` is None for the plain causal case (no padding, no cache). Otherwise it is a boolean
tensor (B or 1, 1, T, S), True where query i may attend to key j; the model builds it from the
causal rule, the attention mask of left-padded batches, and the number of cached positions.

KV cache. When generating, the keys and values of earlier tokens never change. `KVCache` keeps them
in tensors allocated once for the whole generation; each step writes only the new token's k and v
and attends over everything stored so far: O(T) work per new token instead of O(T^2).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ATTN_IMPLS = ("explicit", "sdpa")


class KVCache:
    """Keys and values of every layer, preallocated: k, v of shape (n_layer, B, n_head, max_len, head_dim)."""

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0  # positions filled so far (the same for every layer once a forward pass ends)

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values (B, H, T, D) after the cached ones; return all of them (B, H, length+T, D)."""
        end = self.length + k_new.size(2)
        if end > self.max_len:
            raise ValueError(f"KVCache: {end} positions do not fit in a cache of {self.max_len}")
        self.k[layer, :, :, self.length:end] = k_new
        self.v[layer, :, :, self.length:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Called once per forward pass, after every layer has stored its n new positions."""
        self.length += n


def causal_mask(T: int, S: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, S) booleans: the T newest of S positions, query i (absolute position S - T + i) sees keys 0..S-T+i."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       dropout: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d) + M) v, step by step. q: (B, H, T, D), k, v: (B, H, S, D).

    Returns the output (B, H, T, D) and the attention weights (B, H, T, S), each row summing to 1.
    """
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, S)
    if mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)  # (B, H, T, S)
    if dropout is not None:
        weights = dropout(weights)
    return weights @ v, weights  # (B, H, T, D), (B, H, T, S)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True,
                 attn_impl: str = "sdpa", layer_idx: int = 0):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r}: choose one of {ATTN_IMPLS}")
        self.n_head, self.n_embd, self.head_dim = n_head, n_embd, n_embd // n_head
        self.attn_impl, self.layer_idx, self.dropout = attn_impl, layer_idx, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # queries, keys, values of all heads at once
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)  # mixes the heads' outputs
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). [q | k | v] = x W_attn + b, split into H heads of size D = C / H;
        head h: y_h = softmax(q_h k_h^T / sqrt(D) + M) v_h (M: 0 where a query may look, -inf where not: the
        causal mask, or `mask` (B or 1, H or 1, T, S) of booleans, True = may look); out = [y_1 | ... | y_H] W_proj + b.
        kv_cache: the keys and values of S - T earlier positions; the new ones are stored after them."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H, S, D), S = cached + T
        if self.attn_impl == "explicit":
            y, _ = explicit_attention(q, k, v, mask, self.attn_dropout)
        else:
            S = k.size(2)
            if mask is None and T > 1 and S != T:  # new tokens after cached ones: they see all of the past
                mask = causal_mask(T, S, q.device)
            # is_causal: the fast path for T tokens with nothing cached; one newest query sees every key: no mask
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                is_causal=mask is None and S == T
            )  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        return self.resid_dropout(self.c_proj(y))
