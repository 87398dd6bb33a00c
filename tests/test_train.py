import json
import math

import pytest
import torch

from llm_from_scratch.checkpoint import load_train_state, read_jsonl
from llm_from_scratch.data import WindowSampler
from llm_from_scratch.device import choose_dtype
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.train import (
    TrainConfig,
    accumulate_gradients,
    configure_optimizer,
    evaluate,
    fastest_dtype,
    lm_loss,
    load_gpt,
    lr_at,
    optimizer_step,
    require_finite,
    save_gpt,
    train,
)


def small_model(dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=30, context_length=16, n_layer=2, n_head=2, n_embd=16, dropout=dropout))


TOKENS = torch.randint(0, 30, (2000,), generator=torch.Generator().manual_seed(0))


@pytest.mark.grades("train.lr_at")
def test_lr_schedule_by_hand():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    # float64, a few ops (cos(π/2) is 6e-17, not 0): ~1e-16 relative under approx's default rel 1e-6; the catalogued
    # bugs are ≥ 10% off
    assert lr_at(0, cfg) == pytest.approx(0.1)  # (0 + 1) / 10
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices():
    model = small_model()
    opt = configure_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.grades("train.lm_loss")
def test_loss_ignores_masked_targets():
    model = small_model().eval()
    x = torch.randint(0, 30, (2, 8))
    y = torch.randint(0, 30, (2, 8))
    logp = torch.log_softmax(model(x), -1).gather(-1, y[..., None])[..., 0]
    y_masked = y.clone()
    y_masked[:, :5] = -100
    # the same float32 log-softmax, then a mean (a sum) of 6 positive terms in two orders: ≤ 2·6·6e-8 ≈ 7e-7 relative,
    # ≤ 3e-6 of the mean ~3.5 and 1.5e-5 of the sum ~21 (abs 1e-5, 1e-4)
    assert lm_loss(model, x, y_masked).item() == pytest.approx(-logp[:, 5:].mean().item(), abs=1e-5)
    assert evaluate(model, [(x, y_masked)], "cpu") == pytest.approx(-logp[:, 5:].mean().item(), abs=1e-5)
    # reduction="sum" (each rank's share under torchrun): the sum of -log p over the unmasked targets
    assert lm_loss(model, x, y_masked, reduction="sum").item() == pytest.approx(-logp[:, 5:].sum().item(), abs=1e-4)


def test_evaluate_weighs_every_target_token_equally():
    """Validation loss = total NLL / total targets over all batches, not the mean of the batches' means: two (2, 12)
    batches with 3 and 22 real targets, the NLL summed by hand from log-softmax."""
    model = small_model().eval()
    g = torch.Generator().manual_seed(5)
    x1, y1, x2, y2 = (torch.randint(0, 30, (2, 12), generator=g) for _ in range(4))
    y1[0, 3:] = -100
    y1[1] = -100  # 3 targets
    y2[:, 0] = -100  # 22 targets
    batches = [(x1, y1), (x2, y2)]
    nll, count = 0.0, 0
    for x, y in batches:
        logp = torch.log_softmax(model(x).double(), -1)
        for b, t in (y != -100).nonzero().tolist():
            nll -= logp[b, t, y[b, t]].item()
            count += 1
    assert count == 3 + 22
    mean_of_means = sum(lm_loss(model, x, y).item() for x, y in batches) / 2
    assert abs(mean_of_means - nll / count) > 1e-3  # the two reductions really differ, far beyond float32 rounding
    # float32 against float64: log-softmax to a few ulp (~1e-6 of 3.4), means of ≤ 22 positive terms (≤ 22·6e-8
    # relative): ≲ 5e-6
    assert evaluate(model, batches, "cpu") == pytest.approx(nll / count, abs=1e-5)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(tmp_path):
    model = small_model()
    x, y = WindowSampler(TOKENS, 16, 8).batch(0)
    before = lm_loss(model, x, y).item()
    cfg = TrainConfig(max_steps=30, lr=1e-2, warmup_steps=1, eval_interval=100, checkpoint_interval=100)
    train(model, cfg, lambda i: (x, y), lambda: [(x, y)], tmp_path, quiet=True)
    assert lm_loss(model.eval(), x, y).item() < before - 1.0


def test_save_load_identical_logits_and_vocab_check(tmp_path):
    model = small_model().eval()
    save_gpt(model, tmp_path)
    back = load_gpt(tmp_path, vocab_size=30).eval()
    x = torch.randint(0, 30, (2, 10))
    assert torch.equal(model(x), back(x))
    assert back.lm_head.weight is back.wte.weight
    with pytest.raises(ValueError, match="vocabulary of 30 tokens but the tokenizer has 31"):
        load_gpt(tmp_path, vocab_size=31)
    with pytest.raises(ValueError, match="config.json does not exist"):
        load_gpt(tmp_path / "nope")
    assert json.loads((tmp_path / "config.json").read_text())["kind"] == "gpt"


