import math
import sys
from pathlib import Path

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
    # float32: ln 3, exp, a 2-term sum, a divide and 2 products, each ≤ 6e-8 relative: ≲ 6e-7 < approx's rel 1e-6;
    # the one-key row (1.0) and the masked weight (0.0) are exact
    assert y.flatten().tolist() == pytest.approx([4.0, 7.0])
    assert w[0, 0].flatten().tolist() == pytest.approx([1.0, 0.0, 0.25, 0.75])


@pytest.mark.grades("attention.explicit_attention")
def test_one_query_against_four_keys_with_a_mask_by_hand():
    # chapter 2's worked example. Head size 4, so a score is q . k / 2 = the key's first coordinate: 0, ln 3, ln 4, 5.
    # The mask hides key 3 (the query's future): exp gives 1, 3, 4 -> weights 1/8, 3/8, 4/8, 0, and the output is
    # 1/8 (8, 0) + 3/8 (0, 8) + 1/2 (4, 4) = (3, 5)
    q = torch.tensor([2.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4)
    k = torch.tensor([[0.0, 1, 0, 0], [math.log(3), 0, 1, 0], [math.log(4), 0, 0, 1], [5, 0, 0, 0]]).view(1, 1, 4, 4)
    v = torch.tensor([[8.0, 0.0], [0.0, 8.0], [4.0, 4.0], [100.0, 100.0]]).view(1, 1, 4, 2)
    y, w = explicit_attention(q, k, v, mask=torch.tensor([True, True, True, False]).view(1, 1, 1, 4))
    # float32: each weight a few roundings (ln 3, ln 4, exp, a 3-term sum, a divide) ≲ 5·6e-8 ≈ 3e-7 off; y sums 3
    # products with values ≤ 8: ≲ 8 × that ≈ 2.4e-6 (the masked value 100 gets weight exactly 0)
    assert w.flatten().tolist() == pytest.approx([1 / 8, 3 / 8, 1 / 2, 0.0], abs=1e-6)
    assert y.flatten().tolist() == pytest.approx([3.0, 5.0], abs=1e-5)


@pytest.mark.grades("attention.explicit_attention", "attention.causal_mask")
def test_causal_weights_are_exactly_zero_on_the_future_and_sum_to_one():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    y, w = explicit_attention(q, k, v, mask=None)
    past_and_present = torch.ones(7, 7, dtype=torch.bool).tril()
    assert (w[..., ~past_and_present] == 0).all(), "a future key must get weight exactly 0, not a small one"
    assert (w[..., past_and_present] > 0).all(), "every key up to the query's own position takes part"
    # float32 rows of ≤ 7 weights in [0, 1]: the softmax's sum and divide, then this sum, ≲ 2·7·6e-8 ≈ 8e-7 off 1;
    # allclose adds its default rtol 1e-5 × |1|
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 7), atol=1e-6)
    # the reference's y is this very product (equal bit for bit); a student's einsum or loop sums the ≤ 7 products
    # w·v (|v| ≤ 3.2, so Σ|w v| ≤ 3.2) in another order: ≲ 7·6e-8·3.2 ≈ 1.4e-6 worst case, inside atol 1e-5
    assert torch.allclose(y, w @ v, atol=1e-5)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1], v2[:, :, -1] = torch.randn(2, 3, 8), torch.randn(2, 3, 8)  # another last token
    y2, _ = explicit_attention(q, k2, v2, mask=None)
    assert torch.equal(y2[:, :, :-1], y[:, :, :-1]), "a new last token changed an earlier output"
    assert not torch.allclose(y2[:, :, -1], y[:, :, -1])  # a new key and value move it by O(1), not by rounding


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
    # another order (sdpa's fused kernel): 16-term q·k, a softmax over ≤ 10 keys, then c_proj's 64-term sums with
    # |w| ≤ 1/8 on outputs ~1: ≲ 64·6e-8·Σ|w y| (≈ 2) ≈ 8e-6 worst case, ~1e-7 typical; allclose adds rtol 1e-5
    assert torch.allclose(a(x, mask), b(x, mask), atol=1e-5)


