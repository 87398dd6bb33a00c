"""benchmarks/bench_train.py: the MFU arithmetic against a FLOP count worked by hand, the GPU peak table, and one
tiny run on the CPU (the GPU runs are benchmarks/gpu_check.sh's)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from llm_from_scratch.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


def load_bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "benchmarks" / "bench_train.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_train", bench)
    spec.loader.exec_module(bench)
    return bench


def test_mfu_of_a_tiny_config_by_hand(monkeypatch):
    bench = load_bench(monkeypatch)
    V, T, L, C = 16, 8, 2, 4
    model = GPT(GPTConfig(vocab_size=V, context_length=T, n_layer=L, n_head=2, n_embd=C))
    # one block: ln_1 2C + c_attn (C·3C + 3C) + attn c_proj (C·C + C) + ln_2 2C + c_fc (C·4C + 4C) + mlp c_proj
    # (4C·C + C) = 8 + 60 + 20 + 8 + 80 + 68 = 244; two blocks and ln_f (2C): 496 non-embedding weights, and the
    # tied LM head multiplies by V·C = 64 more: N = 560 weights in matrix products
    n_matmul = 2 * 244 + 8 + V * C
    assert n_matmul == 560
    per_token = 6 * n_matmul + 12 * L * C * T  # 3,360 for the weights (forward 2N, backward 4N) + 768 for attention
    assert per_token == 4128
    assert model.flops_per_token() == per_token
    # 1M tokens/s on a 1 TFLOP/s machine: 4.128 GFLOP/s of 1,000. Exact in float64: 1e6 × 4128 is an exact integer,
    # and its one correctly rounded division by 1e12 gives the double nearest 4.128e-3, as the literal does (x2 exact)
    assert bench.mfu(1e6, model.flops_per_token(), 1e12) == 4.128e-3
    assert bench.mfu(2e6, per_token, 1e12) == 2 * 4.128e-3  # linear in the speed


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA GeForce RTX 4090", 165e12),
    ("NVIDIA L40S", None),  # not an L4
    ("Tesla T4", None),
])
def test_gpu_peak_table(monkeypatch, name, peak):
    assert load_bench(monkeypatch).gpu_peak_flops(name) == peak


def test_a_tiny_preset_runs_on_the_cpu_with_a_given_peak(monkeypatch, capsys):
    bench = load_bench(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main(["--device", "cpu", "--preset", "tiny", "--batch", "2", "--steps", "1", "--no-compile",
                    "--no-bf16", "--impls", "sdpa", "--peak-tflops", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "(tiny) 4 layers, 4 heads, 128 dims, context 256, vocab 4096, batch 2" in out
    header = next(line for line in out.splitlines() if line.startswith("attention"))
    assert header.split()[-1] == "MFU/peak" and "vs fp32 eager sdpa" in header
    row = next(line for line in out.splitlines() if line.startswith("sdpa"))
    gflops, at_peak = float(row.split()[4]), float(row.split()[-1].rstrip("%"))
    # GFLOP/s over 1 TFLOP/s, as printed: MFU/peak to 0.1% and GFLOP/s to 0.1 (0.01%), so they differ by ≤ 0.05,
    # plus float noise of the parsing and the division (~1e-16)
    assert at_peak == pytest.approx(gflops / 1000 * 100, abs=0.051)


def test_bad_flags_are_refused(monkeypatch, capsys):
    bench = load_bench(monkeypatch)
    for argv, words in ((["--impls", "flash"], "--impls: a comma-separated list of explicit and sdpa"),
                        (["--no-fp32", "--no-bf16"], "leave nothing to run")):
        with pytest.raises(SystemExit) as stop:
            bench.main(argv)
        assert stop.value.code == 2 and words in capsys.readouterr().err