def test_load_gpt_overrides_win_over_the_saved_config(tmp_path):
    """load_gpt(..., dropout=0.0, attn_impl="explicit") builds the model with those values, not the checkpoint's."""
    model = small_model(dropout=0.1).eval()
    save_gpt(model, tmp_path)
    assert load_gpt(tmp_path).config.dropout == 0.1  # without overrides: the saved config
    back = load_gpt(tmp_path, dropout=0.0, attn_impl="explicit").eval()
    assert back.config.dropout == 0.0 and back.config.attn_impl == "explicit"
    assert all(m.p == 0.0 for m in back.modules() if isinstance(m, torch.nn.Dropout))
    x = torch.randint(0, 30, (2, 10))
    # same weights, the explicit attention against SDPA's kernel: softmax and sums over ≤ 10 keys of 8-dim heads in
    # another order, 2 layers: a few ulp of values ≲ 1 (≲ 1e-6; 4.5e-8 seen)
    torch.testing.assert_close(back(x), model(x), atol=1e-5, rtol=0)


def run(tmp_path, interrupt_at=None, dropout=0.1, interrupt_in_eval_at=None):
    """8 steps of 2 micro-batches, evaluated at steps 4 and 8. interrupt_at: Ctrl-C while fetching that micro-batch
    (before its step's update); interrupt_in_eval_at: Ctrl-C in on_eval at that step (after its update). Either way
    a fresh model then resumes. Returns the train losses and tokens by step, the model, train()'s summary and the
    step the interrupt saved as the next to run (None without one)."""
    sampler = WindowSampler(TOKENS, 16, 4, seed=1)
    calls = {"n": 0}

    def get_batch(i):
        if interrupt_at is not None and i == interrupt_at and calls["n"] == 0:
            calls["n"] += 1
            raise KeyboardInterrupt
        return sampler.batch(i)

    def on_eval(step, model):
        if interrupt_in_eval_at is not None and step == interrupt_in_eval_at and calls["n"] == 0:
            calls["n"] += 1
            raise KeyboardInterrupt
        return {}

    cfg = TrainConfig(max_steps=8, grad_accum=2, lr=3e-3, warmup_steps=2, log_interval=1, eval_interval=4,
                      checkpoint_interval=100)
    model, saved_step = small_model(dropout), None
    try:
        summary = train(model, cfg, get_batch, lambda: [sampler.batch(10_000)], tmp_path, on_eval=on_eval, quiet=True)
    except KeyboardInterrupt:
        saved_step = load_train_state(tmp_path / "last" / "train_state.pt")["step"]
        model = small_model(dropout, seed=123)  # a fresh process: different init, must be overwritten by the resume
        summary = train(model, cfg, get_batch, lambda: [sampler.batch(10_000)], tmp_path, on_eval=on_eval, quiet=True)
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss/train" in r]
    losses = {r["step"]: r["loss/train"] for r in records}
    tokens = {r["step"]: r["tokens"] for r in records}
    return losses, model, summary, tokens, saved_step


def test_interrupt_and_resume_continue_exactly(tmp_path):
    straight, m1, summary1, tokens1, _ = run(tmp_path / "a")
    # micro-batch 11 = step 5, second micro-batch (with dropout)
    resumed, m2, summary2, tokens2, saved = run(tmp_path / "b", interrupt_at=11)
    assert saved == 5  # step 5 (0-based) had not been updated: it is replayed
    assert load_train_state(tmp_path / "b" / "last" / "train_state.pt")["step"] == 8
    for step in range(1, 9):
        assert resumed[step] == straight[step], f"step {step}"
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n
    # the counters carry over too: tokens seen (every micro-batch is 4 x 16 targets) and the best validation loss
    assert tokens2 == tokens1 == {step: step * 2 * 4 * 16 for step in range(1, 9)}
    assert summary2 == summary1 and summary2["tokens"] == 8 * 2 * 4 * 16


