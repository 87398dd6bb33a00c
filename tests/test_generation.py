import math

import pytest
import torch
import torch.nn as nn

from llm_from_scratch.generation import (
    filter_logits,
    generate,
    left_pad,
    sample_next,
    sequence_logprobs,
    token_logprobs,
)
from llm_from_scratch.model import GPT, GPTConfig


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, context_length=48, n_layer=2, n_head=2, n_embd=32)).eval()


class ScriptedLM(nn.Module):
    """Always predicts script[row][k] as the k-th completion token (a stand-in to test the masks)."""

    def __init__(self, script, prompt_len, vocab=10):
        super().__init__()
        self.config = GPTConfig(vocab_size=vocab, context_length=64, n_layer=1, n_head=1, n_embd=4)
        self.script, self.P, self.vocab = script, prompt_len, vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, idx, attention_mask=None, kv_cache=None):
        B, T = idx.shape
        k = T - self.P
        logits = torch.full((B, T, self.vocab), -10.0)
        for b in range(B):
            logits[b, -1, self.script[b][min(k, len(self.script[b]) - 1)]] = 10.0
        return logits


@pytest.mark.grades("generation.left_pad")
def test_left_pad_by_hand():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_stops_at_eos_and_masks_the_rest():
    eos, pad = 9, 0
    lm = ScriptedLM(script=[[3, 9, 4, 4], [5, 6, 7, 8]], prompt_len=2)
    out = generate(lm, [[1, 2], [1, 2]], max_new_tokens=4, temperature=0, eos_id=eos, pad_id=pad, use_cache=False)
    assert out.sequences.tolist() == [[1, 2, 3, 9, pad, pad], [1, 2, 5, 6, 7, 8]]
    assert out.completion_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]  # EOS included, nothing after
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert out.completions() == [[3, 9], [5, 6, 7, 8]]


def test_all_rows_done_stops_early():
    lm = ScriptedLM(script=[[9]], prompt_len=1)
    out = generate(lm, [[1]], max_new_tokens=10, temperature=0, eos_id=9, use_cache=False)
    assert out.sequences.tolist() == [[1, 9]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_and_no_cache_generate_the_same_tokens(model, temperature):
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    a = generate(model, prompts, 20, temperature=temperature, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompts, 20, temperature=temperature, use_cache=False,
                 generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.sequences, b.sequences)


@pytest.mark.grades("generation.left_pad")
def test_batched_greedy_equals_each_prompt_alone(model):
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    batch = generate(model, prompts, 15, temperature=0, eos_id=39, pad_id=0)
    for i, p in enumerate(prompts):
        alone = generate(model, [p], 15, temperature=0, eos_id=39, pad_id=0)
        assert batch.completions()[i] == alone.completions()[0]


def test_seeded_sampling_repeats(model):
    def g(s):
        return generate(model, [[1, 2]], 10, generator=torch.Generator().manual_seed(s)).sequences

    assert torch.equal(g(3), g(3)) and not torch.equal(g(3), g(4))


@pytest.mark.grades("generation.filter_logits")
def test_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def kept(p):
        return torch.isfinite(filter_logits(logits, top_p=p)).int().tolist()[0]

    assert kept(0.8) == [1, 1, 0, 0]  # 0.5 + 0.3 reaches 0.8
    assert kept(0.81) == [1, 1, 1, 0]
    assert kept(0.3) == [1, 0, 0, 0]  # the most likely token always stays
    assert torch.isfinite(filter_logits(logits, top_k=2)).int().tolist()[0] == [1, 1, 0, 0]
    # a nucleus that reaches p exactly stops there (uniform logits: the sums are exact in float32)
    assert torch.isfinite(filter_logits(torch.zeros(1, 4), top_p=0.5)).int().tolist()[0] == [1, 1, 0, 0]
    # the same probabilities shuffled: the nucleus is the same tokens wherever they sit in the vocabulary
    shuffled = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))
    assert torch.isfinite(filter_logits(shuffled, top_p=0.8)).int().tolist()[0] == [0, 1, 0, 1]
    assert torch.isfinite(filter_logits(shuffled, top_k=3)).int().tolist()[0] == [1, 1, 0, 1]


