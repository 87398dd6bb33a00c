"""DPO, IPO and conservative DPO against numbers worked out by hand, and the sequence log-probs they rest on."""

import math

import pytest
import torch

from llm_from_scratch.dpo import (
    DPOConfig,
    concatenated_logps,
    dpo_loss,
    dpo_step,
    frozen_logps,
    preference_batch,
    preference_metrics,
    reference_logps,
)
from llm_from_scratch.model import GPT, GPTConfig, eval_mode
from llm_from_scratch.tokenizer import Tokenizer, encode_chat

# One pair: the policy raised the chosen response by 1 nat over the reference and lowered the rejected one by 1,
# so h = (−10 − (−11)) − (−12 − (−11)) = 2; with β = 0.1, βh = 0.2.
POLICY_C, POLICY_R, REF_C, REF_R = -10.0, -12.0, -11.0, -11.0


def one_pair(**kwargs):
    t = lambda x: torch.tensor([x])  # noqa: E731
    return dpo_loss(t(POLICY_C), t(POLICY_R), t(REF_C), t(REF_R), **kwargs)


# The hand-worked tests of dpo_loss: its float32 value against the float64 formula at pytest.approx's default rel 1e-6.
# The log-probs are small integers (exact), β·h and log σ each round once or twice (≤ 6e-8 relative each), the
# (1 − ε), ε weights once more: ≲ 3e-7 relative (~1e-7 seen). A 6-digit decimal written by hand: abs 1e-6 (≤ 5e-7 off).
@pytest.mark.grades("dpo.dpo_loss")
def test_dpo_loss_by_hand():
    losses, chosen, rejected = one_pair(beta=0.1)
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-0.2)))  # −log σ(0.2) = 0.598139
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.1)  # β (log π − log π_ref)


@pytest.mark.grades("dpo.dpo_loss")
def test_conservative_dpo_flips_each_label_with_probability_epsilon():
    losses, _, _ = one_pair(beta=0.1, label_smoothing=0.1)
    by_hand = 0.9 * math.log(1 + math.exp(-0.2)) + 0.1 * math.log(1 + math.exp(0.2))  # 0.9·0.598139 + 0.1·0.798139
    assert losses.item() == pytest.approx(by_hand) and by_hand == pytest.approx(0.618139, abs=1e-6)


@pytest.mark.grades("dpo.dpo_loss")
def test_beta_and_epsilon_away_from_their_defaults():
    losses, chosen, rejected = one_pair(beta=0.5, label_smoothing=0.2)  # βh = 1
    by_hand = 0.8 * math.log(1 + math.exp(-1)) + 0.2 * math.log(1 + math.exp(1))  # 0.8·0.313262 + 0.2·1.313262
    assert losses.item() == pytest.approx(by_hand) and by_hand == pytest.approx(0.513262, abs=1e-6)
    assert chosen.item() == pytest.approx(0.5) and rejected.item() == pytest.approx(-0.5)  # rewards scale with β
    ipo, _, _ = one_pair(beta=0.2, loss_type="ipo")
    assert ipo.item() == pytest.approx((2 - 2.5) ** 2)  # target margin 1/(2·0.2) = 2.5 nats: 0.25


@pytest.mark.grades("dpo.dpo_loss")
def test_ipo_is_the_squared_distance_to_a_target_margin():
    losses, _, _ = one_pair(beta=0.1, loss_type="ipo")
    assert losses.item() == pytest.approx((2 - 1 / (2 * 0.1)) ** 2)  # (2 − 5)² = 9
    at_target, _, _ = dpo_loss(torch.tensor([5.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]),
                               beta=0.1, loss_type="ipo")
    assert at_target.item() == 0.0  # IPO stops pushing at the margin 1/(2β); DPO never does


@pytest.mark.grades("dpo.dpo_loss")
def test_the_loss_is_stable_for_huge_margins_and_its_gradient_points_the_right_way():
    pc = torch.tensor([0.0, 0.0], requires_grad=True)
    pr = torch.tensor([-1e4, 1e4], requires_grad=True)
    ref = torch.zeros(2, requires_grad=True)
    losses, chosen, rejected = dpo_loss(pc, pr, ref, ref, beta=1.0)
    assert torch.isfinite(losses).all() and losses[0].item() == 0.0 and losses[1].item() == pytest.approx(1e4)
    losses.sum().backward()
    assert pc.grad[1] < 0 and pr.grad[1] > 0  # descending the loss raises the chosen, lowers the rejected
    assert ref.grad is None and not chosen.requires_grad and not rejected.requires_grad