def test_interrupt_after_an_update_resumes_at_the_next_step(tmp_path):
    """Ctrl-C in on_eval after 4 steps (0-3, their updates done): the saved state says step 4 (0-based) is the next
    to run, and the resumed run neither repeats nor skips a step: the same losses and weights as an uninterrupted
    run."""
    straight, m1, _, tokens1, _ = run(tmp_path / "a")
    resumed, m2, _, tokens2, saved = run(tmp_path / "b", interrupt_in_eval_at=4)
    assert saved == 4
    for step in range(1, 9):
        assert resumed[step] == straight[step], f"step {step}"
    assert len([r for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "loss/train" in r]) == 8  # no step twice
    assert tokens2 == tokens1
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    sampler = WindowSampler(TOKENS, 16, 4)
    model = small_model()
    cfg = TrainConfig(max_steps=3, warmup_steps=1, eval_interval=100, checkpoint_interval=1)
    train(model, cfg, sampler.batch, lambda: [sampler.batch(99)], tmp_path, quiet=True)

    def poisoned(i):  # the weights blow up during step 4 (as a too-high learning rate would make them)
        if i == 4:
            with torch.no_grad():
                model.wte.weight.fill_(float("nan"))
        return sampler.batch(i)

    cfg.max_steps = 6
    with pytest.raises(FloatingPointError, match="loss is nan at step 4") as err:
        train(model, cfg, poisoned, lambda: [sampler.batch(99)], tmp_path, quiet=True)
    assert str(err.value) == (f"the training loss is nan at step 4: stopping; the last good checkpoint is "
                              f"{tmp_path / 'last'} (lower --lr, or check the data)")
    kept = load_gpt(tmp_path / "last")  # written after step 4 (index 3), the last good one
    assert load_train_state(tmp_path / "last" / "train_state.pt")["step"] == 4
    assert all(torch.isfinite(p).all() for p in kept.parameters())


def test_require_finite_names_what_the_step_and_the_checkpoint(tmp_path):
    assert require_finite(2.5, "the loss", 3, None) == 2.5 and require_finite(torch.tensor(1.0), "x", 0, None) == 1.0
    with pytest.raises(FloatingPointError) as err:
        require_finite(float("nan"), "the policy loss", 7, None)
    assert str(err.value) == ("the policy loss is nan at step 7: stopping; no checkpoint yet "
                              "(lower --lr, or check the data)")
    with pytest.raises(FloatingPointError) as err:
        require_finite(float("-inf"), "the DPO loss", 12, tmp_path / "last", hint="lower --beta")
    assert str(err.value) == (f"the DPO loss is -inf at step 12: stopping; the last good checkpoint is "
                              f"{tmp_path / 'last'} (lower --beta)")


def test_a_nan_learning_rate_stops_before_its_nan_weights_are_saved(tmp_path):
    """min_lr = nan: step 0 runs at the peak lr, step 1 at nan. Step 1's loss is finite (its weights are step 0's),
    its update makes every weight nan; the checkpoint due after it is refused (the weights' norm is nan), so the one
    of step 1 is kept and named, not overwritten by nan weights that would then pass for a good checkpoint."""
    sampler = WindowSampler(TOKENS, 16, 4)
    cfg = TrainConfig(max_steps=4, min_lr=float("nan"), warmup_steps=1, eval_interval=100, checkpoint_interval=1)
    with pytest.raises(FloatingPointError) as err:
        train(small_model(), cfg, sampler.batch, lambda: [sampler.batch(99)], tmp_path, quiet=True)
    assert str(err.value) == (f"the weights' norm is nan at step 1: stopping; the last good checkpoint is "
                              f"{tmp_path / 'last'} (lower --lr, or check the data)")
    assert load_train_state(tmp_path / "last" / "train_state.pt")["step"] == 1
    assert all(torch.isfinite(p).all() for p in load_gpt(tmp_path / "last").parameters())


class Killed(BaseException):
    """What SIGKILL does to train(): it stops where it is and no handler runs (Ctrl-C's KeyboardInterrupt saves)."""


