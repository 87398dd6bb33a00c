"""The shared RL math of chapter 7, against numbers worked out by hand or from explicit distributions."""

import copy
import math

import pytest
import torch

from llm_from_scratch.data import sft_collate
from llm_from_scratch.generation import sequence_logprobs
from llm_from_scratch.model import GPT, GPTConfig, eval_mode
from llm_from_scratch.policy_gradient import (
    ALGOS,
    MovingAverageBaseline,
    PGConfig,
    aggregate,
    clipped_policy_loss,
    grpo_advantages,
    informative_groups,
    kl_k1,
    kl_k3,
    masked_mean,
    masked_whiten,
    normalisation,
    pass_at_k,
    pg_update,
    policy_gradient_loss,
    ptx_loss,
    rloo_advantages,
    rollout,
)
from llm_from_scratch.tokenizer import Tokenizer, encode_chat


@pytest.mark.grades("policy_gradient.rloo_advantages")
def test_rloo_leaves_each_sample_out_of_its_own_baseline():
    # prompt A: rewards 1, 0, 0, 1 -> sample 0's baseline is mean(0, 0, 1) = 1/3, so its advantage is 2/3
    # prompt B: rewards 3, 1, 2, 2 -> sample 0's baseline is mean(1, 2, 2) = 5/3, so 4/3; sample 1: 1 - 7/3 = -4/3
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0.0, 0.0])
    # float32, values ~1: exact sums of 4 small integers, then a division by 3 and a subtraction, each rounded
    # (≲ 2 ulp, 2.4e-7 relative); allclose's rtol 1e-5 leaves room for a student's other order of the same ops
    assert torch.allclose(rloo_advantages(rewards, k=4), expected)
    # equivalently k/(k-1) times the deviation from the group mean; and a group of equal rewards carries no signal
    assert torch.allclose(rloo_advantages(rewards, 4),  # the same: two float32 routes, a few roundings each
                          4 / 3 * (rewards.view(2, 4) - rewards.view(2, 4).mean(1, True)).view(-1))
    assert torch.equal(rloo_advantages(torch.tensor([0.5, 0.5, 0.5]), 3), torch.zeros(3))


@pytest.mark.grades("policy_gradient.rloo_advantages")
def test_rloo_baseline_never_sees_the_sample_it_judges():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    changed = rewards.clone()
    changed[0] = 10.0  # sample 0's own reward moves its advantage one for one, not through its baseline
    # float32: 10 − 1/3 rounds by ≤ ½ ulp(10) = 4.8e-7, 1 − 1/3 by less, the difference once more: ≲ 1e-6, within
    # approx's default rel 1e-6 of 9 (9e-6)
    assert rloo_advantages(changed, 4)[0] - rloo_advantages(rewards, 4)[0] == pytest.approx(9.0)
    with pytest.raises(ValueError, match="k ≥ 2"):
        rloo_advantages(rewards, 1)
    with pytest.raises(ValueError, match="groups"):
        rloo_advantages(rewards, 3)


