import math

import pytest
import torch

from llm_from_scratch.attention import CausalSelfAttention, KVCache, causal_mask, explicit_attention


@pytest.mark.grades("attention.explicit_attention")
def test_explicit_attention_by_hand():
    # one head, head size 1: q = 1 everywhere, keys 0 and ln 3, values 4 and 8.
    # query 0 sees only key 0 -> 4. query 1: scores (0, ln 3) -> weights (1/4, 3/4) -> 0.25*4 + 0.75*8 = 7
    q = torch.ones(1, 1, 2, 1)
    k = torch.tensor([0.0, math.log(3)]).view(1, 1, 2, 1)
    v = torch.tensor([4.0, 8.0]).view(1, 1, 2, 1)
    y, w = explicit_attention(q, k, v, mask=None)
    assert y.flatten().tolist() == pytest.approx([4.0, 7.0])
    assert w[0, 0].flatten().tolist() == pytest.approx([1.0, 0.0, 0.25, 0.75])


@pytest.mark.grades("attention.causal_mask")
def test_causal_mask_with_cached_positions():
    # 2 new tokens after 3 cached ones: they sit at positions 3 and 4
    assert causal_mask(2, 5).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


@pytest.mark.grades("attention.explicit_attention", "attention.CausalSelfAttention.forward")
@pytest.mark.parametrize("with_mask", [False, True])
def test_explicit_and_sdpa_agree(with_mask):
    torch.manual_seed(0)
    a = CausalSelfAttention(64, 4, attn_impl="explicit").eval()
    b = CausalSelfAttention(64, 4, attn_impl="sdpa").eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 10, 64)
    mask = None
    if with_mask:  # random key masks, each query always sees itself
        keep = torch.rand(3, 1, 10, 10) > 0.3
        mask = (causal_mask(10, 10) & keep) | torch.eye(10, dtype=torch.bool)
    assert torch.allclose(a(x, mask), b(x, mask), atol=1e-5)


@pytest.mark.grades("attention.CausalSelfAttention.forward")
def test_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 2).eval()
    x = torch.randn(1, 8, 32)
    y1 = attn(x)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(1, 3, 32)
    assert torch.allclose(attn(x2)[:, :5], y1[:, :5], atol=1e-6)


@pytest.mark.grades("attention.CausalSelfAttention.forward", "attention.KVCache.update")
@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_kv_cache_decoding_matches_full_attention(impl):
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, attn_impl=impl).eval()
    x = torch.randn(2, 9, 32)
    full = attn(x)
    cache = KVCache(n_layer=1, batch_size=2, n_head=4, max_len=9, head_dim=8)
    outs = [attn(x[:, :4], kv_cache=cache)]
    cache.advance(4)
    for t in range(4, 9):
        outs.append(attn(x[:, t:t + 1], kv_cache=cache))
        cache.advance(1)
    assert torch.allclose(torch.cat(outs, dim=1), full, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        attn(x[:, :1], kv_cache=cache)


def test_bad_config():
    with pytest.raises(ValueError, match="divisible"):
        CausalSelfAttention(30, 4)
    with pytest.raises(ValueError, match="attn_impl"):
        CausalSelfAttention(32, 4, attn_impl="flash")


@pytest.mark.grades("attention.CausalSelfAttention.forward", "attention.explicit_attention")
@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_multi_head_attention_matches_a_loop_over_heads(impl):
    """The layer against the formula, one head at a time in float64:
    y_h = softmax(q_h k_h^T / sqrt(D), causal) v_h, out = [y_1 | ... | y_H] W_proj^T + b_proj."""
    torch.manual_seed(0)
    C, H, T = 24, 3, 7
    D = C // H
    layer = CausalSelfAttention(C, H, attn_impl=impl).eval()
    with torch.no_grad():
        layer.c_attn.bias.normal_()
        layer.c_proj.bias.normal_()
    x = torch.randn(2, T, C)
    W, b = layer.c_attn.weight.double(), layer.c_attn.bias.double()
    qkv = x.double() @ W.T + b  # (B, T, 3C)
    heads = []
    for h in range(H):
        q, k, v = (qkv[..., part * C + h * D: part * C + (h + 1) * D] for part in range(3))  # (B, T, D) each
        s = q @ k.transpose(1, 2) / math.sqrt(D)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(s.softmax(-1) @ v)
    expected = torch.cat(heads, -1) @ layer.c_proj.weight.double().T + layer.c_proj.bias.double()
    error = (layer(x).double() - expected).abs().max().item()
    assert error < 1e-5, f"the output differs from the formula, head by head, by up to {error:.2e}"


@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_a_chunk_of_new_tokens_after_a_cache_sees_the_past_but_not_its_own_future(impl):
    # prefill 4 positions, then feed the next 3 as one chunk with no mask: the layer must build the causal mask of
    # the chunk against all 7 keys itself (the 3 new queries sit at positions 4, 5, 6)
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, attn_impl=impl).eval()
    x = torch.randn(2, 7, 32)
    cache = KVCache(n_layer=1, batch_size=2, n_head=4, max_len=7, head_dim=8)
    first = attn(x[:, :4], kv_cache=cache)
    cache.advance(4)
    chunk = attn(x[:, 4:], kv_cache=cache)
    assert torch.allclose(torch.cat([first, chunk], dim=1), attn(x), atol=1e-5)