def test_a_killed_run_records_every_step_once_and_ends_bit_identical(tmp_path, monkeypatch):
    """One run killed three times, each time resumed by a fresh model as a new process would: before its first
    checkpoint (so it starts over), right after the checkpoint of step 4 is written, and between the two files of the
    checkpoint of step 8 (weights written, train_state.pt not yet: steps 5-8 were recorded past the checkpoint of 4).
    metrics.jsonl ends with every record once, the same as an uninterrupted run's, and the weights are bit-identical."""
    import llm_from_scratch.train as train_module

    sampler = WindowSampler(TOKENS, 16, 4, seed=1)
    cfg = TrainConfig(max_steps=8, lr=3e-3, warmup_steps=2, log_interval=1, eval_interval=2, checkpoint_interval=4)
    save_state = train_module.save_train_state

    def run(out, kill_at_batch=None, kill_at_checkpoint=None, before_write=False):
        def get_batch(i):
            if i == kill_at_batch:
                raise Killed
            return sampler.batch(i)

        def save_train_state(path, state):
            if state["step"] == kill_at_checkpoint and before_write:
                raise Killed
            save_state(path, state)
            if state["step"] == kill_at_checkpoint:
                raise Killed

        monkeypatch.setattr(train_module, "save_train_state", save_train_state)
        model = small_model(dropout=0.1, seed=123)  # a fresh process: another init, overwritten by a resume
        try:
            train(model, cfg, get_batch, lambda: [sampler.batch(10_000)], out, quiet=True)
        except Killed:
            return None
        return model

    def records(out):
        return [(r["step"], "loss/train" in r, r.get("loss/train", r.get("loss/val")))
                for r in read_jsonl(out / "metrics.jsonl")]

    straight = run(tmp_path / "a")
    out = tmp_path / "b"
    assert run(out, kill_at_batch=2) is None and not (out / "last").exists()  # steps 1, 2 recorded, no checkpoint
    assert [s for s, _, _ in records(out)] == [1, 2, 2]
    assert run(out, kill_at_checkpoint=4) is None  # killed just after the checkpoint of step 4
    assert run(out, kill_at_checkpoint=8, before_write=True) is None  # between last/model.safetensors and its state
    assert load_train_state(out / "last" / "train_state.pt")["step"] == 4 and max(s for s, _, _ in records(out)) == 8
    resumed = run(out)
    assert records(out) == records(tmp_path / "a")  # each step once, with the same losses
    for (n, p1), (_, p2) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p1, p2), n
    for folder in ("", "last"):
        assert all(torch.equal(p1, p2) for p1, p2 in zip(load_gpt(tmp_path / "a" / folder).parameters(),
                                                         load_gpt(out / folder).parameters())), folder


def test_metrics_and_best_checkpoint_are_written(tmp_path):
    sampler = WindowSampler(TOKENS, 16, 4)
    cfg = TrainConfig(max_steps=4, warmup_steps=1, log_interval=2, eval_interval=2, checkpoint_interval=2)
    summary = train(small_model(), cfg, sampler.batch, lambda: [sampler.batch(99)], tmp_path, quiet=True)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    vals = [r["loss/val"] for r in records if "loss/val" in r]
    assert len(vals) == 2 and summary["best_val"] == min(vals)
    assert all(math.isfinite(r["train/tokens_per_s"]) for r in records if "loss/train" in r)
    config = json.loads((tmp_path / "config.json").read_text())
    assert ((tmp_path / "model.safetensors").is_file() and config["kind"] == "gpt"
            and config["config"]["vocab_size"] == 30)


def test_optimizer_step_clips_to_the_norm_and_returns_the_norm_before():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.tensor([3.0, 4.0])  # norm 5
    norm = optimizer_step(torch.nn.ParameterList([w]), opt, grad_clip=1.0)
    assert norm == pytest.approx(5.0)  # √(9 + 16), exact in float32 (default rel 1e-6 for a norm computed otherwise)
    # the step used the clipped gradient (3, 4) / 5: clip_grad_norm_ scales by 1/(5 + 1e-6), 2e-7 relative short,
    # plus float32 rounding (6e-8): under the default rel 1e-6
    assert w.tolist() == pytest.approx([-0.6, -0.8])
    assert w.grad is None  # zeroed for the next step


def test_bf16_training_follows_fp32(tmp_path):
    """Precision must not change what is learned: a small model trained a few dozen steps by train() in float32 and
    under bfloat16 autocast (which every CPU runs, in software where it has no bf16 units) ends at the same loss."""
    # a 50-token phrase, again and again
    text = torch.randint(0, 30, (50,), generator=torch.Generator().manual_seed(1)).repeat(40)
    sampler = WindowSampler(text, 16, 8)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        cfg = TrainConfig(max_steps=40, lr=1e-2, warmup_steps=5, dtype=dtype, log_interval=1, eval_interval=1000,
                          checkpoint_interval=1000)
        train(small_model(), cfg, sampler.batch, lambda: [sampler.batch(999)], tmp_path / dtype, quiet=True)
        losses[dtype] = [r["loss/train"] for r in read_jsonl(tmp_path / dtype / "metrics.jsonl") if "loss/train" in r]
    f32, b16 = losses["float32"], losses["bfloat16"]
    assert f32 != b16  # the bfloat16 run really ran in bfloat16
    start32, end32 = sum(f32[:5]) / 5, sum(f32[-10:]) / 10
    start16, end16 = sum(b16[:5]) / 5, sum(b16[-10:]) / 10
    assert end32 < start32 - 1.0  # it learned the phrase
    # bfloat16 keeps 8 bits (2^-9 ≈ 2e-3 relative a rounding): a token's loss ~3.3 from bf16 products is ≲ 7e-3 off,
    # 0.02 over the first 5 steps; 40 Adam steps on bf16 gradients then take their own path: 0.05 of a loss that falls
    # by > 1 (1e-5 and 3e-4 seen: the errors average out over 128 tokens)
    assert abs(start16 - start32) < 0.02 and abs(end16 - end32) < 0.05