def test_bad_arguments_are_refused():
    for kwargs in ({"loss_type": "hinge"}, {"beta": 0.0}, {"label_smoothing": 0.5}):
        with pytest.raises(ValueError):
            one_pair(**kwargs)


def test_metrics():
    m = preference_metrics(torch.tensor([0.3, -0.1]), torch.tensor([0.1, 0.2]), torch.tensor([-5.0, -7.0]),
                           torch.tensor([-6.0, -6.0]))
    # float32: the inputs ±1.5e-8 each, then two differences and a mean of 2 (≲ 5e-8 in all): abs 1e-7 of the
    # margin −0.05 (the default rel 1e-6 would be 5e-8); the chosen reward 0.1 the same way, ≲ 3e-8 (default rel)
    assert m["rewards/margins"] == pytest.approx(-0.05, abs=1e-7) and m["rewards/accuracies"] == 0.5
    assert m["rewards/chosen"] == pytest.approx(0.1) and m["logps/rejected"] == -6.0


# ----------------------------------------------------------------------------- sequence log-probs on a tiny GPT

TEXT = "Add 2 and 3. 5 Sort these words: cat, dog. cat, dog Once upon a time there was a kite. The end. " * 30
PAIRS = [{"prompt": "Add 2 and 3.", "chosen": "5", "rejected": "6 or so"},
         {"prompt": "Sort these words: dog, cat.", "chosen": "cat, dog", "rejected": "dog"},
         {"prompt": "Tell a story.", "chosen": "Once upon a time there was a kite. The end.", "rejected": "The end."}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT, 300)


def tiny_gpt(tok, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=32, dropout=0.0))


@pytest.mark.grades("dpo.concatenated_logps")
def test_concatenated_logps_are_sums_over_each_response_alone(tok):
    """One padded forward pass over chosen and rejected rows gives what scoring each response alone gives."""
    model = tiny_gpt(tok).eval()
    ids, mask, completion = preference_batch(tok, PAIRS)
    assert ids.shape[0] == 2 * len(PAIRS) and completion.shape == (ids.shape[0], ids.shape[1] - 1)
    chosen, rejected = concatenated_logps(model, ids, mask, completion)
    for side, got in (("chosen", chosen), ("rejected", rejected)):
        alone = []
        for p in PAIRS:  # the row alone, no padding: Σ over the response tokens and EOS of log softmax(logits)[token]
            row, n = encode_chat(tok, p["prompt"], p[side])
            logp = torch.log_softmax(model(torch.tensor([row]))[0], dim=-1)  # (T, V): position t predicts token t+1
            alone.append(sum(logp[t - 1, row[t]].item() for t in range(n, len(row))))
        # log-probs all < 0 (no cancellation): a float32 sum of ≤ 15 of them (≤ 15·6e-8 of |sum| ≲ 110) against a
        # float64 one, and a few ulp per token from the padded batch: ≲ 2e-6 relative, under allclose's rtol 1e-5
        assert torch.allclose(got, torch.tensor(alone), atol=1e-5)
    lengths = [len(tok.encode(p[side])) + 1 for side in ("chosen", "rejected") for p in PAIRS]  # the response + EOS
    assert completion.sum(1).tolist() == lengths


def test_precomputed_reference_logps_equal_the_live_ones(tok):
    reference = tiny_gpt(tok, seed=1)
    pairs = [PAIRS[2], PAIRS[0], PAIRS[1]]  # not in length order: the cache batches by length, then puts them back
    cached = reference_logps(reference, tok, pairs, batch_size=2)  # (N, 2), in batches of another shape
    with torch.no_grad(), eval_mode(reference):
        live = torch.stack(concatenated_logps(reference, *preference_batch(tok, pairs)), dim=1)
    # the cache's batches have other rows and another width: a few ulp per token (|logp| ≲ 8), ≤ 15 tokens summed in
    # float32 (≤ 15·6e-8 of |sum|, all terms < 0): ≲ 2e-6 relative, under allclose's rtol 1e-5 (equal here)
    assert cached.shape == (3, 2) and torch.allclose(cached, live, atol=1e-5)


