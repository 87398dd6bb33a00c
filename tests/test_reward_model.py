import json
import math

import pytest
import torch

from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.reward_model import (
    RewardModel,
    agreement_by_part,
    average_ranks,
    bradley_terry_loss,
    center_rewards,
    gold_sign,
    load_preferences,
    pearson,
    preference_metrics,
    ranking_scores,
    spearman,
)
from llm_from_scratch.tokenizer import pad_right


def preference_collate(pairs, pad_id):
    """Chosen rows then rejected rows in one right-padded batch (data.preference_collate, without importing data)."""
    return pad_right([c for c, _ in pairs] + [r for _, r in pairs], pad_id)


def rm(seed=0):
    torch.manual_seed(seed)
    return RewardModel(GPT(GPTConfig(vocab_size=30, context_length=32, n_layer=2, n_head=2, n_embd=16))).eval()


@pytest.mark.grades("reward_model.bradley_terry_loss")
def test_bradley_terry_by_hand():
    loss = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]))
    by_hand = (math.log(1 + math.exp(-2)) + math.log(2)) / 2  # -log σ(2), -log σ(0)
    # float32 against float64: two logsigmoids within ~1 ulp (≤ 6e-8) and a mean of 2: ≲ 1.5e-7 on 0.41
    assert loss.item() == pytest.approx(by_hand, abs=1e-6)
    # 100 + log(1 + e^-100) is 100 in float32 (log(sigmoid(-100)) would be inf): approx's default rel 1e-6
    assert bradley_terry_loss(torch.tensor([-100.0]), torch.tensor([0.0])).item() == pytest.approx(100.0)
    # log(1 + e^-100) ≈ 4e-44, a float32 denormal (or 0): abs 1e-30 takes either, and fails anything of real size
    assert bradley_terry_loss(torch.tensor([100.0]), torch.tensor([0.0])).item() == pytest.approx(0.0, abs=1e-30)


def test_metrics_by_hand():
    m = preference_metrics(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0.0, 1.0, 1.0]))
    # float32 means of 3 small integers: exact sums, 2/3 rounded once (≤ 6e-8 relative) against the float64 2/3
    assert m["accuracy"] == pytest.approx(2 / 3) and m["margin"] == pytest.approx(2 / 3)
    assert (m["min_reward"], m["max_reward"], m["mean_reward"]) == (0.0, 3.0, 1.0)  # exact: 6/6


@pytest.mark.grades("reward_model.RewardModel.forward")
def test_reward_is_read_at_the_last_real_token_whatever_the_padding():
    model = rm()
    seq = [3, 4, 5, 6]
    alone_ids, alone_mask, alone_last = preference_collate([(seq, seq)], pad_id=0)
    r_alone = model(alone_ids, alone_mask)[0]
    ids, mask, last = preference_collate([(seq, list(range(1, 12)))], pad_id=0)  # padded to 11
    r_padded = model(ids, mask)[0]
    ids[0, 4:] = 29  # whatever sits in the padding
    # float32, another batch shape (2 rows padded to 11, 1 row of 4): the trunk's sums (≤ 64 terms) add in other
    # orders, ~√64·u = 5e-7 relative each, a few in a row: ≲ 1e-6 on a reward of order 1; 1e-5 leaves 10x
    assert r_padded.item() == pytest.approx(r_alone.item(), abs=1e-5)
    assert model(ids, mask)[0].item() == pytest.approx(r_alone.item(), abs=1e-5)
    # it is the last token's state: changing it changes the reward (by ~1, far beyond any rounding)
    ids[0, 3] = 7
    assert model(ids, mask)[0].item() != pytest.approx(r_alone.item(), abs=1e-4)


