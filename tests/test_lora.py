"""LoRA (appendix A): the adapted model starts as the base model, adapters off is the base model exactly, only A and B
learn, merge and unmerge, the reference for free in DPO, and agreement with PEFT's LoRA layer."""

import copy
import inspect
import math

import pytest
import torch
import torch.nn as nn

from llm_from_scratch import lora
from llm_from_scratch.dpo import DPOConfig, dpo_step, frozen_logps, preference_batch
from llm_from_scratch.lora import Adapters, AdaptersOff, LoRALinear, adapters_disabled, apply_lora
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.tokenizer import Tokenizer

C, L, R = 32, 2, 4


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, context_length=32, n_layer=L, n_head=4, n_embd=C, attn_impl="explicit"))


def trained_lora(steps: int = 3, targets="all", seed: int = 0) -> tuple[GPT, GPT, torch.Tensor]:
    """A GPT, a copy of it untouched, and a batch; the first adapted and trained a few steps (B no longer 0)."""
    model = tiny_gpt(seed)
    base = copy.deepcopy(model)
    apply_lora(model, R, targets=targets)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(lora.trainable_parameters(model), lr=0.5)
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, base, ids


def by_hand(layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    """y = x Wᵀ + b + (α/r) x Aᵀ Bᵀ, written out with the effective weight."""
    w = layer.base.weight + (layer.alpha / layer.rank) * layer.lora_B @ layer.lora_A
    return x @ w.T + layer.base.bias


@pytest.mark.grades("lora.LoRALinear.forward")
def test_a_fresh_adapter_changes_nothing_and_a_trained_one_adds_scaled_BA():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    layer = LoRALinear(copy.deepcopy(base), rank=2, alpha=6.0)
    x = torch.randn(4, 3, 6)
    assert torch.equal(layer(x), base(x))  # B = 0: exactly the base layer at step 0
    with torch.no_grad():
        layer.lora_B.normal_()
    assert layer.scale == 3.0
    # x Wᵀ + b + 3 (x Aᵀ) Bᵀ against x (W + 3 B A)ᵀ + b: float32 sums of ≤ 6 products in two associations, |terms|
    # adding up to ≲ 10 (|y| ≲ 8): ≲ 10·6e-8·10 ≈ 6e-6 (7e-7 seen)
    torch.testing.assert_close(layer(x), by_hand(layer, x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x), base(x), atol=1e-3)  # B ~ N(0, 1): the adapter adds O(1), not a rounding


@pytest.mark.grades("lora.LoRALinear.forward")
def test_dropout_falls_on_the_adapter_input_only():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(8, 8), rank=2, alpha=2.0, dropout=0.9).train()
    x = torch.randn(16, 8)
    assert torch.equal(layer(x), layer.base(x))  # B = 0, training mode: the base layer's output is never dropped
    with torch.no_grad():
        layer.lora_B.normal_()
    y = layer(x)
    assert not torch.allclose(y, layer.base(x))  # training: the adapter's path (O(1)) is dropped-out, not the base's
    with adapters_disabled(layer):
        assert torch.equal(layer(x), layer.base(x))  # the base path has no dropout at all
    layer.eval()
    torch.testing.assert_close(layer(x), by_hand(layer, x), rtol=1e-5, atol=1e-5)  # eval: no dropout; as above


@pytest.mark.grades("lora.LoRALinear.forward")
def test_the_adapted_gpt_is_the_base_gpt_at_step_0():
    model = tiny_gpt()
    base = copy.deepcopy(model)
    apply_lora(model, R)
    ids = torch.randint(0, 64, (2, 10))
    assert torch.equal(model(ids), base(ids))


@pytest.mark.grades("lora.LoRALinear.forward")
def test_adapters_off_is_exactly_the_base_model_after_training():
    model, base, ids = trained_lora()
    assert not torch.allclose(model(ids), base(ids), atol=1e-4)  # training moved it (by ~0.2, far from a rounding)
    with adapters_disabled(model):
        assert torch.equal(model(ids), base(ids))
    assert not torch.allclose(model(ids), base(ids), atol=1e-4)  # and the adapters are back on after the block
    reference = AdaptersOff(model)
    assert torch.equal(reference(ids), base(ids))
    assert torch.equal(reference.trunk(ids), base.trunk(ids))
    with pytest.raises(ZeroDivisionError):
        with adapters_disabled(model):
            1 / 0
    assert all(layer.enabled for layer in lora.adapted_layers(model).values())  # restored even after an error