@pytest.mark.grades("policy_gradient.grpo_advantages")
def test_grpo_advantages_by_hand():
    # group 1: rewards 1, 0, 0, 1: mean 1/2, sample std sqrt(((1/2)^2 * 4) / 3) = sqrt(1/3)
    # group 2: all equal -> every advantage 0 (not nan), whatever the scale
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    std = math.sqrt(1 / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    adv = grpo_advantages(rewards, 4)
    # float32 std of 4 values (a sum of 4 exact squares, /3, sqrt) then a division: ≲ 4 roundings, 5e-7 relative
    assert torch.allclose(adv[:4], expected) and torch.equal(adv[4:], torch.zeros(4))
    # exact in float32 (means of 0s, 1s and 2s); allclose's default leaves room for a student's other order
    assert torch.allclose(grpo_advantages(rewards, 4, scale="none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(rewards, 4, scale="batch")


@pytest.mark.grades("policy_gradient.kl_k3")
def test_kl_estimators_on_explicit_distributions():
    # pi = (0.5, 0.3, 0.2), ref = (0.2, 0.3, 0.5): KL(pi||ref) = sum pi log(pi/ref), by hand
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    kl = (0.5 * math.log(0.5 / 0.2) + 0.3 * 0.0 + 0.2 * math.log(0.2 / 0.5))
    logp, ref_logp = pi.log(), ref.log()
    # both estimators are unbiased: their expectation under pi is the KL. Float32 against the float64 value: 4 logs
    # of size ≤ 1.6, each within ~1 ulp (1.2e-7), their differences weighted by 0.5 and 0.2, 2 additions: ≲ 2.5e-7
    # on a KL of 0.275, ~1e-6 relative in the worst case (rel 1e-6 had no margin), so 3e-6
    assert (pi * kl_k1(logp, ref_logp)).sum().item() == pytest.approx(kl, rel=3e-6)
    assert (pi * kl_k3(logp, ref_logp)).sum().item() == pytest.approx(kl, rel=3e-6)
    # k1 is negative where pi < ref; k3 never is; k3 by hand at the first token: ref/pi - 1 - log(ref/pi)
    assert kl_k1(logp, ref_logp)[2] < 0 and (kl_k3(logp, ref_logp) >= 0).all()
    # float32: d from 2 logs (≲ 2e-7), times |∂k3/∂d| = 0.6, plus expm1's and the sum's roundings: ≲ 2e-7 on 0.316
    assert kl_k3(logp, ref_logp)[0].item() == pytest.approx(0.4 - 1 - math.log(0.4), rel=3e-6)
    # both are exactly 0 where the policies agree
    assert torch.equal(kl_k1(logp, logp), torch.zeros(3)) and torch.equal(kl_k3(logp, logp), torch.zeros(3))


@pytest.mark.grades("policy_gradient.masked_mean")
def test_masked_means_ignore_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 0.0, -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # exact in float32 (sums of small integers, 10/5, 6/3, 4/2); the default tolerances leave room for a student's
    # other route to the same mean (a product by 1/n rounds)
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 3 + 4 + 0) / 5)
    assert torch.allclose(masked_mean(x, mask, dim=1), torch.tensor([2.0, 2.0]))
    # a row without a single real token (a completion cut to nothing) gives 0, not 0/0
    empty = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    assert masked_mean(x, empty, dim=1).tolist() == [1.5, 0.0]
    white = masked_whiten(x, mask)
    assert (white[mask == 0] == 0).all()
    # float32, 5 whitened values (±0.71, ±1.41, 0; Σ|w| = 4.2), each rounded once in the division: their sum of 0
    # is off by ≲ 5·u·4.2 = 1.3e-6, their mean by ≲ 3e-7
    assert masked_mean(white, mask).item() == pytest.approx(0.0, abs=1e-6)
    # sqrt, division, square, 4 additions, /5: ≲ 10 roundings of u = 6e-7 relative (eps = 1e-8 moves it by 5e-9)
    assert masked_mean(white ** 2, mask).item() == pytest.approx(1.0, rel=2e-6)


@pytest.mark.grades("policy_gradient.aggregate")
def test_aggregate_normalisations_by_hand():
    # two sequences, lengths 3 and 1; per-token values 1, 2, 3 and 10
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [10.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # exact in float32 (sums of small integers, divisions by 1, 2, 3, 4, 8 that come out even); the default rel 1e-6
    # leaves room for a student's other route (a product by 1/n rounds)
    assert aggregate(per_token, mask, "sum").item() == pytest.approx((6 + 10) / 2)
    assert aggregate(per_token, mask, "sequence").item() == pytest.approx((2 + 10) / 2)
    assert aggregate(per_token, mask, "token").item() == pytest.approx(16 / 4)
    assert aggregate(per_token, mask, "constant", constant=8).item() == pytest.approx((6 / 8 + 10 / 8) / 2)
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "constant")


@pytest.mark.grades("policy_gradient.aggregate")
def test_loss_types_by_hand():
    # B = 4 completions, T = 3 columns, max_new_tokens = 4 (not T: Dr. GRPO's constant is the length limit)
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -9.0], [-4.0, -9.0, -9.0], [-1.0, -1.0, -2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])  # lengths 3, 2, 1, 3 (9 tokens)
    adv = torch.tensor([1.0, -2.0, 0.5, -0.5])
    # per-token loss −A·logp on the mask: row 0 [1, 2, 3] (Σ 6, mean 2); row 1 [−1, −3] (Σ −4, mean −2);
    # row 2 [2] (Σ 2, mean 2); row 3 [−0.5, −0.5, −1] (Σ −2, mean −2/3)
    by_hand = {"grpo": (2 - 2 + 2 - 2 / 3) / 4,  # sequence level: the mean of the 4 per-row means = 1/3
               "dr_grpo": (6 / 4 - 4 / 4 + 2 / 4 - 2 / 4) / 4,  # constant level: Σ_t / 4 per row, mean of rows = 1/8
               "dapo": (6 - 4 + 2 - 2) / 9}  # token level: Σ over all 9 tokens / 9 = 2/9
    for loss_type, expected in by_hand.items():
        how = normalisation("rloo", loss_type)  # the loss type overrides the estimator's own aggregation
        # float32: the products and row sums are exact (halves and small integers), then 2/3 and a mean of 4 rows,
        # or 2/9, round: ≲ 3 roundings of values ≤ 4, 2e-7 relative to 1/3
        assert policy_gradient_loss(logp, adv, mask, how, constant=4).item() == pytest.approx(expected), loss_type
    # without a loss type each estimator keeps its own: RLOO Σ_t then the mean over rows, (6 − 4 + 2 − 2) / 4
    # (exact in float32; the default rel 1e-6 for a student's other route)
    assert normalisation("rloo") == normalisation("reinforce") == "sum"
    assert policy_gradient_loss(logp, adv, mask, normalisation("rloo"), constant=4).item() == pytest.approx(0.5)
    assert (normalisation("grpo"), normalisation("dr-grpo")) == ("sequence", "constant")
    assert normalisation("grpo", "dapo") == "token" and normalisation("reinforce", "dr_grpo") == "constant"
    with pytest.raises(ValueError, match="loss_type"):
        normalisation("grpo", "bnpo")