@pytest.mark.grades("reward_model.RewardModel.forward")
def test_left_and_right_padding_give_the_same_rewards():
    """A rollout from generate() is left-padded; preference data is right-padded: the same rows, the same rewards."""
    from llm_from_scratch.generation import left_pad

    model = rm()
    rows = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14], [15]]
    right_ids, right_mask, _ = pad_right(rows, pad_id=0)
    left_ids, left_mask = left_pad(rows, pad_id=0)
    right, left = model(right_ids, right_mask), model(left_ids, left_mask)
    # float32: other paddings and batch shapes add the trunk's sums (≤ 64 terms) in other orders: ≲ 1e-6 on rewards
    # of order 1, as above
    torch.testing.assert_close(left, right, atol=1e-5, rtol=0)
    alone = torch.stack([model(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0] for r in rows])
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)
    # a score per token: the same head at every position; the row reward is the last real token's
    per_token = model(left_ids, left_mask, per_token=True)  # (B, T)
    assert per_token.shape == left_ids.shape
    # the same trunk; the head is a 16-term dot product in a matrix product of another shape ((B·T, 16), not
    # (B, 16)), which may add in another order: ≲ 16·u·Σ|h_i w_i| (≈ 3 here) = 3e-6, so 5e-6 (1e-6 had no margin)
    torch.testing.assert_close(per_token[:, -1], left, atol=5e-6, rtol=0)
    per_token_right = model(right_ids, right_mask, per_token=True)
    torch.testing.assert_close(per_token_right[torch.arange(4), right_mask.sum(1) - 1], right, atol=5e-6, rtol=0)


def test_center_rewards_gives_mean_zero():
    model = rm()
    ids, mask, last = preference_collate([([1, 2, 3], [4, 5, 6, 7]), ([8, 9], [10])], pad_id=0)
    r = model(ids, mask).detach()
    mean, std = center_rewards(model, r)
    assert mean == r.mean().item() and std == r.std().item()  # exact: center_rewards computes the same, on the same r
    # float32: 4 rewards of size ≤ 1.4 (Σ|r| ≈ 3.4) shifted by their mean, rounded (≲ 3·u·Σ|r|/4 = 1.5e-7), each
    # rounded again (≤ u·1.4), then averaged (1.5e-7 more): ≲ 4e-7
    assert model(ids, mask).mean().item() == pytest.approx(0.0, abs=1e-6)


def test_save_load_roundtrip(tmp_path):
    model = rm()
    model.save(tmp_path)
    back = RewardModel.load(tmp_path, vocab_size=30).eval()
    ids, mask, last = preference_collate([([1, 2, 3], [4, 5])], pad_id=0)
    assert torch.equal(model(ids, mask), back(ids, mask))
    assert back.gpt.lm_head.weight is back.gpt.wte.weight  # the tie is restored by sharing
    from llm_from_scratch.checkpoint import CheckpointError, load_model
    with pytest.raises(CheckpointError, match="'reward_model' checkpoint, not a 'gpt' one"):
        load_model(tmp_path, "gpt", lambda c: GPT(GPTConfig(**c)))


@pytest.mark.parametrize("line,error", [
    ('{"prompt": "p", "chosen": "a"}', "line 2: missing field 'rejected'"),
    ('{"prompt": "p", "chosen": "", "rejected": "b"}', "line 2: field 'chosen' is empty"),
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
])
def test_malformed_preferences_name_the_line(tmp_path, line, error):
    f = tmp_path / "prefs.jsonl"
    f.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"prefs.jsonl, {error}"):
        load_preferences(f)


def test_score_texts_matches_scoring_each_text_alone():
    from llm_from_scratch.reward_model import score_texts
    from llm_from_scratch.tokenizer import Tokenizer, encode_chat

    tok = Tokenizer.train("Mia found a red kite. The end. Add 2 and 3. 5 " * 20, 300)
    torch.manual_seed(0)
    model = RewardModel(GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2,
                                      n_embd=16))).eval()
    prompts, responses = ["Add 2 and 3.", "Write a story."], ["5", "Mia found a red kite. The end."]
    batched = score_texts(model, tok, prompts, responses)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([encode_chat(tok, p, r)[0]])
        alone = model(ids, torch.ones_like(ids))
        # float32, another batch shape (2 right-padded rows, 1 row alone): ≲ 1e-6 on a reward of order 1, as above
        assert batched[i].item() == pytest.approx(alone.item(), abs=1e-5)


