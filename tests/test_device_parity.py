"""Training on an accelerator follows training on the CPU.

`compare_steps(device_a, device_b)` runs the same few optimizer steps of a tiny GPT on two devices, from the same
initial weights and on the same batches, with the training loop's own pieces (train.lr_at, accumulate_gradients,
optimizer_step, configure_optimizer: fused AdamW and pinned, asynchronous batch copies on CUDA), in float32, and
reports whether the losses and the final weights agree within a float tolerance. The GPU test needs CUDA or MPS and is
skipped on a CPU-only machine (benchmarks/gpu_check.sh runs it on a GPU); the helper itself is checked here on
cpu vs cpu: equal runs agree bit for bit, and a run with another learning rate is reported as a mismatch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from llm_from_scratch.device import available_devices
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.train import TrainConfig, accumulate_gradients, configure_optimizer, lr_at, optimizer_step

TINY = GPTConfig(vocab_size=64, context_length=16, n_layer=2, n_head=2, n_embd=32)
STEPS_CFG = TrainConfig(max_steps=5, lr=3e-3, min_lr=3e-4, warmup_steps=2, grad_clip=1.0)
ACCELERATOR = available_devices()[0]  # "cuda", "mps", or "cpu" when there is neither


@dataclass
class Comparison:
    losses_a: list[float]
    losses_b: list[float]
    loss_rel_diff: float  # max over the steps of |loss_a - loss_b| / |loss_b|
    update_rel_diff: float  # ‖w_a - w_b‖ / ‖w_b - w_0‖ over every weight at once: how far apart, per distance moved
    weight_diff: float  # max |w_a - w_b| over every weight after the last step (reported, not judged)
    ok: bool
    mismatch: str  # "" when ok; else what differed, and by how much


@contextlib.contextmanager
def full_float32():
    """TF32 off on CUDA while the runs compare: pick_device turns it on for speed (device.allow_tf32), and its
    10-bit mantissa is a precision choice, not a device bug. Restored after; nothing happens on a CPU or MPS."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def batches(steps: int, batch_size: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (x, y) micro-batch per step, made on the CPU (as data.WindowSampler makes them): y is x shifted by one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        w = torch.randint(0, TINY.vocab_size, (batch_size, TINY.context_length + 1), generator=g)  # (B, T+1)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def run_steps(device: str, cfg: TrainConfig, init: dict, data: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The training loop's step (train.train: the learning rate of the step, accumulate_gradients, optimizer_step)
    on `device`, from the weights `init`; returns each step's loss and the final weights, on the CPU."""
    model = GPT(TINY).to(device)
    model.load_state_dict(init)
    model.train()
    optimizer = configure_optimizer(model, cfg)
    losses = []
    for step, batch in enumerate(data):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss, _ = accumulate_gradients(model, [batch])  # amp None: float32
        optimizer_step(model, optimizer, cfg.grad_clip)
        losses.append(loss)
    return losses, {name: p.detach().cpu() for name, p in model.named_parameters()}


