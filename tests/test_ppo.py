"""PPO's pieces against numbers worked out by hand (chapter 8), and a PPO step on a tiny GPT."""

import copy

import pytest
import torch

from llm_from_scratch.data import sft_collate
from llm_from_scratch.generation import sequence_logprobs
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.policy_gradient import rollout
from llm_from_scratch.ppo import (
    AdaptiveKLController,
    FixedKLController,
    PolicyValue,
    PPOConfig,
    actor,
    clipped_value_loss,
    compute_gae,
    explained_variance,
    last_token_index,
    logprobs_and_values,
    make_optimizer,
    per_token_rewards,
    ppo_step,
    weights_held,
)
from llm_from_scratch.reward_model import RewardModel
from llm_from_scratch.tokenizer import Tokenizer, encode_chat

# A 4-token episode, γ = 0.9, λ = 0.8 (γλ = 0.72), worked right to left:
#   δ3 = 2 + 0.9·0   − 0.2 =  1.8      A3 = 1.8
#   δ2 = 0 + 0.9·0.2 − 0.3 = −0.12     A2 = −0.12 + 0.72·1.8     = 1.176
#   δ1 = 0 + 0.9·0.3 − 0.4 = −0.13     A1 = −0.13 + 0.72·1.176   = 0.71672
#   δ0 = 1 + 0.9·0.4 − 0.5 =  0.86     A0 =  0.86 + 0.72·0.71672 = 1.3760384
REWARDS = [1.0, 0.0, 0.0, 2.0]
VALUES = [0.5, 0.4, 0.3, 0.2]
ADVANTAGES = [1.3760384, 0.71672, 1.176, 1.8]
RETURNS = [a + v for a, v in zip(ADVANTAGES, VALUES)]