@pytest.mark.grades("policy_gradient.informative_groups")
def test_informative_groups_by_hand():
    # k = 2: groups (1, 1) all equal, (0, 1) not, (0, 0) all equal -> only the middle group's two rows are kept
    keep = informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), k=2)
    assert keep.tolist() == [False, False, True, True, False, False]
    # k = 3: each verdict covers its own 3 consecutive rows
    keep = informative_groups(torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0, 1.0, 0.2, 0.2, 0.7]), k=3)
    assert keep.tolist() == [False] * 3 + [True] * 6
    with pytest.raises(ValueError, match="groups"):
        informative_groups(torch.tensor([1.0, 0.0, 1.0]), k=2)
    with pytest.raises(ValueError, match="groups"):
        informative_groups(torch.tensor([1.0, 0.0]), k=1)


def test_advantages_are_constants_of_the_surrogate():
    # loss = mean over the 2 sequences of Σ_t −A_i log π_it, so ∂loss/∂logp_it = −A_i / 2, by hand;
    # the advantages get no gradient even when they come out of a graph (a learned baseline, a reward model)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0], requires_grad=True)
    loss = policy_gradient_loss(logp, adv, torch.ones(2, 2))
    # float32: −0.7 and the row sum −2.4 round (≲ 1.5e-7), and 3 − 2.4 cancels to 0.6: ≲ 3e-7 relative
    assert loss.item() == pytest.approx((1.0 * 3.0 - 2.0 * 1.2) / 2)
    loss.backward()
    assert adv.grad is None
    assert torch.equal(logp.grad, torch.tensor([[-0.5, -0.5], [1.0, 1.0]]))  # exact: −A_i (integers) times 1 / 2