@pytest.mark.grades("generation.filter_logits", "generation.sample_next")
def test_top_k_and_top_p_never_sample_outside_their_set():
    torch.manual_seed(0)
    logits = torch.randn(4, 30) * 2
    gen = torch.Generator().manual_seed(0)
    topk_set = torch.topk(logits, 5).indices
    for _ in range(200):
        s = sample_next(logits, top_k=5, generator=gen)
        assert all(s[b] in topk_set[b] for b in range(4))
    allowed = torch.isfinite(filter_logits(logits, top_p=0.7))
    seen = torch.zeros_like(allowed)
    for _ in range(300):
        s = sample_next(logits, top_p=0.7, generator=gen)
        assert allowed[torch.arange(4), s].all()
        seen[torch.arange(4), s] = True
    assert seen.sum() > 4  # it does sample, not just argmax


@pytest.mark.grades("generation.sample_next")
def test_sampling_draws_each_token_with_its_probability():
    # the inverse-CDF sampler: frequencies over many draws match softmax(z / T); a token at -inf is never drawn
    z = torch.tensor([[1.0, float("-inf"), 0.0, 2.0, -1.0]])
    for temperature in (1.0, 0.5):
        draws = sample_next(z.expand(40_000, -1), temperature=temperature, generator=torch.Generator().manual_seed(0))
        freq = torch.bincount(draws, minlength=5).float() / draws.numel()
        assert freq[1] == 0
        # sampling, not rounding: a frequency of 40,000 draws has sd ≤ √(0.25/40,000) = 0.0025; 0.01 is 4 sd
        assert torch.allclose(freq, torch.softmax(z[0] / temperature, dim=-1), atol=0.01)


@pytest.mark.grades("generation.sample_next")
def test_temperature_zero_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9]])
    assert sample_next(logits, temperature=0).item() == 1


@pytest.mark.grades("generation.token_logprobs")
def test_token_logprobs_by_hand_and_stable():
    logits = torch.log(torch.tensor([[[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]]]))
    lp = token_logprobs(logits, torch.tensor([[2, 0]]))
    # float32: the rounded probabilities and their logs (≲ 6e-8 × |log| each), a logsumexp of 3 exps summing to
    # ~1 (≲ 4·6e-8): ≲ 5e-7 absolute
    assert lp.tolist()[0] == pytest.approx([math.log(0.5), math.log(0.6)], abs=1e-6)
    big = torch.tensor([[[1e4, 0.0, -1e4]]])
    # exp(-1e4) underflows to 0, so z - logsumexp is -1e4 exactly; approx's rel 1e-6 (0.01, ~10 ulps of 1e4) lets
    # another stable form pass, while the unstable log(softmax) gives -inf
    assert token_logprobs(big, torch.tensor([[1]])).item() == pytest.approx(-1e4)
    x = torch.randn(2, 5, 11)
    t = torch.randint(0, 11, (2, 5))
    # two float32 forms of an 11-term logsumexp: its sum ≲ 11·6e-8 relative off, ≲ 7e-7 in the log, plus a rounding
    # of |lp| ≲ 5: allclose's atol 1e-6 + its default rtol 1e-5 × |lp| covers it
    assert torch.allclose(token_logprobs(x, t), torch.log_softmax(x, -1).gather(-1, t[..., None])[..., 0], atol=1e-6)


def test_prompt_too_long_is_a_clear_error(model):
    with pytest.raises(ValueError, match="longer than the model's context"):
        generate(model, [[1] * 49], 1)
    with pytest.raises(ValueError, match="at most 8 new tokens"):
        generate(model, [[1] * 40], 20)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], 1)


def test_generation_restores_training_mode(model):
    model.train()
    generate(model, [[1, 2]], 3)
    assert model.training
    model.eval()