def test_explicit_and_sdpa_gpts_agree_on_a_left_padded_batch():
    # the same weights through a whole GPT, rows of 12, 7 and 3 real tokens padded on the left (the model builds the
    # padding mask from attention_mask); a padding query sees only itself, so every logit is finite and compared
    from llm_from_scratch.model import GPT, GPTConfig  # here: an assignment of attention.py alone needs no model.py

    torch.manual_seed(0)
    config = dict(vocab_size=64, context_length=16, n_layer=2, n_head=4, n_embd=32)
    explicit = GPT(GPTConfig(**config, attn_impl="explicit")).eval()
    fused = GPT(GPTConfig(**config, attn_impl="sdpa")).eval()
    fused.load_state_dict(explicit.state_dict())
    T = 12
    idx = torch.randint(0, 64, (3, T))
    attention_mask = torch.stack([torch.arange(T) >= T - m for m in (12, 7, 3)]).long()
    error = (explicit(idx, attention_mask) - fused(idx, attention_mask)).abs().max().item()
    # two attention orders through 2 layers of ≤ 128-term float32 sums; the head (std 0.02 rows) keeps logits ≲ 1:
    # ≲ 128·6e-8 ≈ 8e-6 relative worst case, ~1e-7 typical
    assert error < 1e-5, f"explicit and sdpa logits differ by up to {error:.2e}"


def test_the_hand_built_head_of_chapter_2_attends_to_the_previous_copy_of_its_token():
    # chapters/ch02_attention.py sets a head's weights by hand: each token attends to the latest earlier copy of
    # itself (itself when there is none) and its output copies that position's one-hot
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chapters"))
    try:
        import ch02_attention as ch02
    finally:
        sys.path.pop(0)
    ids = [5, 1, 7, 1, 5, 5, 2, 7, 1]
    expected = [max([j for j in range(i) if ids[j] == ids[i]], default=i) for i in range(len(ids))]
    assert expected == [0, 1, 2, 1, 0, 4, 6, 2, 3]
    head, x = ch02.duplicate_token_head(ids)
    with torch.no_grad():
        w = ch02.attention_weights(head, x)[0, 0]  # (T, T)
        y = head(x)[0]  # (T, C): [token part | position part]
    assert w.argmax(-1).tolist() == expected
    assert w[range(len(ids)), expected].min() > 0.99  # by design: rivals score ≥ 6 lower, weight ≥ 1 − e^-6 ≈ 0.9975
    assert y[:, len(set(ids)):].argmax(-1).tolist() == expected


@pytest.mark.grades("attention.CausalSelfAttention.forward")
def test_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 2).eval()
    x = torch.randn(1, 8, 32)
    y1 = attn(x)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(1, 3, 32)
    # exact: positions < 5 get the same q, k, v bit for bit, and the changed keys weigh exactly 0 (exp(-inf) = 0),
    # so the same float32 operations run on the same numbers
    assert torch.equal(attn(x2)[:, :5], y1[:, :5])


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
    # one row at a time against all 9 (another product shape: another order of c_attn's and c_proj's 32-term sums)
    # and ≤ 9 keys of 8 dims: ≲ 32·6e-8·Σ|x| (≈ 3) ≈ 6e-6 worst case on outputs ≲ 1; allclose adds rtol 1e-5
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
    # float32 against float64: c_attn's and c_proj's 24-term sums (Σ|x| ≲ 5 with the normal biases), a softmax over
    # ≤ 7 keys: ≲ 25·6e-8·5 ≈ 8e-6 worst case per sum, ~3e-7 typical, on outputs ≲ 3
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
    # as in the KV-cache test above: other product shapes, other orders of 32-term sums: ≲ 6e-6 worst case
    assert torch.allclose(torch.cat([first, chunk], dim=1), attn(x), atol=1e-5)