def test_reward_fn_scores_sampled_completions_as_sampled():
    from llm_from_scratch.reward_model import reward_fn, score_texts
    from llm_from_scratch.tokenizer import Tokenizer

    tok = Tokenizer.train("Mia found a red kite. The end. Add 2 and 3. 5 " * 20, 300)
    torch.manual_seed(0)
    model = RewardModel(GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2,
                                      n_embd=16))).eval()
    score = reward_fn(model, tok)
    prompts, completions = ["Add 2 and 3.", "Write a story."], ["5", "Mia found a red kite. The end."]
    # exact: reward_fn's score is score_texts itself, on the same rows
    assert torch.equal(score(prompts, completions), score_texts(model, tok, prompts, completions))
    # a sample may write a special token's text; it is scored, not refused, and never gets gradients
    odd = score(["Write a story."], ["Mia <|assistant|> kite"])
    assert odd.shape == (1,) and not odd.requires_grad
    # chapter 6 scores the SFT model's samples with score_texts: one path, the same number, no tiktoken refusal
    assert score_texts(model, tok, ["Write a story."], ["Mia <|assistant|> kite"]).item() == odd.item()  # exact
    from llm_from_scratch.reward_model import response_row
    row = response_row(tok, "Write a story.", "Mia <|assistant|> kite")
    assert tok.special_tokens["<|assistant|>"] in row[row.index(tok.special_tokens["<|assistant|>"]) + 1:]  # as sampled


