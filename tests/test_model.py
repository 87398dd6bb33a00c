import math

import numpy as np
import pytest
import torch

from llm_from_scratch.model import GPT, GPTConfig, eval_mode


def tiny(**kw):
    return GPTConfig(**{**dict(vocab_size=50, context_length=32, n_layer=2, n_head=2, n_embd=16), **kw})


@pytest.mark.grades("model.Block.forward")
def test_explicit_and_sdpa_models_agree():
    torch.manual_seed(0)
    a = GPT(tiny(attn_impl="explicit")).eval()
    b = GPT(tiny(attn_impl="sdpa")).eval()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 50, (3, 20))
    # two attention orders through 2 layers of ≤ 64-term float32 sums; the head (rows of std 0.02) keeps logits ≲ 0.5:
    # ≲ 64·6e-8 ≈ 4e-6 relative worst case, ~1e-7 typical
    assert (a(idx) - b(idx)).abs().max() <= 1e-5


@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_left_padded_rows_compute_the_same_logits_as_alone(impl):
    torch.manual_seed(0)
    model = GPT(tiny(attn_impl=impl)).eval()
    rows = [torch.randint(0, 50, (n,)) for n in (7, 12, 3)]
    T = 12
    idx = torch.full((3, T), 49)  # pad value is arbitrary: the mask hides it
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    batched = model(idx, attention_mask=mask)
    for i, r in enumerate(rows):
        alone = model(r[None])
        # the batch with a mask against the row alone: other product shapes, other orders of the same ≤ 64-term sums
        # (≲ 4e-6 worst case on logits ≲ 0.5); allclose adds rtol 1e-5
        assert torch.allclose(batched[i, T - len(r):], alone[0], atol=1e-5)


@pytest.mark.grades("attention.KVCache.update")
def test_cached_forward_matches_full_forward_with_padding():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 50, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    full = model(idx, attention_mask=mask)
    cache = model.new_kv_cache(2, 10)
    parts = [model(idx[:, :6], attention_mask=mask[:, :6], kv_cache=cache)]
    for t in range(6, 10):
        parts.append(model(idx[:, t:t + 1], attention_mask=mask[:, :t + 1], kv_cache=cache))
    # cached rows against the full pass: other product shapes, other orders of ≤ 64-term sums, ≲ 4e-6 worst case
    assert torch.allclose(torch.cat(parts, 1)[mask.bool()], full[mask.bool()], atol=1e-5)
    assert cache.length == 10


def test_head_is_tied_to_the_embedding():
    model = GPT(tiny())
    assert model.lm_head.weight is model.wte.weight
    model(torch.randint(0, 50, (1, 5))).sum().backward()
    assert model.wte.weight.grad is not None
    # counted once
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names


def test_gpt2_initialisation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, context_length=16, n_layer=8, n_head=4, n_embd=256))
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.blocks]
                     + [b.mlp.c_proj.weight.flatten() for b in model.blocks])
    # sampling, not rounding: the std of N normal draws is ~1/√(2N) relative off (4e-4 for N = 2.6M, 1.4e-3 for
    # 262k); a wrong scale (no 1/√(2L): x4) is far outside 2%
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.02)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks[0].attn.c_attn.bias.abs().max().item() == 0


def test_parameter_and_flop_counts_by_hand():
    c = GPTConfig(vocab_size=10, context_length=4, n_layer=1, n_head=1, n_embd=2)
    model = GPT(c)
    # wte 10*2 + wpe 4*2 + block: ln1 4 + c_attn 2*6+6 + c_proj 2*2+2 + ln2 4 + c_fc 2*8+8 + c_proj 8*2+2 + ln_f 4
    assert model.num_params() == 20 + 8 + 4 + 18 + 6 + 4 + 24 + 18 + 4
    assert model.num_params(non_embedding=True) == 4 + 18 + 6 + 4 + 24 + 18 + 4
    # 6 * (78 non-embedding + 20 head) + 12 * 1 * 2 * 4
    assert model.flops_per_token() == 6 * 98 + 96