def test_dpo_steps_raise_the_preference_margin_of_a_tiny_gpt(tok):
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 0)
    ref = reference_logps(reference, tok, PAIRS)
    batch = preference_batch(tok, PAIRS)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    margins = []
    for _ in range(15):
        chosen, rejected = concatenated_logps(policy, *batch)
        losses, rc, rr = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=0.1)
        margins.append((rc - rr).mean().item())
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
    # the policy starts as the reference: the same weights on the same batch (the cache's one batch is PAIRS, already
    # in length order), so the same floats and a margin of 0 exactly
    assert margins[0] == 0.0 and margins[-1] > 0.5


@pytest.mark.grades("dpo.concatenated_logps")
def test_padding_on_both_sides_counts_only_the_response_tokens(tok):
    """Rows built by hand with two pads on the left and at least three on the right, and a completion mask marking
    each response: the sums of the response's log-probs added up by hand on the unpadded row."""
    model = tiny_gpt(tok).eval()
    rows = [encode_chat(tok, p["prompt"], p[side]) for side in ("chosen", "rejected") for p in PAIRS[:1]]
    pad, T = tok.pad_id, 2 + max(len(row) for row, _ in rows) + 3
    ids, mask, completion = [], [], []
    for row, n in rows:
        right = T - 2 - len(row)
        ids.append([pad, pad] + row + [pad] * right)
        mask.append([0, 0] + [1] * len(row) + [0] * right)
        completion.append([0] * (2 + n - 1) + [1] * (len(row) - n) + [0] * right)  # (T-1,): column t scores token t+1
    ids, mask, completion = torch.tensor(ids), torch.tensor(mask), torch.tensor(completion)
    chosen, rejected = concatenated_logps(model, ids, mask, completion)
    for (row, n), got in zip(rows, (chosen, rejected)):
        logp = torch.log_softmax(model(torch.tensor([row]))[0], dim=-1)
        by_hand = sum(logp[t - 1, row[t]].item() for t in range(n, len(row)))  # the response tokens and EOS
        # log-probs all < 0: a float32 sum of a few (≤ n·6e-8 of |sum| ~ 40) against a float64 one, plus a few ulp per
        # token from the padded row: relative, ≲ 2e-6 (abs 1e-5 was 2.5e-7 of 40, under the worst case)
        assert got.item() == pytest.approx(by_hand, rel=1e-5)


def test_at_step_zero_the_loss_is_log_two_and_every_margin_is_zero(tok):
    policy, reference = tiny_gpt(tok, 3), tiny_gpt(tok, 3)
    batch = preference_batch(tok, PAIRS)
    ref_c, ref_r = frozen_logps(reference, *batch)
    m = dpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), batch, ref_c, ref_r, DPOConfig(beta=0.3))
    # policy and reference: the same weights on the same batch, the same floats, so h = 0 exactly; the float32
    # −log σ(0) is log 2 to an ulp or two (6e-8 each)
    assert m["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert m["rewards/margins"] == 0.0 and m["rewards/chosen"] == 0.0  # β·0 exactly
    assert m["grad_norm"] > 0  # the gradient is not zero at h = 0: σ(0) = 1/2 pushes the margin up


@pytest.mark.parametrize("cfg", [DPOConfig(), DPOConfig(beta=0.3, label_smoothing=0.1), DPOConfig(loss_type="ipo")])
def test_cached_and_live_reference_train_the_same_policy(tok, cfg):
    """Three steps with the reference's log-probs cached before training, three with a live reference model: the
    same losses, metrics and weights."""
    runs = []
    for cached in (True, False):
        policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 0)
        cache = reference_logps(reference, tok, PAIRS) if cached else None
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        history = []
        for step in range(3):
            batch = preference_batch(tok, PAIRS[step % 2:])
            rows = torch.arange(step % 2, len(PAIRS))
            ref_c, ref_r = (cache[rows, 0], cache[rows, 1]) if cached else frozen_logps(reference, *batch)
            history.append(dpo_step(policy, opt, batch, ref_c, ref_r, cfg))
        runs.append((history, policy))
    (h_cached, p_cached), (h_live, p_live) = runs
    # one computation: the cache is the live reference's floats (steps 0 and 2: the same batch, the cache's one batch
    # being PAIRS in length order; step 1: the same rows at the same width, and a row's forward pass does not depend on
    # the others), and the policies' steps are alike. Equal bit for bit; a tolerance could not stand in for it: AdamW
    # moves a weight by ±lr whatever its gradient's size, and IPO's loss is 2|h − 1/(2β)| ≈ 10 times h's last bits
    for a, b in zip(h_cached, h_live):
        assert a == b
    assert abs(h_cached[-1]["rewards/margins"]) > 1e-4  # the steps did move the policy (~1 after two steps)
    for pa, pb in zip(p_cached.parameters(), p_live.parameters()):
        assert torch.equal(pa, pb)


