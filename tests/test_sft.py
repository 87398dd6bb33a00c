import pytest
import torch

from llm_from_scratch.data import sft_collate
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.sft import SFTBatches, well_formed
from llm_from_scratch.tokenizer import Tokenizer, encode_chat
from llm_from_scratch.train import lm_loss

TEXT = "Add 2 and 3. 5 Sort these words: cat, dog. cat, dog Once upon a time there was a kite. The end. " * 30


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT, 300)


@pytest.mark.grades("data.sft_collate")
def test_collate_masks_prompt_and_padding_by_hand():
    # ids of 5 tokens, the first 3 are prompt: targets 11, 12 are prompt -> -100; 13, 14 are the response
    x, y = sft_collate([([10, 11, 12, 13, 14], 3), ([20, 21, 22], 2)], pad_id=99)
    assert x.tolist() == [[10, 11, 12, 13], [20, 21, 99, 99]]
    assert y.tolist() == [[-100, -100, 13, 14], [-100, 22, -100, -100]]
    _, y_all = sft_collate([([10, 11, 12, 13, 14], 3), ([20, 21, 22], 2)], pad_id=99, train_on_prompt=True)
    assert y_all.tolist() == [[11, 12, 13, 14], [21, 22, -100, -100]]  # padding never has a target


@pytest.mark.grades("data.sft_collate")
def test_prompt_only_sequence_gets_no_loss():
    _, y = sft_collate([([1, 2, 3, 4], 4)], pad_id=0)
    assert (y == -100).all()


@pytest.mark.grades("data.sft_collate", "train.lm_loss")
def test_masked_loss_equals_the_response_tokens_loss_by_hand():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, context_length=16, n_layer=1, n_head=1, n_embd=8)).eval()
    ids = [3, 4, 5, 6, 7, 8]
    x, y = sft_collate([(ids, 4)], pad_id=0)  # response = tokens 7, 8 (targets at positions 4, 5)
    logp = torch.log_softmax(model(x), -1)[0]
    by_hand = -(logp[3, 7] + logp[4, 8]) / 2
    # the reference's cross-entropy is this log-softmax and mean (equal here); a student's other route sums the 20
    # exponentials in another order: ≲ 20·u = 1.2e-6 on a loss of ~3 (1e-6 had no margin), so 3e-6
    assert lm_loss(model, x, y).item() == pytest.approx(by_hand.item(), abs=3e-6)


def test_batches_are_repeatable_and_drop_long_examples(tok):
    examples = [{"prompt": "Add 2 and 3.", "response": "5"},
                {"prompt": "Once upon a time " * 20, "response": "The end."}]
    b = SFTBatches(tok, examples, context_length=16, batch_size=4, seed=3)
    assert b.dropped == 1 and len(b.examples) == 1
    assert all(torch.equal(u, v) for u, v in zip(b.batch(5), b.batch(5)))
    with pytest.raises(ValueError, match="no example fits"):
        SFTBatches(tok, examples[1:], context_length=16, batch_size=4)


def test_length_grouped_batches_repeat_cover_blocks_and_cut_padding(tok):
    examples = [{"prompt": "Add 2 and 3." + " 7" * (i % 9), "response": "2 plus 3: 2 plus 0 is 2. 2 plus 3 is 5."}
                for i in range(40)] + \
               [{"prompt": "Once upon a time " * 6, "response": "The end."}] * 40
    grouped = SFTBatches(tok, examples, context_length=64, batch_size=4, seed=1, group=8)
    again = SFTBatches(tok, examples, context_length=64, batch_size=4, seed=1, group=8)  # a resumed run's sampler
    plain = SFTBatches(tok, examples, context_length=64, batch_size=4, seed=1, group=1)
    for step in (0, 5, 8, 77):
        assert all(torch.equal(u, v) for u, v in zip(grouped.batch(step), again.batch(step)))
    assert grouped.indices(8) != grouped.indices(0)
    # the 8 batches of a block are cut from one length-sorted draw: their length ranges do not overlap
    ranges = sorted((min(n), max(n))
                    for n in ([len(grouped.examples[i][0]) for i in grouped.indices(s)] for s in range(8)))
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(ranges, ranges[1:]))

    def padding(b, steps=range(16)):
        return sum((b.batch(s)[0] == tok.pad_id).sum().item() for s in steps)
    assert padding(grouped) < padding(plain) / 2
    with pytest.raises(ValueError, match="group"):
        SFTBatches(tok, examples, context_length=64, batch_size=4, group=0)