def test_only_A_and_B_learn_and_their_number_is_r_times_in_plus_out():
    model = tiny_gpt()
    apply_lora(model, R)
    trainable = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    # per block: c_attn r(C + 3C), attention c_proj r(C + C), c_fc r(C + 4C), MLP c_proj r(4C + C) = 16 r C
    assert sum(p.numel() for p in trainable.values()) == L * 16 * R * C == 4096
    ids = torch.randint(0, 64, (2, 10))
    model(ids).sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == name.endswith(("lora_A", "lora_B")), name
    grads = {n: model.get_parameter(n).grad.abs().sum().item() for n in trainable}
    assert all(g == 0 for n, g in grads.items() if n.endswith("lora_A"))  # B = 0: at step 0 only B hears the loss
    assert all(g > 0 for n, g in grads.items() if n.endswith("lora_B"))


def test_targets_choose_the_layers():
    assert set(lora.adapted_layers(apply_lora(tiny_gpt(), R, targets="attn"))) == {
        f"blocks.{i}.attn.{n}" for i in range(L) for n in ("c_attn", "c_proj")}
    assert set(lora.adapted_layers(apply_lora(tiny_gpt(), R, targets="mlp"))) == {
        f"blocks.{i}.mlp.{n}" for i in range(L) for n in ("c_fc", "c_proj")}
    assert len(lora.adapted_layers(apply_lora(tiny_gpt(), R, targets=("attn.c_attn",)))) == L
    with pytest.raises(ValueError, match="already has adapters"):
        apply_lora(apply_lora(tiny_gpt(), R), R)
    with pytest.raises(ValueError, match="choose one of"):
        apply_lora(tiny_gpt(), R, targets="heads")
    with pytest.raises(ValueError, match="no nn.Linear"):
        apply_lora(tiny_gpt(), R, targets=("wte",))


@pytest.mark.grades("lora.LoRALinear.forward")
def test_merge_keeps_the_outputs_and_unmerge_restores_the_weights():
    model, base, ids = trained_lora()
    before = model(ids)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.merge(model)
    assert all(layer.merged for layer in lora.adapted_layers(model).values())
    # merged and unmerged logits (~1) here and below: W + (α/r) B A rounded once per weight, then float32 sums of ≤ 128
    # products in another association through 2 blocks: ~√128·6e-8 of sums ≲ 3 (≲ 2e-6; 1.2e-7 seen)
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)  # the update is in W now, not added twice
    moved = [n for n, p in model.named_parameters() if n.endswith("base.weight") and not torch.equal(p, weights[n])]
    assert len(moved) == 4 * L
    with pytest.raises(RuntimeError, match="unmerge first"):
        with adapters_disabled(model):
            pass
    lora.unmerge(model)
    for n, p in model.named_parameters():  # (W ⊕ Δ) ⊖ Δ, the same Δ twice: ≤ half an ulp of |W + Δ| ≲ 1 (≤ 6e-8)
        torch.testing.assert_close(p, weights[n], rtol=0, atol=1e-6)
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    with adapters_disabled(model):  # the base weights back to ≤ half an ulp: logits ~1 within ≲ 2e-6, as above
        torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=1e-5)


def test_merged_state_dict_is_a_plain_gpt_of_the_adapted_model():
    model, base, ids = trained_lora()
    plain = tiny_gpt(seed=5)
    plain.load_state_dict(lora.merged_state_dict(model))
    torch.testing.assert_close(plain(ids), model(ids), rtol=1e-5, atol=1e-5)  # merged vs unmerged, as in the test above
    assert plain.lm_head.weight is plain.wte.weight  # still tied
    with adapters_disabled(model):
        assert torch.equal(model(ids), base(ids))  # the model itself was not changed