def test_policy_gradient_step_moves_probability_to_the_rewarded_token():
    """A one-step 'language model' over two tokens; token 1 is rewarded. Sampled with RLOO, a few steps of the
    surrogate's gradient raise p(token 1)."""
    torch.manual_seed(0)
    logits = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    for _ in range(20):
        tokens = torch.multinomial(torch.softmax(logits.detach(), -1), 8, replacement=True)  # 2 prompts x 4 samples
        rewards = (tokens == 1).float()
        logp = torch.log_softmax(logits, -1)[tokens].unsqueeze(1)  # (8, 1): one token per completion
        loss = policy_gradient_loss(logp, rloo_advantages(rewards, 4), torch.ones(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.softmax(logits, -1)[1] > 0.9


@pytest.mark.grades("policy_gradient.clipped_policy_loss")
def test_clipped_loss_ratio_is_one_on_the_first_epoch_and_clips_after():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, -2.0])
    # old log-probs are constants, even when the same tensor
    loss, clipfrac = clipped_policy_loss(logp, logp, adv, mask)
    # ratio 1 everywhere: the loss is -mean(A), its gradient the plain policy gradient, nothing clipped. Exact in
    # float32 (exp(0) = 1, integers and halves); the default tolerances leave room for a student's other route
    assert loss.item() == pytest.approx(-(1.0 - 2.0) / 2) and clipfrac.item() == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5], [1.0, 1.0]]) / 2)
    # the policy moved: ratio e^0.5 ≈ 1.65 on row 0 (A > 0) is clipped to 1.2, and its gradient is cut
    moved = (logp.detach() + torch.tensor([[0.5, 0.5], [0.0, 0.0]])).requires_grad_()
    loss, clipfrac = clipped_policy_loss(moved, logp.detach(), adv, mask)
    loss.backward()
    assert clipfrac.item() == pytest.approx(0.5) and torch.equal(moved.grad[0], torch.zeros(2))  # 2 of 4: exact
    assert loss.item() == pytest.approx((-1.2 * 1.0 + 2.0) / 2)  # float32: only 1.2 rounds (4e-8), the rest exact
    # a step that went too far the wrong way is not forgiven: ratio e^0.5 with A < 0 keeps the unclipped term
    # -ρA = 1.65·2 (the larger loss) and its gradient; ratio e^-0.5 with A > 0 keeps ρA = 0.61 likewise
    worse = (logp.detach() + torch.tensor([[-0.5, -0.5], [0.5, 0.5]])).requires_grad_()
    loss, clipfrac = clipped_policy_loss(worse, logp.detach(), adv, mask)
    # float32: the log-ratios ±0.5 are exact, exp is within ~1 ulp (1.2e-7 at 1.65), 3 roundings: ≲ 5e-7 on 2.69
    assert loss.item() == pytest.approx((-math.exp(-0.5) * 1.0 + math.exp(0.5) * 2.0) / 2, rel=1e-6)
    assert clipfrac.item() == 0.0


def test_moving_average_baseline_uses_only_past_batches():
    b = MovingAverageBaseline(decay=0.5)
    assert torch.equal(b.advantages(torch.tensor([1.0, 3.0])), torch.tensor([1.0, 3.0]))  # no past: baseline 0
    assert b.value == 2.0
    assert torch.equal(b.advantages(torch.tensor([0.0, 4.0])), torch.tensor([-2.0, 2.0]))  # baseline 2, from before
    assert b.value == 0.5 * 2.0 + 0.5 * 2.0  # exact: halves of means of small integers


# ----------------------------------------------------------------------------- rollouts and the update on a tiny GPT

TEXT = "Add 2 and 3. 5 Sort these words: cat, dog. cat, dog Once upon a time there was a kite. The end. " * 30


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT, 300)


def tiny_gpt(tok, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=32, dropout=0.1))