@pytest.mark.grades("generation.sequence_logprobs")
def test_sequence_logprobs_of_left_padded_rows_equal_each_row_alone(model):
    rows = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]]
    ids, mask = left_pad(rows, pad_id=0)  # (3, 7), as generate() returns a rollout
    for temperature in (1.0, 0.7):
        lp = sequence_logprobs(model, ids, mask, temperature=temperature)  # (3, 6)
        assert lp.shape == (3, 6)
        for i, r in enumerate(rows):
            # by hand, one token at a time from its own prefix, in float64
            for t in range(1, len(r)):
                logits = model(torch.tensor([r[:t]]))[0, -1].double() / temperature
                expected = torch.log_softmax(logits, -1)[r[t]].item()
                col = ids.size(1) - len(r) + t - 1  # column of the log-prob of token r[t] in the padded row
                # the padded batch against the prefix alone (other product shapes, a mask: another order of ≤ 128-term
                # sums on logits ≲ 0.5, ≲ 1e-6), and a float32 logsumexp of 40 exps against float64: its sum ≲ 40·6e-8
                # relative off, ≲ 2.4e-6 in the log: ≲ 4e-6 worst case
                assert lp[i, col].item() == pytest.approx(expected, abs=1e-5)
            assert (lp[i, : ids.size(1) - len(r)] == 0).all()  # padding (and the first token, with no prefix) gets none


@pytest.mark.grades("generation.sequence_logprobs")
def test_sequence_logprobs_align_with_the_completion_mask_and_carry_gradients():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=40, context_length=48, n_layer=1, n_head=2, n_embd=16))
    gen = generate(m, [[1, 2, 3], [4, 5]], max_new_tokens=6, temperature=1.0, eos_id=7, pad_id=0,
                   generator=torch.Generator().manual_seed(0))
    lp = sequence_logprobs(m, gen.sequences, gen.attention_mask)  # (B, T-1)
    completion = gen.completion_mask[:, 1:].bool()  # log-probs of the sampled completion tokens
    total = (lp * completion).sum()
    total.backward()
    assert m.wte.weight.grad is not None and m.wte.weight.grad.abs().sum() > 0
    # the summed completion log-prob of each row equals the sum over its sampled tokens, one at a time
    for i in range(2):
        seq = gen.sequences[i][gen.attention_mask[i].bool()].tolist()
        n_prompt = int((gen.attention_mask[i, :gen.prompt_length]).sum())
        by_hand = sum(torch.log_softmax(m(torch.tensor([seq[:t]]))[0, -1].double(), -1)[seq[t]].item()
                      for t in range(n_prompt, len(seq)))
        # ≤ 6 float32 log-probs, each ≲ 4e-6 off float64 (as in the test above), and their float32 sum (|Σ| ≲ 25):
        # ≲ 6·4e-6 + 6·6e-8·25 ≈ 3e-5
        assert (lp[i] * completion[i]).sum().item() == pytest.approx(by_hand, abs=1e-4)


@pytest.mark.grades("generation.sequence_logprobs")
def test_sequence_logprobs_of_right_padded_rows_equal_each_row_alone(model):
    """Preference data and SFT batches are padded on the right: the same values, and 0 wherever the target is
    padding."""
    rows = [[1, 2, 3, 4, 5], [6, 7, 8]]
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    lp = sequence_logprobs(model, ids, mask)  # (2, 4)
    for i, r in enumerate(rows):
        alone = sequence_logprobs(model, torch.tensor([r]))[0]  # no mask, no padding
        # the batch with a mask against the row alone: other orders of the same float32 sums (≲ 1e-6 on the logits)
        # and of a 40-term logsumexp (≲ 40·6e-8 ≈ 2.4e-6 in the log): ≲ 4e-6 worst case
        torch.testing.assert_close(lp[i, : len(r) - 1], alone, atol=1e-5, rtol=0)
    assert lp[1, 2:].tolist() == [0.0, 0.0]  # targets 3 and 4 of row 2 are padding