def test_the_adapters_alone_save_and_load_into_the_model():
    model, _, ids = trained_lora()
    adapters = Adapters(model)
    state = {k: v.clone() for k, v in adapters.state_dict().items()}
    assert len(state) == 2 * 4 * L and all(k.endswith(("lora_A", "lora_B")) for k in state)
    fresh = apply_lora(tiny_gpt(), R)
    assert not torch.allclose(fresh(ids), model(ids), atol=1e-4)  # trained adapters move the logits by ~0.2
    Adapters(fresh).load_state_dict(state)
    assert torch.equal(fresh(ids), model(ids))


def test_dpo_with_the_adapters_off_reference_starts_at_log_2_and_the_reference_stays_the_base():
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)})
    torch.manual_seed(0)
    policy = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=2, n_head=2, n_embd=32))
    sft = copy.deepcopy(policy)
    apply_lora(policy, R, alpha=32.0)
    reference = AdaptersOff(policy)
    pairs = [{"prompt": "Add 2 and 3.", "chosen": "5", "rejected": "6"},
             {"prompt": "Say hi.", "chosen": "hi", "rejected": "no"}]
    batch = preference_batch(tok, pairs)
    optimizer = torch.optim.AdamW(lora.trainable_parameters(policy), lr=1e-2)
    cfg = DPOConfig(beta=0.5)
    first = dpo_step(policy, optimizer, batch, *frozen_logps(reference, *batch), cfg)
    # the policy is its reference at step 0 (B = 0 adds +0.0: the same floats), so h = 0 exactly; the float32
    # −log σ(0) is log 2 to an ulp or two (6e-8 each)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for _ in range(5):
        ref = frozen_logps(reference, *batch)
        for a, b in zip(ref, frozen_logps(sft, *batch)):
            assert torch.equal(a, b)  # adapters off: the SFT model's log-probs, bit for bit, while the policy moves
        last = dpo_step(policy, optimizer, batch, *ref, cfg)
    assert last["loss"] < math.log(2) - 0.01


def peft_linear(base: nn.Linear, rank: int, alpha: float):
    """PEFT's LoRA layer on `base` (its constructor changed over versions: newer ones take a LoraConfig)."""
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import Linear

    kwargs = dict(r=rank, lora_alpha=alpha, lora_dropout=0.0)
    if "config" in inspect.signature(Linear.__init__).parameters:
        kwargs["config"] = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0)
    return Linear(base, "default", **kwargs)


@pytest.mark.grades("lora.LoRALinear.forward")
def test_our_layer_and_peft_s_give_the_same_outputs_and_gradients():
    torch.manual_seed(0)
    base = nn.Linear(12, 10)
    ours = LoRALinear(copy.deepcopy(base), rank=3, alpha=6.0)
    theirs = peft_linear(copy.deepcopy(base), 3, 6.0)
    theirs.base_layer.requires_grad_(False)
    with torch.no_grad():
        ours.lora_B.normal_()
        theirs.lora_A["default"].weight.copy_(ours.lora_A)
        theirs.lora_B["default"].weight.copy_(ours.lora_B)
    x = torch.randn(5, 7, 12)
    y_ours, y_theirs = ours(x), theirs(x)
    # PEFT runs the same products (equal here), but its version may order them otherwise. y: float32 sums of ≤ 15
    # products, |terms| adding up to ≲ 8: ≤ 15·6e-8·8 ≈ 7e-6 in the worst order (1e-6 was under it)
    torch.testing.assert_close(y_ours, y_theirs, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(y_ours)
    (y_ours * w).sum().backward()
    (y_theirs * w).sum().backward()
    # a gradient element sums 35 rows of terms whose |·| add up to ≲ 30 (B) and 260 (A; |g| from 0.1 to 98): another
    # order typically differs by √35·6e-8 of that, ≤ half of rtol 1e-4 + atol 1e-5 on every element (and up to 4× the
    # rtol 1e-5 + atol 1e-6 of before)
    torch.testing.assert_close(ours.lora_A.grad, theirs.lora_A["default"].weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.lora_B.grad, theirs.lora_B["default"].weight.grad, rtol=1e-4, atol=1e-5)
    assert ours.base.weight.grad is None