def test_a_step_descends_the_mean_of_the_pair_losses(tok):
    """dpo_step's gradient is that of the mean pair loss, worked out here on a copy of the policy: the same norm
    (reported before clipping; the clip is too large to act) and the same plain SGD step."""
    batch = preference_batch(tok, PAIRS)
    ref_c, ref_r = frozen_logps(tiny_gpt(tok, 1), *batch)
    by_hand = tiny_gpt(tok, 0)
    chosen, rejected = concatenated_logps(by_hand, *batch)
    losses, _, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.3)
    losses.mean().backward()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in by_hand.parameters())).item()
    policy = tiny_gpt(tok, 0)
    m = dpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.1), batch, ref_c, ref_r,
                 DPOConfig(beta=0.3, max_grad_norm=1e6))
    assert m["loss"] == losses.mean().item()  # the same model, batch and ops: the same float
    # the same gradients, their norm in two orders (per-tensor norms then their norm, or one sum of squares): float32
    # sums of ~3e4 positive terms in cascades (≲ log2(3e4)·6e-8 ≈ 1e-6 relative; 7e-8 seen)
    assert norm > 0 and m["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # SGD's p − 0.1·g (the clip's factor is 1.0 exactly) in one op, against two roundings here: ≤ 2 ulp of |p| ≲ 1
    for p, q in zip(policy.parameters(), by_hand.parameters()):
        torch.testing.assert_close(p, q.detach() - 0.1 * q.grad, atol=1e-6, rtol=1e-5)


def test_sampled_pairs_take_the_best_and_the_worst_story_and_label_them_with_bradley_terry_noise(tok, monkeypatch):
    """dpo.sampled_pairs with the sampling and the gold reward replaced by known ones: each prompt's best story
    against its worst, ties and special tokens dropped, and the better story chosen with probability σ(8 Δgold)."""
    import llm_from_scratch.dpo as dpo

    golds = {"great": 0.9, "good": 0.6, "poor": 0.2, "same": 0.5}
    k = 4
    stories = {"a": ["good", "poor", "great", "great"],  # best: the first "great"; worst: "poor"
               "tie": ["same", "same", "same", "same"],  # every story scores the same: no pair
               "special": ["great", "bad <|eos|> text", "poor", "poor"]}  # a sampled special token is not text

    def fake_answer(model, tok_, prompts, max_new_tokens, temperature, generator):
        return [(s, None) for p in dict.fromkeys(prompts) for s in stories[p.split(":")[0]]]

    monkeypatch.setattr(dpo, "answer", fake_answer)
    monkeypatch.setattr(dpo, "story_reward", lambda spec, text: golds[text])
    prompts = [{"prompt": name, "spec": {}} for name in stories]
    pairs = dpo.sampled_pairs(tiny_gpt(tok), tok, prompts, k, 1.0, 8, seed=0)
    assert [p["prompt"] for p in pairs] == ["a", "special"]
    for p in pairs:
        assert {p["chosen"], p["rejected"]} == {"great", "poor"}
        # the same float64 expression as preferences.sigmoid(BT_BETA · Δ), BT_BETA = 8.0: the same float
        assert p["p_chosen"] == 1 / (1 + math.exp(-8 * (p["gold_chosen"] - p["gold_rejected"])))
        assert golds[p["chosen"]] == p["gold_chosen"]

    # the labeller's noise: over many prompts the better story is chosen σ(8 · 0.7) = 0.9963 of the time, the worse
    # 0.0037; with Δ = 0.1 (good 0.6 vs same 0.5) σ(0.8) = 0.690 of the time: 2,000 prompts put it within ±3 s.e.
    stories.update({f"n{i}": ["good", "same", "same", "same"] for i in range(2000)})
    many = dpo.sampled_pairs(tiny_gpt(tok), tok, [{"prompt": f"n{i}", "spec": {}} for i in range(2000)], k, 1.0, 8,
                             seed=3)
    p = 1 / (1 + math.exp(-0.8))
    share = sum(r["chosen"] == "good" for r in many) / len(many)
    assert abs(share - p) < 3 * math.sqrt(p * (1 - p) / len(many)), share
