"""DPO, IPO and conservative DPO against numbers worked out by hand, and the sequence log-probs they rest on."""

import math

import pytest
import torch

from llm_from_scratch.dpo import concatenated_logps, dpo_loss, preference_batch, preference_metrics, reference_logps
from llm_from_scratch.model import GPT, GPTConfig, eval_mode
from llm_from_scratch.tokenizer import Tokenizer, encode_chat

# One pair: the policy raised the chosen response by 1 nat over the reference and lowered the rejected one by 1,
# so h = (−10 − (−11)) − (−12 − (−11)) = 2; with β = 0.1, βh = 0.2.
POLICY_C, POLICY_R, REF_C, REF_R = -10.0, -12.0, -11.0, -11.0


def one_pair(**kwargs):
    t = lambda x: torch.tensor([x])  # noqa: E731
    return dpo_loss(t(POLICY_C), t(POLICY_R), t(REF_C), t(REF_R), **kwargs)


def test_dpo_loss_by_hand():
    losses, chosen, rejected = one_pair(beta=0.1)
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-0.2)))  # −log σ(0.2) = 0.598139
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.1)  # β (log π − log π_ref)


def test_conservative_dpo_flips_each_label_with_probability_epsilon():
    losses, _, _ = one_pair(beta=0.1, label_smoothing=0.1)
    by_hand = 0.9 * math.log(1 + math.exp(-0.2)) + 0.1 * math.log(1 + math.exp(0.2))  # 0.9·0.598139 + 0.1·0.798139
    assert losses.item() == pytest.approx(by_hand) and by_hand == pytest.approx(0.618139, abs=1e-6)


def test_ipo_is_the_squared_distance_to_a_target_margin():
    losses, _, _ = one_pair(beta=0.1, loss_type="ipo")
    assert losses.item() == pytest.approx((2 - 1 / (2 * 0.1)) ** 2)  # (2 − 5)² = 9
    at_target, _, _ = dpo_loss(torch.tensor([5.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]),
                               beta=0.1, loss_type="ipo")
    assert at_target.item() == 0.0  # IPO stops pushing at the margin 1/(2β); DPO never does


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
    assert m["rewards/margins"] == pytest.approx(-0.05) and m["rewards/accuracies"] == 0.5
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
        assert torch.allclose(got, torch.tensor(alone), atol=1e-5)
    lengths = [len(tok.encode(p[side])) + 1 for side in ("chosen", "rejected") for p in PAIRS]  # the response + EOS
    assert completion.sum(1).tolist() == lengths


def test_precomputed_reference_logps_equal_the_live_ones(tok):
    reference = tiny_gpt(tok, seed=1)
    cached = reference_logps(reference, tok, PAIRS, batch_size=2)  # (N, 2), in batches of another shape
    with torch.no_grad(), eval_mode(reference):
        live = torch.stack(concatenated_logps(reference, *preference_batch(tok, PAIRS)), dim=1)
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
    assert margins[0] == pytest.approx(0.0, abs=1e-5) and margins[-1] > 0.5  # the policy starts as the reference