# The tolerances, from the computation: another device sums in another order (cuBLAS, its reductions, fused AdamW).
# update_rtol: a gradient with a real size (≫ rounding) is ~1e-6 relative off, and Adam's step lr·m/(√v + eps) with
# it; a gradient that is 0 in exact arithmetic (the key biases': softmax ignores a shift of every score) is rounding
# noise ~6e-8·Σ|terms| ≈ 1e-11 here, ≪ eps = 1e-8, so its step is ≲ 1e-3·lr: both far below 1% of the distance moved.
# rtol: weights apart by ≤ 1% of the distance moved change losses that moved by ≲ 1% (4.18 → 4.21 here) by ≲ 1e-4
# relative, and a forward pass of ≤ 128-term float32 sums adds ≲ 128·6e-8 ≈ 8e-6: 1e-3 leaves a 10x margin.
def compare_steps(device_a: str, device_b: str, steps: int = 5, cfg_a: TrainConfig | None = None,
                  cfg_b: TrainConfig | None = None, rtol: float = 1e-3, update_rtol: float = 1e-2,
                  seed: int = 0) -> Comparison:
    """`steps` training steps of the tiny GPT on device_a and on device_b (configs cfg_a, cfg_b; default STEPS_CFG),
    the same initial weights w_0 and batches. ok when every step's loss agrees within rtol (relative) and the final
    weights within update_rtol of the distance they moved: ‖w_a - w_b‖ / ‖w_b - w_0‖, all weights at once. (Not
    weight by weight: Adam's first steps move each weight by about ±lr whatever its gradient's size, so a gradient
    at rounding level, its sign decided by summation order, can flip one weight's step on one device alone.
    Measured on a CPU with sdpa against explicit attention and w_0 perturbed by 1e-6: at most 1.1e-7 on the losses
    and 1.0e-4 on the weights, over 5 seeds; twice the learning rate on one side gives about 0.5.)"""
    cfg_a, cfg_b = cfg_a or STEPS_CFG, cfg_b or STEPS_CFG
    torch.manual_seed(seed)
    init = {k: v.clone() for k, v in GPT(TINY).state_dict().items()}  # made on the CPU: the same on both sides
    data = batches(steps, seed=seed)
    with full_float32():
        losses_a, weights_a = run_steps(device_a, cfg_a, init, data)
        losses_b, weights_b = run_steps(device_b, cfg_b, init, data)
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses_a, losses_b))
    apart = torch.stack([(weights_a[k] - weights_b[k]).norm() for k in weights_a]).norm().item()
    moved = torch.stack([(weights_b[k] - init[k]).norm() for k in weights_b]).norm().item()
    update_rel = apart / max(moved, 1e-12)
    weight_diff = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
    problems = []
    if loss_rel > rtol:
        step = max(range(steps), key=lambda s: abs(losses_a[s] - losses_b[s]))
        problems.append(f"losses differ by {loss_rel:.2e} (relative) > {rtol:g}; worst at step {step}: "
                        f"{losses_a[step]:.6f} on {device_a} vs {losses_b[step]:.6f} on {device_b}")
    if update_rel > update_rtol:
        worst = max(weights_a, key=lambda k: (weights_a[k] - weights_b[k]).abs().max().item())
        problems.append(f"weights after {steps} steps differ by {update_rel:.2e} of the distance they moved "
                        f"> {update_rtol:g}; the largest difference {weight_diff:.2e} in {worst}")
    return Comparison(losses_a, losses_b, loss_rel, update_rel, weight_diff, ok=not problems,
                      mismatch="; ".join(problems))


def test_compare_steps_finds_equal_runs_equal_on_the_cpu():
    result = compare_steps("cpu", "cpu")
    assert result.ok, result.mismatch
    assert result.losses_a == result.losses_b and result.weight_diff == 0.0  # the same arithmetic, bit for bit
    assert len(set(result.losses_a)) == len(result.losses_a)  # every step saw new weights and a new batch


def test_compare_steps_reports_a_run_that_differs():
    """The sanity check of the check: twice the learning rate on one side must fail the tolerance, and say where."""
    result = compare_steps("cpu", "cpu", cfg_b=TrainConfig(**{**vars(STEPS_CFG), "lr": 2 * STEPS_CFG.lr}))
    assert not result.ok
    assert result.losses_a[0] == result.losses_b[0]  # the first loss comes before any update
    # twice the lr moves every weight about twice as far: apart by ~the distance moved (≈ 0.5 of it, measured); 0.1
    # is 10x the update_rtol that rounding must stay under
    assert "weights after 5 steps differ" in result.mismatch and result.update_rel_diff > 0.1, result.mismatch


@pytest.mark.skipif(ACCELERATOR == "cpu", reason="no CUDA or MPS device on this machine: the accelerator-vs-CPU "
                                                 "training parity check needs one (benchmarks/gpu_check.sh runs it)")
def test_a_few_training_steps_on_the_accelerator_follow_the_cpu():
    result = compare_steps(ACCELERATOR, "cpu")
    assert result.ok, f"{ACCELERATOR} vs cpu: {result.mismatch}"
    print(f"{ACCELERATOR} vs cpu, {len(result.losses_a)} steps: losses {result.loss_rel_diff:.1e} apart (relative), "
          f"weights {result.update_rel_diff:.1e} of the distance moved (max |diff| {result.weight_diff:.1e})")