def test_rollout_masks_completions_and_scores_each_row_as_alone(tok):
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1)
    prompts = ["Add 2 and 3.", "Sort these words: cat, dog, kite."]  # different lengths: left padding
    ro = rollout(policy, reference, tok, prompts, k=3, reward_fn=lambda p, c: [float(len(x)) for x in c],
                 max_new_tokens=8, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert ro.sequences.shape[0] == 6 and ro.prompts == [prompts[0]] * 3 + [prompts[1]] * 3
    assert torch.equal(ro.rewards, torch.tensor([float(len(c)) for c in ro.completions]))
    for i in range(6):
        completion = ro.sequences[i][torch.cat([torch.zeros(1, dtype=torch.long), ro.mask[i]]).bool()].tolist()
        assert len(completion) == ro.mask[i].sum() <= 8  # the mask covers the completion, EOS included, nothing after
        if tok.eos_id in completion:
            assert completion.index(tok.eos_id) == len(completion) - 1 and ro.ended[i]
        alone = torch.tensor([encode_chat(tok, ro.prompts[i])[0] + completion])  # the row without any padding
        with eval_mode(reference):
            expected = sequence_logprobs(reference, alone, temperature=0.7)[0, -len(completion):]  # as sampled
        # float32, another batch shape (6 left-padded rows, 1 row alone): the forward's sums (≤ 128 terms, 300 in
        # the softmax) add in other orders; log-probs of ~6 (ulp 4.8e-7) move by an ulp or two. atol 1e-5 is 20 ulp
        # (allclose's rtol 1e-5 adds 6e-5)
        assert torch.allclose(ro.ref_logp[i][ro.mask[i].bool()], expected, atol=1e-5)
        assert (ro.ref_logp[i][~ro.mask[i].bool()] == 0).all()


def test_missing_eos_is_penalised(tok):
    policy = tiny_gpt(tok)
    ro = rollout(policy, policy, tok, ["Add 2 and 3."], k=4, reward_fn=lambda p, c: [1.0] * len(c), max_new_tokens=2,
                 missing_eos_penalty=0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ro.rewards, torch.where(ro.ended, 1.0, 0.5)) and torch.equal(ro.gold, torch.ones(4))


@pytest.mark.parametrize("algo", ALGOS)
def test_update_trains_the_policy_and_never_the_reference(tok, algo):
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 0)
    ref_before = [p.clone() for p in reference.parameters()]
    pol_before = [p.clone() for p in policy.parameters()]
    cfg = PGConfig(algo=algo, k=4, inner_epochs=2 if "grpo" in algo else 1, max_new_tokens=6,
                   kl_in="loss" if "grpo" in algo else "reward")
    ro = rollout(policy, reference, tok, ["Add 2 and 3.", "Sort these words: cat, dog."], k=4,
                 reward_fn=lambda p, c: [float(len(x) % 3) for x in c], max_new_tokens=6,
                 generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    metrics = pg_update(policy, opt, ro, cfg, MovingAverageBaseline())
    assert all(p.grad is None for p in reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ref_before, reference.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(pol_before, policy.parameters()))
    assert policy.training  # the update ran with dropout off and gave the mode back
    # policy == reference when it sampled: the same weights, rows and shapes, so the same log-probs bit for bit
    assert metrics["objective/kl"] == 0.0
    assert {"reward", "gold/reward", "objective/kl_k3", "objective/entropy", "completions/clipped_ratio",
            "frac_reward_zero_std"} <= set(metrics)


def test_rloo_steps_move_a_tiny_gpt_toward_the_rewarded_answer(tok):
    """Reward 1 when the one-token completion starts with a space: a few RLOO steps raise that probability."""
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 0)
    prompt = "Sort these words: cat, dog."
    spaced = torch.tensor([tok.decode([i]).startswith(" ") for i in range(tok.vocab_size)])  # (V,) rewarded tokens

    def p_rewarded():
        with eval_mode(policy), torch.no_grad():
            return torch.softmax(policy(torch.tensor([encode_chat(tok, prompt)[0]]))[0, -1], -1)[spaced].sum().item()

    before = p_rewarded()
    opt = torch.optim.AdamW(policy.parameters(), lr=2e-2, weight_decay=0.0)
    cfg, g = PGConfig(algo="rloo", k=16, beta=0.0, max_new_tokens=1), torch.Generator().manual_seed(0)
    for _ in range(15):
        ro = rollout(policy, reference, tok, [prompt], k=16, max_new_tokens=1, generator=g,
                     reward_fn=lambda p, c: [float(x.startswith(" ")) for x in c])
        pg_update(policy, opt, ro, cfg)
    assert 0.05 < before < 0.8 and p_rewarded() > before + 0.15