def test_presets_and_errors():
    assert GPTConfig.preset("small", vocab_size=768).n_embd == 384
    assert GPTConfig.preset("gpt2-124m").vocab_size == 50257
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("huge")
    model = GPT(tiny())
    with pytest.raises(ValueError, match="longer than the context"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(torch.zeros(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 4))


def test_eval_mode_turns_dropout_off_and_restores_each_mode_even_on_error():
    a, b = GPT(tiny()), GPT(tiny()).eval()
    a.train()
    with pytest.raises(RuntimeError, match="boom"):
        with eval_mode(a, b):
            assert not a.training and not a.drop.training and not b.training
            raise RuntimeError("boom")
    assert a.training and a.drop.training and not b.training


# ----------------------------------------------------------------------------- an independent reference, in NumPy


def numpy_gpt_forward(model: GPT, idx: np.ndarray) -> np.ndarray:
    """GPT-2's forward pass written again from the paper's equations, in float64 NumPy, reading only the weights:
    h = E[idx] + P[0..T); per block h += attn(LN1(h)), h += MLP(LN2(h)); logits = LN_f(h) E^T."""
    w = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    n_head = model.config.n_head

    def layer_norm(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def gelu(x):  # the tanh approximation GPT-2 uses
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    B, T = idx.shape
    h = w["wte.weight"][idx] + w["wpe.weight"][np.arange(T)]  # (B, T, C)
    C = h.shape[-1]
    D = C // n_head
    future = np.triu(np.ones((T, T), dtype=bool), k=1)  # key j > query i
    for i in range(model.config.n_layer):
        p = f"blocks.{i}"
        qkv = linear(layer_norm(h, f"{p}.ln_1"), f"{p}.attn.c_attn")  # (B, T, 3C)
        heads = []
        for hd in range(n_head):
            q = qkv[..., hd * D:(hd + 1) * D]
            k = qkv[..., C + hd * D:C + (hd + 1) * D]
            v = qkv[..., 2 * C + hd * D:2 * C + (hd + 1) * D]
            s = q @ k.transpose(0, 2, 1) / np.sqrt(D)  # (B, T, T)
            s[:, future] = -np.inf
            a = np.exp(s - s.max(-1, keepdims=True))
            heads.append((a / a.sum(-1, keepdims=True)) @ v)  # (B, T, D)
        h = h + linear(np.concatenate(heads, -1), f"{p}.attn.c_proj")
        h = h + linear(gelu(linear(layer_norm(h, f"{p}.ln_2"), f"{p}.mlp.c_fc")), f"{p}.mlp.c_proj")
    return layer_norm(h, "ln_f") @ w["wte.weight"].T  # (B, T, V)


@pytest.mark.grades("model.Block.forward", "attention.CausalSelfAttention.forward")
@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_forward_matches_an_independent_numpy_gpt2(impl):
    torch.manual_seed(0)
    model = GPT(tiny(attn_impl=impl, n_head=4, n_embd=32)).eval()
    with torch.no_grad():  # every LayerNorm and bias away from its initial value, so a swapped one shows
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
    idx = torch.randint(0, 50, (2, 11))
    ours = model(idx).double().detach().numpy()
    error = float(np.abs(ours - numpy_gpt_forward(model, idx.numpy())).max())
    # float32 against float64: 32- and 128-term sums (each ≲ N·6e-8·Σ|x| ≲ 4e-6 worst case), and LayerNorms that
    # divide by stds ~0.3 (x3 per norm) through 2 layers: ≲ 1e-5 worst case on logits ~0.4, ~1e-7 typical
    assert error < 1e-4, f"the logits differ from an independent NumPy GPT-2 by up to {error:.2e}"


@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_cached_decoding_without_a_mask_continues_the_positions(impl):
    # prompts of equal length take the maskless path: prefill 6 tokens, then one at a time; position ids go on
    # from 6 (a cache that restarted them at 0 would give other logits)
    torch.manual_seed(0)
    model = GPT(tiny(attn_impl=impl)).eval()
    idx = torch.randint(0, 50, (2, 10))
    cache = model.new_kv_cache(2, 10)
    parts = [model(idx[:, :6], kv_cache=cache)]
    for t in range(6, 10):
        parts.append(model(idx[:, t:t + 1], kv_cache=cache))
    assert torch.allclose(torch.cat(parts, 1), model(idx), atol=1e-5)  # as with padding above: ≲ 4e-6 worst case
