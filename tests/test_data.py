import pytest
import torch

from llm_from_scratch.data import TokenWindowDataset, make_loader


def test_windows_by_hand():
    ds = TokenWindowDataset(list(range(10)), context_length=3)  # windows of 4 tokens, stride 3
    assert len(ds) == 3  # starts 0, 3, 6 (start 9 would need tokens 9..12)
    x, y = ds[1]
    assert x.tolist() == [3, 4, 5] and y.tolist() == [4, 5, 6]
    assert ds[-1][1].tolist() == [7, 8, 9]
    with pytest.raises(IndexError):
        ds[3]


def test_overlapping_stride():
    ds = TokenWindowDataset(torch.arange(10), context_length=4, stride=1)
    assert len(ds) == 6
    assert [ds[i][0][0].item() for i in range(6)] == [0, 1, 2, 3, 4, 5]


def test_too_little_text_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot fill one window"):
        TokenWindowDataset([1, 2, 3], context_length=3)


def test_loader_order_is_seeded():
    ds = TokenWindowDataset(torch.arange(100), context_length=4)
    first = [x[:, 0].tolist() for x, _ in make_loader(ds, batch_size=4, seed=7)]
    again = [x[:, 0].tolist() for x, _ in make_loader(ds, batch_size=4, seed=7)]
    other = [x[:, 0].tolist() for x, _ in make_loader(ds, batch_size=4, seed=8)]
    assert first == again and first != other
    assert sorted(sum(first, [])) == [4 * i for i in range(24)]  # drop_last keeps 24 of 25 windows