def test_length_sorted_chunks_give_the_rewards_and_gradients_of_one_padded_batch():
    from llm_from_scratch.reward_model import score_rows

    g = torch.Generator().manual_seed(0)
    pairs = [tuple(torch.randint(1, 30, (int(n),), generator=g).tolist()
                   for n in torch.randint(2, 30, (2,), generator=g))
             for _ in range(7)]  # 7 pairs of random lengths
    one_model, chunked_model = rm(), rm()
    ids, mask, last = preference_collate(pairs, pad_id=0)
    one = one_model(ids, mask)  # (14,) chosen first, then rejected
    chunked = score_rows(chunked_model, [c for c, _ in pairs] + [r for _, r in pairs], pad_id=0, chunk_rows=3)
    # float32, batches of other shapes: ≲ 1e-6 on rewards of order 1, as in the padding tests
    torch.testing.assert_close(chunked, one, atol=1e-5, rtol=0)
    bradley_terry_loss(one[:7], one[7:]).backward()
    bradley_terry_loss(chunked[:7], chunked[7:]).backward()
    # a weight's gradient sums ≲ 14 rows x 29 positions ≈ 400 terms, here chunk by chunk (another order): ≲ 400·u =
    # 2.4e-5 of Σ|term| (rtol 1e-4); the biases' sums of ±dL/dr (|dL/dr| ≤ 1/7) cancel to ~0: ≲ 14·u·2, hence atol
    for (name, p), q in zip(one_model.named_parameters(), chunked_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_agreement_by_part_by_hand():
    base = {"name": 1.0, "object": 1.0, "ending": 1.0, "repetition": 1.0}
    sad = {**base, "ending": 0.0}
    other_name = {**base, "name": 0.0}
    parts = [(base, sad), (sad, base), (base, other_name), (base, {**sad, "name": 0.0}), (base, dict(base))]
    gold = torch.tensor([1.0, -1.0, 1.0, 1.0, 0.0])  # gold ties the last pair
    # margins r_c - r_r: right on the first ending pair, wrong on the second, wrong on the name pair;
    # the fourth pair differs in two parts and the fifth in none: both left out
    out = agreement_by_part(parts, torch.tensor([1.0, 2.0, -0.5, 3.0, 1.0]), gold)
    assert out == {"ending": {"agreement": 0.5, "n": 2}, "name": {"agreement": 0.0, "n": 1}}


def test_gold_sign_and_ranking_scores_by_hand():
    rows = [{"gold_chosen": 1.0, "gold_rejected": 0.5}, {"gold_chosen": 0.2, "gold_rejected": 0.9},
            {"gold_chosen": 0.5, "gold_rejected": 0.5}, {"gold_chosen": 0.9, "gold_rejected": 0.1}]
    gold = gold_sign(rows)
    assert gold.tolist() == [1.0, -1.0, 0.0, 1.0]
    accuracy, agreement = ranking_scores(torch.tensor([0.3, 0.4, -1.0, -0.2]), gold)
    assert accuracy == 2 / 4  # margins > 0 on pairs 1 and 2 (a float32 mean of 0s and 1s: exact)
    # of the 3 pairs gold decides, only the first is ordered as gold does (float32 1/3: ≤ 6e-8 from the float64 one)
    assert agreement == pytest.approx(1 / 3)


def test_correlations_by_hand():
    # float64 on small integers: a few roundings of 1.1e-16 each (approx's default rel 1e-6 is far from them)
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])) == pytest.approx(1.0, rel=1e-12)
    assert average_ranks(torch.tensor([5.0, 1.0, 5.0, 3.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    # monotone but not linear: Spearman sees a perfect order where Pearson does not
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x ** 4) == pytest.approx(1.0, rel=1e-12) and pearson(x, x ** 4) < 0.97  # float64, as above
    # with ties, by hand: ranks of a = [1, 2.5, 2.5, 4], of b = [1, 2, 3, 4]
    a, b = torch.tensor([0.0, 1.0, 1.0, 2.0]), torch.tensor([10.0, 20.0, 30.0, 40.0])
    ra, rb = torch.tensor([1.0, 2.5, 2.5, 4.0]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    by_hand = ((ra - 2.5) @ (rb - 2.5)) / ((ra - 2.5).norm() * (rb - 2.5).norm())
    assert spearman(a, b) == pytest.approx(by_hand.item())  # by_hand is float32: ≲ 5 roundings, 3e-7 relative


def test_training_ranks_the_chosen_response_above_the_rejected_one(tmp_path):
    """Pairs that differ only in their last token (chosen rows end with 5, rejected rows with 6) after random
    prefixes: 20 steps of train_reward_model learn to rank held-out pairs the way the labels do. Taking the rejected
    rows for the chosen ones would learn the opposite ranking (validation accuracy near 0)."""
    from llm_from_scratch.reward_model import RewardConfig, train_reward_model

    g = torch.Generator().manual_seed(0)

    def pairs(n):
        out = []
        for _ in range(n):
            prefix = torch.randint(7, 30, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
            out.append((prefix + [5], prefix + [6]))
        return out

    train, val = pairs(32), pairs(16)
    cfg = RewardConfig(max_steps=20, batch_size=8, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_interval=20,
                       log_interval=10)
    best = train_reward_model(rm(), train, val, cfg, pad_id=0, out_dir=tmp_path, quiet=True)
    assert best["step"] == 20 and best["accuracy"] >= 0.9 and best["margin"] > 0
    # the saved model is the one that ranks them: it scores a held-out chosen row above its rejected row
    back = RewardModel.load(tmp_path, vocab_size=30).eval()
    ids, mask, _ = preference_collate(val, pad_id=0)
    r = back(ids, mask)
    assert (r[:16] > r[16:]).float().mean().item() == best["accuracy"]


def test_a_nan_loss_stops_training_with_one_line_naming_the_step(tmp_path):
    """min_lr = nan: step 1's update (at lr nan) makes the weights nan, step 2's loss is nan: train.require_finite
    stops the run there, before any validation has saved a model."""
    from llm_from_scratch.reward_model import RewardConfig, train_reward_model

    pairs = [([7, 8, 5], [7, 8, 6]), ([9, 5], [9, 6])] * 4
    cfg = RewardConfig(max_steps=5, batch_size=4, lr=1e-2, min_lr=float("nan"), warmup_steps=1, eval_interval=100)
    with pytest.raises(FloatingPointError) as err:
        train_reward_model(rm(), pairs, pairs, cfg, pad_id=0, out_dir=tmp_path, quiet=True)
    assert str(err.value) == ("the reward model's loss is nan at step 2: stopping; no checkpoint yet "
                              "(lower --lr, or check the data)")
