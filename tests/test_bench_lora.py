"""benchmarks/bench_lora.py end to end at the tiny preset, with the fewest steps: the result file's structure, and
LoRA's trainable parameters worked out from the config (rank · Σ (in + out) over the adapted layers)."""

import importlib.util
import json
import sys
from pathlib import Path

import torch

from llm_from_scratch.model import PRESETS

ROOT = Path(__file__).resolve().parents[1]
RANK = 2


def load_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the benchmark imports bench_dpo; sys.path restored after
    spec = importlib.util.spec_from_file_location("bench_lora", ROOT / "benchmarks" / "bench_lora.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_lora", bench)  # its dataclass looks its module up there
    spec.loader.exec_module(bench)
    return bench


def test_a_gpt2_sized_vocabulary_samples_only_the_tokenizers_ids(monkeypatch):
    """GPT-2 presets keep 50,257 ids, the benchmark's tokenizer decodes fewer: sampling must stay inside it, and the
    entropy of the masked distribution must stay finite."""
    bench = load_bench(monkeypatch)
    from llm_from_scratch.generation import generate
    from llm_from_scratch.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, context_length=16, n_layer=1, n_head=2, n_embd=16))
    bench.sample_only_the_tokenizers_ids(model, 10)
    out = generate(model, [[1, 2], [3]], max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    assert int(out.sequences.max()) < 10
    logp = model(torch.tensor([[1, 2, 3]])).log_softmax(-1)
    assert torch.isfinite((logp.exp() * logp).sum(-1)).all()


def test_bench_lora_writes_its_result_and_counts_the_adapters(tmp_path, monkeypatch, capsys):
    bench = load_bench(monkeypatch)
    # its memory processes, one thread each: they are small, and a second thread only contends on a busy 2-core CPU
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bench_lora"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # likewise here
    try:  # in this process (torch is imported already); the memory runs in fresh ones
        bench.main(["--preset", "tiny", "--rank", str(RANK), "--steps", "1", "--rounds", "1", "--memory-steps", "1",
                    "--pairs", "1", "--prompts", "1", "--k", "2", "--max-new-tokens", "2", "--device", "cpu",
                    "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "LoRA / full" in printed and "goal:" in printed
    result = json.loads((out / "result.json").read_text())

    c = PRESETS["tiny"]
    # per block: c_attn C→3C, attn c_proj C→C, c_fc C→4C, mlp c_proj 4C→C: r·(4C + 2C + 5C + 5C) = 16·r·C
    assert result["modes"]["lora"]["trainable_params"] == 16 * RANK * c["n_embd"] * c["n_layer"]
    full, lora = result["modes"]["full"], result["modes"]["lora"]
    assert full["trainable_params"] == full["network_params"] == lora["network_params"]
    # full holds two networks; LoRA one, plus its float32 adapters
    assert full["weights_held_bytes"] == 2 * 4 * full["network_params"]
    assert lora["weights_held_bytes"] == 4 * (lora["network_params"] + lora["trainable_params"])
    expected = result["expected_peak_bytes"]
    assert expected["full"] == 5 * 4 * full["network_params"]
    assert 0 < expected["lora_over_full"] < 1

    assert result["lora"] == {"rank": RANK, "alpha": 2.0 * RANK, "targets": "all"}
    assert {"cpu", "torch", "threads", "device"} <= set(result["machine"])
    assert result["command"].startswith("python benchmarks/bench_lora.py ") and result["mmap_threshold"] == 2**20
    for kind in ("dpo", "rloo"):
        mem, speed = result["memory"][kind], result["speed"][kind]
        for mode in ("full", "lora"):
            assert set(mem[mode]) == {"mode", "kind", "baseline", "peak", "rise", "beyond_expected"}
            assert mem[mode]["beyond_expected"] == mem[mode]["rise"] - expected[mode]
            assert (mem[mode]["mode"], mem[mode]["kind"]) == (mode, kind)
            assert mem[mode]["peak"] >= mem[mode]["baseline"] > 0
            assert len(speed["seconds_per_step"][mode]) == 1 and speed["fastest"][mode] > 0
        assert mem["lora_over_full"] == mem["lora"]["rise"] / mem["full"]["rise"]
        assert isinstance(mem["goal_met"], bool)
        assert speed["lora_over_full"] == speed["fastest"]["lora"] / speed["fastest"]["full"]
    assert result["speed"]["rloo"]["completion_tokens_per_step"]["full"] <= 2 * 1 * 2  # prompts · k · max_new_tokens