@pytest.mark.grades("ppo.compute_gae")
def test_gae_by_hand():
    adv, ret = compute_gae(torch.tensor([REWARDS]), torch.tensor([VALUES]), torch.ones(1, 4), gamma=0.9, lam=0.8)
    # float32 vs exact hand values: ≲ 20 ops on numbers ≤ 2.2, each rounding ≤ 1.3e-7 (≲ 3e-6); allclose's rtol 1e-5
    # of values ≥ 0.7 adds ≥ 7e-6 to atol
    assert torch.allclose(adv, torch.tensor([ADVANTAGES]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([RETURNS]), atol=1e-6)


@pytest.mark.grades("ppo.compute_gae")
def test_gae_limits_lambda_one_is_return_minus_value_and_zero_is_the_td_error():
    r, v, m = torch.tensor([REWARDS]), torch.tensor([VALUES]), torch.ones(1, 4)
    mc, _ = compute_gae(r, v, m, gamma=1.0, lam=1.0)
    # both: float32, a few ops on numbers ≤ 3 (≲ 5e-7) against allclose's default rtol 1e-5 of values ≥ 0.12
    assert torch.allclose(mc, torch.tensor([[3.0 - 0.5, 2.0 - 0.4, 2.0 - 0.3, 2.0 - 0.2]]))  # reward-to-go − V
    td, _ = compute_gae(r, v, m, gamma=0.9, lam=0.0)
    assert torch.allclose(td, torch.tensor([[0.86, -0.13, -0.12, 1.8]]))


@pytest.mark.grades("ppo.compute_gae")
def test_gae_of_padded_rows_equals_each_row_alone():
    # row 0: the episode after 2 prompt columns; row 1 (in the middle): a 2-token episode, then padding;
    # row 2: the episode right-padded. Values and rewards on padding are junk that must not leak in.
    junk = 9.0
    rewards = torch.tensor([[junk, junk] + REWARDS, [0.5, 1.0, junk, junk, junk, junk], REWARDS + [junk, junk]])
    values = torch.tensor([[junk, junk] + VALUES, [0.1, 0.2, junk, junk, junk, junk], VALUES + [junk, junk]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(adv[0, 2:], torch.tensor(ADVANTAGES), atol=1e-6)  # as in test_gae_by_hand
    assert torch.allclose(adv[2, :4], torch.tensor(ADVANTAGES), atol=1e-6)
    alone, _ = compute_gae(torch.tensor([[0.5, 1.0]]), torch.tensor([[0.1, 0.2]]), torch.ones(1, 2), gamma=0.9, lam=0.8)
    # the reference's elementwise ops give the same floats in a batch or alone; the default rtol 1e-5 leaves a
    # student's batched form (a matrix product, a cumsum) its few ulps
    assert torch.allclose(adv[1, :2], alone[0])
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


@pytest.mark.grades("ppo.per_token_rewards")
def test_the_score_lands_on_the_last_real_token():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [3, 1]
    logp = torch.full((2, 5), -1.0)
    ref_logp = torch.full((2, 5), -1.5)  # k1 = 0.5 on every token
    r = per_token_rewards(torch.tensor([2.0, -1.0]), logp, ref_logp, mask, kl_coef=0.1)
    # float32, 2-3 ops on numbers ≤ 2 (≲ 3e-7) against allclose's default rtol 1e-5 of values ≥ 0.05
    assert torch.allclose(r, torch.tensor([[0, -0.05, -0.05, 2 - 0.05, 0], [-0.05, -1 - 0.05, 0, 0, 0]]))


@pytest.mark.grades("ppo.clipped_value_loss")
def test_clipped_value_loss_by_hand():
    # pytest.approx's default rel 1e-6 here and below: inputs rounded to float32 (≤ 6e-8 relative), then ~6 float32
    # ops (each ≤ 6e-8): ≲ 5e-7 relative; ½·1.5² = 1.125 and the gradient −1.5 are binary fractions, exact
    # inside the range: V = 1.1, V_old = 1.0, R = 2 -> both errors 0.81, loss ½·0.81, not clipped
    loss, frac = clipped_value_loss(torch.tensor([[1.1]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                                    torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.405) and frac.item() == 0
    # outside: V = 1.5 is clipped to 1.2; the clipped error (0.8² = 0.64) beats the unclipped (0.5² = 0.25)
    loss, frac = clipped_value_loss(torch.tensor([[1.5]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                                    torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.32) and frac.item() == 1
    # moving away from R past the clip: the unclipped error is the larger, the gradient still flows
    v = torch.tensor([[0.5]], requires_grad=True)
    loss, frac = clipped_value_loss(v, torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 1.5 ** 2) and frac.item() == 0 and v.grad.item() == pytest.approx(-1.5)
    # padding never counts
    loss, _ = clipped_value_loss(torch.tensor([[1.1, 50.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]),
                                 torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(0.405)


def test_the_value_loss_is_a_mean_over_the_real_tokens():
    # two real tokens and one padding column: errors (1.1 − 2)² = 0.81 and (1.5 − 2)² = 0.25 (neither clipped:
    # each V is within ε of its V_old), so the loss is ½ · (0.81 + 0.25) / 2 = 0.265, not ½ · their sum
    values, old = torch.tensor([[1.1, 1.5, 7.0]]), torch.tensor([[1.0, 1.5, 0.0]])
    returns, mask = torch.tensor([[2.0, 2.0, 0.0]]), torch.tensor([[1, 1, 0]])
    loss, frac = clipped_value_loss(values, old, returns, mask)
    assert loss.item() == pytest.approx(0.265) and frac.item() == 0.0  # default rel 1e-6: as in the test above


def test_explained_variance():
    returns, mask = torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]])
    # exact: sums of small integers, and variances 2/3 and 8/3 that round alike (a power of 2 apart): ratios 0, 1, 4
    assert explained_variance(returns, returns, mask) == 1.0
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == 0.0  # the mean return
    assert explained_variance(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), returns, mask) == -3.0


@pytest.mark.grades("ppo.AdaptiveKLController.update")
def test_adaptive_kl_controller_follows_the_formula():
    kl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    # float64, a few ops on each side (~1e-16 relative); the default rel 1e-6 lets a correct formula in another order
    # pass, and every catalogued bug moves the value by ≥ 5e-3 relative
    kl.update(9.0, n_steps=256)  # 9/6 − 1 = 0.5, clipped to 0.2: × (1 + 0.2 · 256 / 10,000)
    assert kl.value == pytest.approx(0.1 * 1.00512)
    kl.update(3.0, n_steps=256)  # 3/6 − 1 = −0.5, clipped to −0.2
    assert kl.value == pytest.approx(0.1 * 1.00512 * 0.99488)
    kl.update(6.6, n_steps=1000)  # +0.1, inside the clip
    assert kl.value == pytest.approx(0.1 * 1.00512 * 0.99488 * 1.01)
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


# ----------------------------------------------------------------------------- the critic and a PPO step on a tiny GPT

TEXT = "Add 2 and 3. 5 Sort these words: cat, dog. cat, dog Once upon a time there was a kite. The end. " * 30
PROMPTS = ["Add 2 and 3.", "Sort these words: cat, dog."]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT, 300)


def tiny_gpt(tok, seed=0, dropout=0.1):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=32, dropout=dropout))


def tiny_rollout(tok, policy, reference, k=4, max_new_tokens=6, seed=0):
    return rollout(actor(policy), reference, tok, PROMPTS, k=k, reward_fn=lambda p, c: [float(len(x) % 3) for x in c],
                   max_new_tokens=max_new_tokens, temperature=0.9, generator=torch.Generator().manual_seed(seed))


def test_shared_critic_gives_the_policys_logits_and_a_value_per_token_in_one_pass(tok):
    gpt = tiny_gpt(tok)
    pv = PolicyValue(gpt).eval()
    ids = torch.tensor([encode_chat(tok, PROMPTS[1])[0]])
    logits, values = pv(ids)
    assert torch.equal(logits, gpt.eval()(ids)) and values.shape == ids.shape
    assert (values == 0).all()  # the head starts with no opinion


@pytest.mark.parametrize("shared", [False, True])
def test_logprobs_and_values_line_up_with_the_actions(tok, shared):
    """Column t: the log-prob of token t+1 (as sequence_logprobs gives it), the value read at token t, and the
    entropy of the full next-token distribution there."""
    gpt = tiny_gpt(tok, dropout=0.0)
    critic = None if shared else RewardModel(tiny_gpt(tok, 1, dropout=0.0))
    policy = PolicyValue(gpt) if shared else gpt
    if shared:
        torch.nn.init.normal_(policy.value_head.weight)
    ro = tiny_rollout(tok, policy, gpt)
    logp, values, entropy = logprobs_and_values(policy, critic, ro.sequences, ro.attention_mask, 0.9)
    expected = sequence_logprobs(gpt, ro.sequences, ro.attention_mask, 0.9)
    # the same forward pass on the same rows (lm_head(trunk), the prompts' lengths differ so the mask is passed
    # both times) and the same float32 ops after it: equal bit for bit
    assert torch.equal(logp * ro.mask, expected * ro.mask)
    all_values = (policy(ro.sequences, ro.attention_mask)[1] if shared
                  else critic(ro.sequences, ro.attention_mask, per_token=True))
    assert torch.equal(values, all_values[:, :-1])
    p = torch.softmax(gpt(ro.sequences, ro.attention_mask)[:, :-1] / 0.9, -1)
    # two formulas of H, each a float32 sum over V = 300 terms of total size ≲ 7 (H ≤ log 300 ≈ 5.7, Σ p|z| ≲ 1):
    # ≤ 300·6e-8·7 ≈ 1e-4 apart in the worst order (~1e-6 seen)
    assert torch.allclose(entropy, -(p * p.log()).sum(-1), atol=1e-4)


@pytest.mark.parametrize("shared", [False, True])
def test_ppo_step_trains_policy_and_critic_never_the_reference_and_starts_at_ratio_one(tok, shared):
    gpt, reference = tiny_gpt(tok), tiny_gpt(tok).requires_grad_(False)
    critic = None if shared else RewardModel(tiny_gpt(tok, 1))
    policy = PolicyValue(gpt) if shared else gpt
    ref_before = [p.clone() for p in reference.parameters()]
    pol_before = [p.clone() for p in gpt.parameters()]
    head = policy.value_head if shared else critic.head
    head_before = head.weight.clone()
    opt = make_optimizer(policy, critic, lr=1e-3, critic_lr=1e-2)
    ro = tiny_rollout(tok, policy, reference)
    kl_ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    metrics = ppo_step(policy, critic, opt, ro, kl_ctl, PPOConfig(epochs=2, minibatches=2),
                       torch.Generator().manual_seed(0))
    assert metrics["policy/first_ratio_error"] == 0.0  # the first minibatch sees exactly the policy that sampled
    # policy == reference when it sampled, but the rollout scored its 8 rows at once and ppo_step 4 shuffled rows at a
    # time: each token's log-prob may differ in its last bits (a few ulp of |logp| ≲ 6, ≲ 1.5e-6), ≤ 6 tokens a row
    assert metrics["objective/kl"] == pytest.approx(0.0, abs=1e-5)
    # KL ≈ 0 < target: the coefficient falls; float64, its error clipped to −0.2 exactly (default rel 1e-6)
    assert kl_ctl.value == pytest.approx(0.1 * (1 - 0.2 * 8 / 100))
    assert all(p.grad is None for p in reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ref_before, reference.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(pol_before, gpt.parameters()))
    assert not torch.equal(head_before, head.weight) and policy.training  # the mode is given back
    assert {"objective/kl_coef", "objective/entropy", "objective/scores", "gold/reward", "proxy/reward",
            "policy/approxkl", "policy/clipfrac", "loss/policy", "loss/value", "value/explained_variance",
            "value/clipfrac", "completions/mean_length"} <= set(metrics)


def test_the_kl_penalty_enters_the_reward_with_its_sign(tok):
    policy, reference = tiny_gpt(tok, 0, dropout=0.0), tiny_gpt(tok, 1, dropout=0.0).requires_grad_(False)
    ro = tiny_rollout(tok, policy, reference)
    with torch.no_grad():
        logp = sequence_logprobs(policy, ro.sequences, ro.attention_mask, ro.temperature) * ro.mask
    kl = ((logp - ro.ref_logp) * ro.mask).sum(1)  # (B,) Σ k1 per completion, computed here on its own
    critic = RewardModel(tiny_gpt(tok, 2))
    opt = make_optimizer(policy, critic, lr=1e-3, critic_lr=1e-3)
    metrics = ppo_step(policy, critic, opt, ro, FixedKLController(0.5), PPOConfig())
    # the same log-probs from batches of another size (all rows here, minibatches there): a few ulp of |logp| ≲ 6 per
    # token (≲ 1.5e-6), ≤ 6 tokens a row: ≲ 1e-5, ≤ 1e-4 relative of a KL ≥ 0.1 and of a reward ~1
    assert kl.mean().item() > 0.1 and metrics["objective/kl"] == pytest.approx(kl.mean().item(), rel=1e-4)
    assert metrics["objective/rlhf_reward"] == pytest.approx((ro.rewards - 0.5 * kl).mean().item(), rel=1e-4)


def test_a_separate_critics_value_loss_sends_no_gradient_to_the_policy(tok):
    policy, critic = tiny_gpt(tok, dropout=0.0), RewardModel(tiny_gpt(tok, 1, dropout=0.0))
    ro = tiny_rollout(tok, policy, policy)
    logp, values, _ = logprobs_and_values(policy, critic, ro.sequences, ro.attention_mask, 0.9)
    loss, _ = clipped_value_loss(values, values.detach() + 0.05, torch.ones_like(values), ro.mask)
    loss.backward()
    assert all(p.grad is None for p in policy.parameters())
    assert all(p.grad is not None for p in critic.parameters() if p.requires_grad)
    # with a shared critic it does reach the trunk (once the head is not zero): the price of sharing
    pv = PolicyValue(tiny_gpt(tok, dropout=0.0))
    torch.nn.init.normal_(pv.value_head.weight)
    _, values, _ = logprobs_and_values(pv, None, ro.sequences, ro.attention_mask, 0.9)
    clipped_value_loss(values, values.detach() + 0.05, torch.ones_like(values), ro.mask)[0].backward()
    assert pv.gpt.blocks[0].attn.c_attn.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("shared", [False, True])
def test_ppo_steps_move_a_tiny_gpt_toward_the_rewarded_answer(tok, shared):
    """Reward 1 when the one-token completion starts with a space: a few PPO steps raise that probability."""
    gpt, reference = tiny_gpt(tok, dropout=0.0), tiny_gpt(tok, dropout=0.0)
    critic = None if shared else RewardModel(tiny_gpt(tok, 1, dropout=0.0))
    policy = PolicyValue(gpt) if shared else gpt
    prompt = "Sort these words: cat, dog."
    spaced = torch.tensor([tok.decode([i]).startswith(" ") for i in range(tok.vocab_size)])  # (V,) rewarded tokens

    def p_rewarded():
        with torch.no_grad():
            return torch.softmax(gpt(torch.tensor([encode_chat(tok, prompt)[0]]))[0, -1], -1)[spaced].sum().item()

    before = p_rewarded()
    opt, g = make_optimizer(policy, critic, lr=2e-2, critic_lr=2e-2), torch.Generator().manual_seed(0)
    for _ in range(12):
        ro = rollout(gpt, reference, tok, [prompt], k=16, max_new_tokens=1, generator=g,
                     reward_fn=lambda p, c: [float(x.startswith(" ")) for x in c])
        ppo_step(policy, critic, opt, ro, FixedKLController(0.0), PPOConfig(epochs=2, minibatches=2), g)
    assert 0.05 < before < 0.8 and p_rewarded() > before + 0.15


def test_weights_held_counts_a_tied_matrix_once(tok):
    gpt = tiny_gpt(tok)
    held = weights_held({"policy": PolicyValue(gpt), "reference": gpt})
    assert held["reference"] == {"params": gpt.num_params(), "bytes": 4 * gpt.num_params()}  # float32
    assert held["policy"]["params"] == gpt.num_params() + gpt.config.n_embd + 1  # the value head's weight and bias



def test_the_entropy_bonus_sends_a_gradient_to_the_policy(tok):
    """entropy_grad=True (ent_coef > 0): the entropy is differentiable, and its gradient is that of
    H = −Σ p log p of the policy's next-token distribution at the temperature, computed here on its own.
    entropy_grad=False: a diagnostic only, with no graph."""
    policy, critic = tiny_gpt(tok, dropout=0.0), RewardModel(tiny_gpt(tok, 1, dropout=0.0))
    ids = torch.tensor([encode_chat(tok, PROMPTS[1], "cat, dog")[0]])
    _, _, entropy = logprobs_and_values(policy, critic, ids, torch.ones_like(ids), 0.9, entropy_grad=True)
    entropy.sum().backward()
    got = [p.grad.clone() for p in policy.parameters()]
    assert any(g.abs().sum() > 0 for g in got)
    policy.zero_grad(set_to_none=True)
    p = torch.softmax(policy(ids)[:, :-1] / 0.9, -1)
    (-(p * p.log()).sum()).backward()
    # two formulas of H and their backward passes: float32 sums over V = 300 and the model's matrices of terms
    # ≲ 0.1 (≤ 300·6e-8·0.1·a few ≈ 1e-5 worst; ~4e-7 seen); rtol 1e-3 for the largest gradients
    for g, q in zip(got, policy.parameters()):
        torch.testing.assert_close(g, q.grad, atol=1e-5, rtol=1e-3)
    _, _, diagnostic = logprobs_and_values(policy, critic, ids, torch.ones_like(ids), 0.9)
    # the same forward and the same formula (entropy_grad only detaches the logits): equal bit for bit
    assert not diagnostic.requires_grad and torch.equal(diagnostic, entropy.detach())


def test_advantages_are_whitened_over_the_completion_tokens_only(tok):
    """The same rollout with two more padding columns on the left: the completion tokens, their rewards and their
    values are the same, so the whitened advantages and the policy loss must be too. Whitening over every column
    would count the extra zeros in the mean and the std."""
    from dataclasses import replace

    losses = []
    for extra in (0, 2):
        policy, reference = tiny_gpt(tok, 0, dropout=0.0), tiny_gpt(tok, 1, dropout=0.0).requires_grad_(False)
        critic = RewardModel(tiny_gpt(tok, 2, dropout=0.0))
        torch.nn.init.normal_(critic.head.weight)  # values that differ from token to token
        ro = tiny_rollout(tok, policy, reference)
        if extra:
            B = ro.sequences.size(0)
            zeros = torch.zeros(B, extra)
            ro = replace(ro, sequences=torch.cat([torch.full((B, extra), tok.pad_id), ro.sequences], 1),
                         attention_mask=torch.cat([zeros.long(), ro.attention_mask], 1),
                         mask=torch.cat([zeros.to(ro.mask.dtype), ro.mask], 1),
                         ref_logp=torch.cat([zeros, ro.ref_logp], 1))
        opt = make_optimizer(policy, critic, lr=1e-3, critic_lr=1e-3)
        metrics = ppo_step(policy, critic, opt, ro, FixedKLController(0.1), PPOConfig(epochs=2, minibatches=2),
                           torch.Generator().manual_seed(0))
        losses.append((metrics["loss/policy"], metrics["loss/value"], metrics["objective/rlhf_reward"]))
    (pg, vf, reward), (pg_padded, vf_padded, reward_padded) = losses
    assert abs(pg) > 1e-3  # not 0 by construction: minibatches of a batch whitened as a whole
    # the same numbers in sums over 2 more (zero) columns, then 4 AdamW steps at lr 1e-3. pg: last bits of whitened
    # advantages ~1 over ~50 tokens (≲ 50·6e-8 each), and Adam moves a weight by ≤ lr·Δg/eps (~1e-5 for Δg ~ 1e-10):
    # ≲ 1e-6. The value loss ½(V − R)² ≈ 11 with |V| ~ 10: a few ulp (1e-6) of V − R ≈ 5 move it ≲ 2e-5, so rel.
    # The reward, score − 0.1·Σ k1 over ≤ 6 tokens of a few ulp each: ≲ 1e-6
    assert pg_padded == pytest.approx(pg, abs=1e-5)
    assert vf_padded == pytest.approx(vf, rel=1e-5) and reward_padded == pytest.approx(reward, abs=1e-5)


def test_ppo_ptx_mixes_gamma_times_the_sft_loss_into_every_step(tok):
    """One epoch of one minibatch with SGD (lr 1, no clipping): the update with γ > 0 minus the update without is
    −γ ∇(SFT loss of the batch), PPO-ptx's hand-worked mixture (policy_gradient.ptx_loss)."""
    gpt, reference = tiny_gpt(tok, dropout=0.0), tiny_gpt(tok, dropout=0.0).requires_grad_(False)
    ro = tiny_rollout(tok, gpt, reference)
    rows = [encode_chat(tok, "Add 2 and 3.", "2 plus 3: 2 plus 0 is 2. 2 plus 3 is 5."),
            encode_chat(tok, "Sort these words: kite, cat.", "cat, kite")]
    batch = sft_collate(rows, tok.pad_id)

    def updated(gamma):
        policy, critic = copy.deepcopy(gpt), RewardModel(tiny_gpt(tok, 1))
        opt = torch.optim.SGD([{"params": policy.parameters()}, {"params": critic.parameters()}], lr=1.0)
        cfg = PPOConfig(epochs=1, minibatches=1, grad_clip=0.0, ptx_coef=gamma)
        metrics = ppo_step(policy, critic, opt, ro, FixedKLController(0.05), cfg, torch.Generator().manual_seed(0),
                           ptx_batch=batch if gamma else None)
        return [p.detach() for p in policy.parameters()], metrics

    (plain, _), (mixed, metrics) = updated(0.0), updated(2.0)
    hand = copy.deepcopy(gpt)
    logits = hand(batch[0]).double()  # the SFT loss by hand: −mean log softmax at the response targets
    x, y = batch
    loss = torch.stack([torch.logsumexp(logits[b, t], 0) - logits[b, t, y[b, t]] for b in range(x.size(0))
                        for t in range(x.size(1)) if y[b, t] != -100]).mean()
    grads = torch.autograd.grad(loss, list(hand.parameters()))
    # float32 against float64 (mean of ~30 terms): rel 1e-5; weights |w| ≲ 1 (ulp ≤ 1.2e-7): atol 2e-6, rtol 1e-4
    assert metrics["loss/ptx"] == pytest.approx(loss.item(), rel=1e-5)
    for a, b, g in zip(plain, mixed, grads):
        assert torch.allclose(b - a, -2.0 * g.float(), rtol=1e-4, atol=2e-6)