@pytest.mark.parametrize("task,response,ended,ok", [
    ("arithmetic", "23 plus 45: 23 plus 40 is 63. 63 plus 5 is 68.", True, True),
    ("arithmetic", "23 plus 40 is 63. 63 plus 5 is 68.", True, False),  # the problem is not stated first
    ("arithmetic", "23 plus 0: 23 plus 0 is 23.", True, False),  # one step: every sum has two
    ("arithmetic", "23 plus 45: 23 plus 40 is 63. 63 plus 5 is 68.", False, False), ("arithmetic", "68", True, False),
    ("arithmetic", "23 plus 45: 23 plus 40 is 63. 63 plus 5 is", True, False),
    ("arithmetic", "Add 23 and 45. 23 plus 45: 23 plus 40 is 63. 63 plus 5 is 68.", True, False),  # only events
    ("word_problem", "5 minus 2: 5 minus 0 is 5. 5 minus 2 is 3.", True, True),
    ("word_problem", "5 minus 2: 5 minus 0 is 5. 5 minus 2 is 3. 3 plus 4: 3 plus 0 is 3. 3 plus 4 is 7.", True, True),
    ("word_problem", "5 minus 2: 5 minus 0 is 5. 5 minus 2 is 3. 3 plus", True, False),
    ("word_problem", "She loses 2 apples. 5 minus 2: 5 minus 0 is 5. 5 minus 2 is 3. Leo gives her 4 more apples. "
                     "3 plus 4: 3 plus 0 is 3. 3 plus 4 is 7.", True, True),  # each event restated before its sum
    ("word_problem", "She loses 2 apples. 5 minus 2: 5 minus 0 is 5. 5 minus 2 is 3. Leo gives her 4 more apples.",
     True, False),  # the last event restated, never worked
    ("count", "4", True, True), ("count", "four", True, False),
    ("sort", "cat, dog", True, True), ("sort", "cat dog", True, False), ("qa", "the park", True, True),
    ("qa", "", True, False), ("story", "Mia had a kite. The end.", True, True),
    ("story", "Mia had a kite.", True, False),
])
def test_well_formed(task, response, ended, ok):
    assert well_formed(task, response, ended) is ok


def test_response_logprobs_match_one_token_at_a_time(tok):
    from llm_from_scratch.sft import response_logprobs

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=16)).eval()
    prompts, responses = ["Add 2 and 3.", "Sort these words: cat, dog."], ["5", "cat, dog"]
    sums, counts = response_logprobs(model, tok, prompts, responses)  # one padded batch
    one_by_one = response_logprobs(model, tok, prompts, responses, batch_size=1)
    # float32 sums of ≤ 5 log-probs of ~6 (ulp 4.8e-7) from another batch shape, each off by an ulp or two, and the
    # sum's roundings at ~29 (ulp 1.9e-6): ≲ 1e-5, well inside 1e-4
    torch.testing.assert_close(one_by_one[0], sums, atol=1e-4, rtol=0)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids, n_prompt = encode_chat(tok, p, r)
        by_hand = 0.0
        for t in range(n_prompt, len(ids)):  # each response token (and the EOS) from its prefix alone
            logits = model(torch.tensor([ids[:t]]))[0, -1]
            by_hand += torch.log_softmax(logits.double(), -1)[ids[t]].item()
        assert counts[i].item() == len(ids) - n_prompt
        assert sums[i].item() == pytest.approx(by_hand, abs=1e-4)  # float32 against float64 softmaxes: ≲ 1e-5, as above


def test_an_example_of_context_plus_one_tokens_fits(tok):
    """n tokens give n - 1 (input, target) pairs: an example of exactly context_length + 1 tokens fills the context
    (T == context_length) and is kept; one token more is dropped."""
    example = {"prompt": "Add 2 and 3.", "response": "5"}
    n = len(encode_chat(tok, example["prompt"], example["response"])[0])
    fits = SFTBatches(tok, [example], context_length=n - 1, batch_size=2)
    assert fits.dropped == 0
    x, y = fits.batch(0)
    assert x.shape == y.shape == (2, n - 1)
    with pytest.raises(ValueError, match="no example fits"):
        SFTBatches(tok, [example], context_length=n - 2, batch_size=2)


def test_the_batches_of_a_block_are_served_in_a_shuffled_order(tok):
    """The docstring's promise: a block's length-sorted batches are served in a shuffled order, not shortest first.
    Over 5 blocks of 8 batches, some batch is shorter on average than one served before it in its block."""
    examples = [{"prompt": "Add 2 and 3." + " 7" * i, "response": "5"} for i in range(30)]  # 30 different lengths
    b = SFTBatches(tok, examples, context_length=128, batch_size=3, seed=2, group=8)

    def mean_length(step):
        return sum(len(b.examples[i][0]) for i in b.indices(step)) / b.batch_size

    blocks = [[mean_length(block * 8 + slot) for slot in range(8)] for block in range(5)]
    assert any(m != sorted(m) for m in blocks)


def test_train_on_prompt_reaches_the_batches(tok):
    """SFTBatches(train_on_prompt=True) collates with train_on_prompt=True: the prompt's tokens get targets too."""
    examples = [{"prompt": "Add 2 and 3.", "response": "5"},
                {"prompt": "Sort these words: cat, dog.", "response": "cat, dog"}]
    on = SFTBatches(tok, examples, context_length=64, batch_size=4, seed=1, train_on_prompt=True)
    off = SFTBatches(tok, examples, context_length=64, batch_size=4, seed=1)
    for step in (0, 3):
        x, y = on.batch(step)
        ex, ey = sft_collate([on.examples[i] for i in on.indices(step)], tok.pad_id, train_on_prompt=True)
        assert torch.equal(x, ex) and torch.equal(y, ey)
        assert on.indices(step) == off.indices(step)
        assert (y != -100).sum() > (off.batch(step)[1] != -100).sum()  # the default masks the prompt