def test_pass_at_k_by_hand():
    # 4 samples, 1 right: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6; all right or none right
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)  # pass@1 is the share of right samples
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_kl_in_the_reward_is_subtracted_from_it(tok):
    """kl_in="reward": each sequence is scored r − β·Σ_t k1, with Σ_t k1 computed here on its own from the policy's
    log-probs at the sampling temperature. The policy differs from the reference, so the sign of β·Σ k1 shows."""
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1)
    ro = rollout(policy, reference, tok, ["Add 2 and 3.", "Sort these words: cat, dog."], k=4,
                 reward_fn=lambda p, c: [float(len(x) % 3) for x in c], max_new_tokens=6, temperature=0.7,
                 generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), eval_mode(policy):
        logp = sequence_logprobs(policy, ro.sequences, ro.attention_mask, 0.7) * ro.mask
    kl = ((logp - ro.ref_logp) * ro.mask).sum(1)  # (B,) Σ_t k1 per completion
    cfg = PGConfig(algo="rloo", k=4, beta=1.0, kl_in="reward", max_new_tokens=6)
    metrics = pg_update(policy, torch.optim.SGD(policy.parameters(), lr=0.0), ro, cfg)
    # exact: the update runs the same forward pass on the same rows (autograd on changes no kernel), and the same
    # masked sum over the same (B, T-1) shape, in the same order
    assert kl.mean().item() > 0.05 and metrics["objective/kl"] == kl.mean().item()
    score = ro.rewards - 1.0 * kl  # (B,) what the advantages are computed from
    assert metrics["reward"] == score.mean().item()
    assert metrics["reward_std"] == score.std().item()
    assert metrics["proxy/reward"] == ro.rewards.mean().item()


def test_grpo_kl_in_the_loss_pulls_the_policy_back_to_the_reference(tok):
    """kl_in="loss" with every reward equal: the advantages are 0, so the only gradient is that of β·k3. One
    update must move the weights and lower the k3 KL to the reference on the same samples."""
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1)
    ro = rollout(policy, reference, tok, ["Add 2 and 3.", "Sort these words: cat, dog."], k=4,
                 reward_fn=lambda p, c: [1.0] * len(c), max_new_tokens=6, temperature=0.7,
                 generator=torch.Generator().manual_seed(0))

    def k3():
        with torch.no_grad(), eval_mode(policy):
            logp = sequence_logprobs(policy, ro.sequences, ro.attention_mask, ro.temperature) * ro.mask
        return (kl_k3(logp, ro.ref_logp) * ro.mask).sum(1).mean().item()

    before, weights = k3(), [p.clone() for p in policy.parameters()]
    cfg = PGConfig(algo="grpo", k=4, beta=0.5, kl_in="loss", inner_epochs=1, max_new_tokens=6)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)  # no decay: only a gradient moves it
    metrics = pg_update(policy, opt, ro, cfg)
    assert metrics["objective/kl_k3"] == before and before > 0.1  # exact: k3() is the update's computation, as above
    assert metrics["train/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(weights, policy.parameters()))
    assert k3() < 0.9 * before


def test_the_update_scores_the_samples_at_their_temperature(tok):
    """Sampled at temperature 0.7 by a policy equal to the reference: the reference's log-probs are at 0.7, so the
    policy's must be too, and the KL between them is 0 (at temperature 1 it would not be)."""
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 0)
    ro = rollout(policy, reference, tok, ["Add 2 and 3.", "Sort these words: cat, dog."], k=4,
                 reward_fn=lambda p, c: [float(len(x) % 3) for x in c], max_new_tokens=6, temperature=0.7,
                 generator=torch.Generator().manual_seed(0))
    metrics = pg_update(policy, torch.optim.SGD(policy.parameters(), lr=0.0), ro,
                        PGConfig(algo="rloo", k=4, beta=0.1, max_new_tokens=6))
    assert ro.temperature == 0.7
    # exact: policy and reference are equal weights run on the same rows, so log π − log π_ref is 0 on every token
    assert metrics["objective/kl"] == 0.0
    assert metrics["objective/kl_k3"] == 0.0  # expm1(−0) + 0


# ----------------------------------------------------------------------------- TRL's GRPO knobs:
# loss_type and DAPO's filter

