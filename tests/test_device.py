import random

import numpy as np
import pytest
import torch

from llm_from_scratch.device import autocast, available_devices, pick_device, seed_everything


def test_auto_picks_the_best_available():
    assert pick_device("auto").type == available_devices()[0]
    assert pick_device("CPU") == torch.device("cpu")


def test_missing_device_names_what_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="not available.*available: .*cpu"):
        pick_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        pick_device("tpu")


def test_seed_everything_repeats_all_three_generators():
    seed_everything(123)
    a = (random.random(), np.random.rand(), torch.rand(3))
    seed_everything(123)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_autocast_is_off_on_cpu_unless_asked():
    x = torch.randn(4, 4)
    with autocast("cpu"):
        assert (x @ x).dtype == torch.float32
    with autocast("cpu", dtype=torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        autocast("cpu", dtype="fp8")


def test_precision_names():
    from llm_from_scratch.device import choose_dtype, dtype_of

    assert dtype_of("float32") is None and dtype_of("bfloat16") == torch.bfloat16
    assert choose_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        dtype_of("float16")
