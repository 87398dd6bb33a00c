import pytest
import torch

from llm_from_scratch.data import TokenWindowDataset, document_windows, preference_collate


@pytest.mark.grades("data.TokenWindowDataset.__getitem__")
def test_windows_by_hand():
    ds = TokenWindowDataset(list(range(10)), context_length=3)  # windows of 4 tokens, stride 3
    assert len(ds) == 3  # starts 0, 3, 6 (start 9 would need tokens 9..12)
    x, y = ds[1]
    assert x.tolist() == [3, 4, 5] and y.tolist() == [4, 5, 6]
    assert ds[-1][1].tolist() == [7, 8, 9]
    with pytest.raises(IndexError):
        ds[3]


@pytest.mark.grades("data.TokenWindowDataset.__getitem__")
def test_overlapping_stride():
    ds = TokenWindowDataset(torch.arange(10), context_length=4, stride=1)
    assert len(ds) == 6
    assert [ds[i][0][0].item() for i in range(6)] == [0, 1, 2, 3, 4, 5]


def test_too_little_text_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot fill one window"):
        TokenWindowDataset([1, 2, 3], context_length=3)


def test_document_windows_start_at_boundaries_and_score_every_document_once():
    EOS, PAD = 0, 99
    # three documents (each closed by EOS); the last one lacks its EOS at the end of the stream
    stream = [5, 6, 7, EOS, 8, 9, EOS, 1, 2, 3, 4]
    batches, skipped = document_windows(stream, EOS, context_length=8, batch_size=4, pad_id=PAD)
    assert skipped == 0 and len(batches) == 1
    x, y = batches[0]
    # window 1: EOS + doc 1 + doc 2 (8 tokens: 7 targets); doc 3 + EOS does not fit after them: window 2
    assert x.tolist() == [[EOS, 5, 6, 7, EOS, 8, 9], [EOS, 1, 2, 3, 4, EOS, PAD]]
    assert y.tolist() == [[5, 6, 7, EOS, 8, 9, EOS], [1, 2, 3, 4, EOS, -100, -100]]
    # every document token and every closing EOS is a target exactly once: as many targets as stream tokens + 1
    assert int((y != -100).sum()) == len(stream) + 1


def test_document_windows_leave_out_a_document_longer_than_the_context():
    batches, skipped = document_windows([1, 2, 3, 4, 5, 0, 6, 0], eos_id=0, context_length=4, batch_size=8, pad_id=9)
    assert skipped == 1
    assert batches[0][1].tolist() == [[6, 0]]


def test_collate_last_index_by_hand():
    ids, mask, last = preference_collate([([1, 2, 3], [4, 5]), ([6], [7, 8, 9, 10])], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 0], [6, 0, 0, 0], [4, 5, 0, 0], [7, 8, 9, 10]]
    assert last.tolist() == [2, 0, 1, 3] and mask.sum(1).tolist() == [3, 1, 2, 4]


def test_document_windows_fill_a_window_exactly():
    # a document of 3 tokens + EOS fills a window of context 4 exactly (EOS boundary + 4 = context + 1 tokens)
    batches, skipped = document_windows([1, 2, 3, 0, 4, 5, 6, 7, 0], eos_id=0, context_length=4, batch_size=8, pad_id=9)
    assert skipped == 1  # the second document (4 tokens + EOS) needs context 5
    x, y = batches[0]
    assert x.tolist() == [[0, 1, 2, 3]] and y.tolist() == [[1, 2, 3, 0]]
    batches, skipped = document_windows([1, 2, 3, 0, 4, 5, 6, 7, 0], eos_id=0, context_length=5, batch_size=8, pad_id=9)
    assert skipped == 0 and batches[0][1].tolist() == [[1, 2, 3, 0, -100], [4, 5, 6, 7, 0]]