def two_prompts(tok, policy, reference, reward_fn):
    """4 samples of each of two prompts (rows 0-3 and 4-7), at T = 0.7, the same draws every call."""
    return rollout(policy, reference, tok, ["Add 2 and 3.", "Sort these words: cat, dog."], k=4, reward_fn=reward_fn,
                   max_new_tokens=6, temperature=0.7, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_the_update_sums_by_its_loss_type_over_the_rows_the_filter_keeps(tok, loss_type):
    """RLOO's loss on a real rollout, each loss type written out here on its own. Prompt 0's samples all get reward 1
    (advantage 0: the filter drops them), prompt 1's get 0, 1, 0, 1. Without the filter prompt 0's rows still count in
    the denominator (its 4 sequences, or its tokens); with it they do not."""
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1)
    ro = two_prompts(tok, policy, reference, lambda p, c: [1.0 if i < 4 else float(i % 2) for i in range(len(c))])
    assert ro.rewards.tolist() == [1, 1, 1, 1, 0, 1, 0, 1] and ro.mask.shape[1] != 6  # T-1 columns, not max_new_tokens
    adv = rloo_advantages(ro.rewards, 4)  # β = 0: the rewards themselves; prompt 0's advantages are 0

    def by_hand(rows):
        with torch.no_grad(), eval_mode(policy):  # the rows the update keeps, as one batch: its own forward pass
            logp = sequence_logprobs(policy, ro.sequences[rows], ro.attention_mask[rows], 0.7) * ro.mask[rows]
        per_token, m = -adv[rows, None] * logp * ro.mask[rows], ro.mask[rows].float()  # (n, T-1)
        if loss_type == "grpo":  # each row's mean over its own tokens, then the mean over rows
            return (per_token.sum(1) / m.sum(1)).mean()
        if loss_type == "dr_grpo":  # each row's sum over max_new_tokens = 6, then the mean over rows
            return (per_token.sum(1) / 6).mean()
        return per_token.sum() / m.sum()  # dapo: the sum over every token of the rows, over their number

    for filter_groups, rows in ((False, slice(0, 8)), (True, slice(4, 8))):
        cfg = PGConfig(algo="rloo", k=4, beta=0.0, max_new_tokens=6, loss_type=loss_type, filter_groups=filter_groups)
        metrics = pg_update(policy, torch.optim.SGD(policy.parameters(), lr=0.0), ro, cfg)
        # exact: the same forward pass on the same rows, and the same products and sums over the same shapes
        assert metrics["loss/policy"] == by_hand(rows).item(), filter_groups
        assert metrics["train/rows"] == (4 if filter_groups else 8) and metrics["train/skipped_step"] == 0
        # the logged metrics describe the whole batch, filtered rows included
        assert metrics["frac_reward_zero_std"] == 0.5 and metrics["proxy/reward"] == 0.75  # 6/8: exact


def test_filter_groups_skips_the_step_when_every_group_is_equal(tok):
    """Every reward 1: the filter leaves no row, and no optimizer step is taken (the weights and AdamW's state stay
    as they were), though the KL term would move them: in the loss, and in the reward, where it makes the scores
    unequal (the filter reads the raw rewards, not the scores). Without the filter the same batch moves them."""
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1)
    ro = two_prompts(tok, policy, reference, lambda p, c: [1.0] * len(c))
    weights = [p.clone() for p in policy.parameters()]
    for kl_in in ("loss", "reward"):
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)
        cfg = PGConfig(algo="grpo", k=4, beta=0.5, kl_in=kl_in, inner_epochs=2, max_new_tokens=6, filter_groups=True)
        metrics = pg_update(policy, opt, ro, cfg)
        assert all(torch.equal(a, b) for a, b in zip(weights, policy.parameters())), kl_in
        assert not opt.state and all(p.grad is None for p in policy.parameters())
        assert metrics["train/skipped_step"] == 1 and metrics["train/rows"] == 0 and "loss/policy" not in metrics
        assert metrics["frac_reward_zero_std"] == 1.0 and metrics["objective/kl"] > 0.05  # still logged
    cfg = PGConfig(algo="grpo", k=4, beta=0.5, kl_in="reward", inner_epochs=2, max_new_tokens=6)
    metrics = pg_update(policy, opt, ro, cfg)
    assert metrics["train/skipped_step"] == 0 and metrics["train/rows"] == 8
    assert any(not torch.equal(a, b) for a, b in zip(weights, policy.parameters()))


# ----------------------------------------------------------------------------
# PPO-ptx: the SFT loss mixed into the update