def test_fastest_dtype_leaves_the_model_as_it_was():
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    choice, seconds = fastest_dtype(model, [WindowSampler(TOKENS, 16, 4).batch(0)], repeats=1)
    assert choice in ("float32", "bfloat16") and set(seconds) == {"float32", "bfloat16"}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)
    # the rule: bfloat16 only when it is clearly faster
    assert choose_dtype("auto", "cpu", measure=lambda: "bfloat16") == "bfloat16"
    assert (choose_dtype("auto", "cpu") == "float32"
            and choose_dtype("float32", "cpu", measure=lambda: "bfloat16") == "float32")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        choose_dtype("fp8", "cpu")


@pytest.mark.grades("train.accumulate_gradients")
def test_accumulated_gradients_equal_one_big_batch():
    # 3 micro-batches with equally many targets: (1/3) Σ_k ∇L_k is the gradient of the big batch's mean loss
    model = small_model()
    x, y = WindowSampler(TOKENS, 16, 6).batch(0)  # (6, 16)
    y = y.clone()
    y[:, :4] = -100  # the same number of targets in every row, so in every micro-batch
    big = lm_loss(model, x, y)
    big.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    micro = [(x[i:i + 2], y[i:i + 2]) for i in range(0, 6, 2)]
    loss, tokens = accumulate_gradients(model, micro)
    # float32 means of 72 and of 3 × 24 positive terms ~3.4: ≤ (72 + 24)·6e-8 ≈ 6e-6 relative apart in the worst order
    # (abs 1e-5 was 3e-6 relative: under it); the last micro-batch's loss alone is 5e-3 relative off
    assert loss == pytest.approx(big.item(), rel=1e-5)
    assert tokens == 6 * 12
    # a gradient element sums the terms of ≤ 96 rows, whose |·| add up to ≲ 0.13 (the tied lm_head; ≲ 0.05 elsewhere),
    # in another grouping: ≤ 96·6e-8·0.13 ≈ 7.5e-7, under atol 1e-6 (with allclose's rtol 1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[n], atol=1e-6), n
    accumulate_gradients(model, micro)  # a second call adds to .grad (the step is optimizer_step's job)
    # the same sums added once more onto the first: twice the bound above (atol 1e-6 was under it)
    assert torch.allclose(model.wte.weight.grad, 2 * expected["wte.weight"], atol=2e-6)


@pytest.mark.grades("data.WindowSampler.batch")
def test_window_sampler_targets_are_the_inputs_shifted_by_one():
    tokens = torch.arange(100)  # token i is i: a window starting at s is s, s+1, ...
    sampler = WindowSampler(tokens, context_length=8, batch_size=5, seed=3)
    x, y = sampler.batch(7)
    assert x.shape == y.shape == (5, 8)
    assert torch.equal(y, x + 1)  # the target of position t is token t+1
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(5, 7, dtype=torch.long))  # consecutive tokens
    assert int(x.min()) >= 0 and int(y.max()) <= 99  # windows inside the stream
    x2, y2 = sampler.batch(7)
    assert torch.equal(x, x2) and not torch.equal(x, sampler.batch(8)[0])  # a function of the step
    starts = torch.cat([sampler.batch(s)[0][:, 0] for s in range(200)])
    assert int(starts.max()) == 100 - 9  # the last window that fits is drawn too


def test_fused_adamw_and_pinned_copies_are_for_cuda_only():
    """On a CPU nothing changes: AdamW's default implementation, and batches handed on as they are (no copy); fused
    AdamW needs every parameter on CUDA."""
    from llm_from_scratch.train import fused_if_cuda, to_device

    model = small_model()
    assert fused_if_cuda(list(model.parameters())) == {}
    assert fused_if_cuda([torch.zeros(1, device="meta")]) == {}
    assert not configure_optimizer(model, TrainConfig()).defaults["fused"]
    x = torch.zeros(2, 3, dtype=torch.long)
    assert to_device(x, torch.device("cpu")) is x and to_device(x, "cpu") is x