def sft_batch(tok):
    """Two demonstrations as SFT trains on them: the loss on the responses only (-100 on the prompt and padding)."""
    rows = [encode_chat(tok, "Add 2 and 3.", "2 plus 3: 2 plus 0 is 2. 2 plus 3 is 5."),
            encode_chat(tok, "Sort these words: kite, cat.", "cat, kite")]
    return sft_collate(rows, tok.pad_id)


def sft_loss_by_hand(model, x, y):
    """−1/|R| Σ_{(b, t): y[b, t] ≠ −100} log softmax(logits[b, t])[y[b, t]], one position at a time, in float64."""
    logits = model(x).double()
    terms = [torch.logsumexp(logits[b, t], 0) - logits[b, t, y[b, t]]
             for b in range(x.size(0)) for t in range(x.size(1)) if y[b, t] != -100]
    return torch.stack(terms).mean()


def test_ptx_loss_is_the_sft_loss_of_the_responses(tok):
    policy = tiny_gpt(tok)
    x, y = sft_batch(tok)
    assert (y == -100).any() and (y != -100).sum() > 10  # the prompts and the padding are left out
    with eval_mode(policy):
        # float32 log-softmax over 300 logits, mean of ~30 terms of ~6 nats, against float64: a few ulp (4.8e-7)
        # per term, rel 1e-5 leaves 20×; a loss over the prompt tokens too, or unshifted targets, moves it by > 1%
        assert ptx_loss(policy, (x, y)).item() == pytest.approx(sft_loss_by_hand(policy, x, y).item(), rel=1e-5)


@pytest.mark.parametrize("coef", [0.5, 3.0])
def test_ptx_mixes_gamma_times_the_sft_loss_into_the_update(tok, coef):
    """With SGD (lr 1, no clipping) an update is minus the gradient, so the update with γ > 0 minus the update
    without is −γ ∇(SFT loss), the hand-worked mixture L_RL + γ · L_SFT (InstructGPT's PPO-ptx)."""
    base, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1).requires_grad_(False)
    ro = rollout(base, reference, tok, ["Add 2 and 3.", "Sort these words: cat, dog."], k=4,
                 reward_fn=lambda p, c: [float(len(x) % 3) for x in c], max_new_tokens=6, temperature=0.7,
                 generator=torch.Generator().manual_seed(0))
    batch = sft_batch(tok)

    def updated(gamma):
        policy = copy.deepcopy(base)
        cfg = PGConfig(algo="rloo", k=4, max_new_tokens=6, temperature=0.7, grad_clip=0.0, ptx_coef=gamma)
        metrics = pg_update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), ro, cfg,
                            ptx_batch=batch if gamma else None)
        return [p.detach() for p in policy.parameters()], metrics

    (rl_only, plain), (mixed, metrics) = updated(0.0), updated(coef)
    hand = copy.deepcopy(base)
    with eval_mode(hand):
        loss = sft_loss_by_hand(hand, *batch)
        grads = torch.autograd.grad(loss, list(hand.parameters()), allow_unused=True)
    assert metrics["loss/ptx"] == pytest.approx(loss.item(), rel=1e-5)  # as above
    assert metrics["loss/policy"] == plain["loss/policy"]  # the policy loss is logged without the ptx term
    for a, b, g in zip(rl_only, mixed, grads):
        g = torch.zeros_like(a) if g is None else g.float()
        # each side a difference of float32 weights of |w| ≲ 1 (ulp ≤ 1.2e-7) plus a gradient summed in float32
        # against float64: atol 2e-6 and rtol 1e-4; a sign flipped or γ dropped misses by |γ ∇L| ≫ that
        assert torch.allclose(b - a, -coef * g, rtol=1e-4, atol=2e-6)
    assert any(g is not None and g.abs().max() > 1e-3 for g in grads)  # the test has something to see


def test_ptx_needs_its_batch(tok):
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1)
    ro = rollout(policy, reference, tok, ["Add 2 and 3."], k=2, reward_fn=lambda p, c: [1.0, 0.0], max_new_tokens=4,
                 generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="ptx_batch"):
        pg_update(policy, torch.optim.SGD(policy.parameters(), lr=0.1), ro, PGConfig(k=2, ptx_coef=1.0))
