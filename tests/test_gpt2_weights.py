"""Appendix C: GPT-2 weights in and out (llm_from_scratch/gpt2_weights.py) and GPT-2's tokenizer from vocab.json.

The reference is Hugging Face's own GPT2LMHeadModel, randomly initialised here and saved to a temporary folder:
nothing is downloaded. Its weights are scrambled (LayerNorm gains and biases too, which start at 1 and 0) so that a
tensor loaded into the wrong place, or not transposed, changes the logits."""

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from llm_from_scratch import gpt2_weights as gw  # noqa: E402
from llm_from_scratch.generation import generate  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig  # noqa: E402
from llm_from_scratch.tokenizer import (  # noqa: E402
    GPT2_SPLIT_PATTERN,
    SPECIAL_TOKENS,
    Tokenizer,
    encode_chat,
    learn_merges,
    ranks_from_merges,
)
from llm_from_scratch.train import load_gpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "chapters" / "appC_gpt2.py"
V, T, C, L, H = 300, 64, 48, 3, 4  # vocabulary (299 ordinary tokens + <|endoftext|>), context, width, layers, heads
TEXT = ("Mia found a red kite in the park. Tom's dog ran after the ball, and they laughed! "
        "The meaning of life is 42, said the old owl; won't you come?\n\n") * 20
PROMPTS = ["Mia found a red kite", "The meaning of life is", "Tom's dog"]


def byte_to_char() -> dict[int, str]:
    """GPT-2's bytes_to_unicode, written independently of the library: the bytes that print as themselves (not the
    space) keep their character, the others get chr(256 + n) in byte order."""
    keep = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def spell(token: bytes) -> str:
    table = byte_to_char()
    return "".join(table[b] for b in token)


def scramble(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random, LayerNorm gains around 1: a tensor in the wrong place changes the function."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if ("ln" in name and name.endswith("weight")) else 0.05 * noise)


@pytest.fixture(scope="module")
def merges():
    return learn_merges(TEXT, V - 1, GPT2_SPLIT_PATTERN)  # 256 bytes + 43 merges = the 299 ordinary tokens


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H,
                                     bos_token_id=V - 1, eos_token_id=V - 1)
    model = transformers.GPT2LMHeadModel(config).eval()
    scramble(model)
    return model


def write_vocab(folder: Path, merges) -> None:
    """GPT-2's tokenizer files for the tiny BPE: vocab.json (ids = ranks, <|endoftext|> last) and merges.txt."""
    ranks = ranks_from_merges(merges)
    vocab = {spell(tb): i for tb, i in ranks.items()} | {"<|endoftext|>": V - 1}
    vocab = dict(sorted(vocab.items()))  # in the file's order the ids are shuffled: an id is read, never counted
    token_bytes = sorted(ranks, key=ranks.get)
    lines = [f"{spell(token_bytes[a])} {spell(token_bytes[b])}" for (a, b), _ in merges]
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def hf_dir(hf_model, merges, tmp_path_factory):
    """save_pretrained's layout: `transformer.`-prefixed names, no lm_head (tied), plus GPT-2's tokenizer files."""
    folder = tmp_path_factory.mktemp("hf_gpt2")
    hf_model.save_pretrained(folder)
    write_vocab(folder, merges)
    return folder


def tensors_of(folder: Path) -> dict:
    return safetensors_torch.load_file(str(folder / "model.safetensors"))


def copy_with(folder: Path, dst: Path, tensors: dict, config: dict | None = None) -> Path:
    """A copy of an HF folder with other tensors (and optionally another config.json)."""
    shutil.copytree(folder, dst)
    safetensors_torch.save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def openai_dir(hf_dir, tmp_path_factory):
    """OpenAI's own layout: no `transformer.` prefix, and the old causal-mask buffers h.{i}.attn.bias."""
    tensors = {name.removeprefix("transformer."): t for name, t in tensors_of(hf_dir).items()}
    for i in range(L):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
    return copy_with(hf_dir, tmp_path_factory.mktemp("openai") / "gpt2", tensors)


def ids_batch() -> torch.Tensor:
    return torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def our_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids)


def our_gpt(seed: int = 3, vocab_size: int = V) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, context_length=T, n_layer=L, n_head=H, n_embd=C))
    scramble(model, seed)
    return model.eval()


# ----------------------------------------------------------------------------- the name map


@pytest.mark.grades("gpt2_weights.hf_to_ours")
def test_hf_to_ours_maps_names_and_marks_the_conv1d_weights():
    assert gw.hf_to_ours("transformer.h.3.attn.c_attn.weight") == ("blocks.3.attn.c_attn.weight", True)
    assert gw.hf_to_ours("h.3.attn.c_attn.weight") == ("blocks.3.attn.c_attn.weight", True)  # OpenAI: no prefix
    assert gw.hf_to_ours("h.11.attn.c_proj.weight") == ("blocks.11.attn.c_proj.weight", True)
    assert gw.hf_to_ours("transformer.h.0.mlp.c_fc.weight") == ("blocks.0.mlp.c_fc.weight", True)
    assert gw.hf_to_ours("transformer.h.0.mlp.c_proj.weight") == ("blocks.0.mlp.c_proj.weight", True)
    assert gw.hf_to_ours("transformer.h.0.mlp.c_proj.bias") == ("blocks.0.mlp.c_proj.bias", False)  # a vector
    assert gw.hf_to_ours("transformer.h.2.ln_1.weight") == ("blocks.2.ln_1.weight", False)
    assert gw.hf_to_ours("transformer.wte.weight") == ("wte.weight", False)
    assert gw.hf_to_ours("wpe.weight") == ("wpe.weight", False)
    assert gw.hf_to_ours("ln_f.bias") == ("ln_f.bias", False)
    assert gw.hf_to_ours("lm_head.weight") == ("lm_head.weight", False)


def test_ours_to_hf_inverts_the_map_for_every_weight():
    for name in our_gpt().state_dict():
        hf_name, transpose = gw.ours_to_hf(name)
        assert hf_name.startswith("transformer.")
        assert gw.hf_to_ours(hf_name) == (name, transpose)


# ----------------------------------------------------------------------------- loading Hugging Face's GPT-2


@pytest.mark.grades("gpt2_weights.hf_to_ours")
@pytest.mark.parametrize("attn_impl", ["explicit", "sdpa"])
@pytest.mark.parametrize("layout", ["save_pretrained", "openai"])
def test_hf_gpt2_loads_with_equal_logits(hf_model, hf_dir, openai_dir, layout, attn_impl):
    folder = hf_dir if layout == "save_pretrained" else openai_dir
    model = gw.load_hf_gpt2(folder, attn_impl=attn_impl)
    assert model.config == GPTConfig(vocab_size=V, context_length=T, n_layer=L, n_head=H, n_embd=C,
                                     attn_impl=attn_impl)
    assert model.lm_head.weight is model.wte.weight  # still one tied matrix
    ids = ids_batch()
    expected = hf_logits(hf_model, ids)
    # two implementations (HF's Conv1D addmm, attention and GELU against ours) of 3 float32 layers: 48- and 192-term
    # sums on activations ≲ 4 and weights ~0.05, each ≲ N·6e-8·Σ|x| ≈ 1e-5 worst case, ~5e-7 typical, on logits ~1;
    # the same bound for every HF-against-ours comparison below
    assert (our_logits(model, ids) - expected).abs().max() < 1e-4
    assert expected.abs().max() > 0.1  # logits that are not all near zero: a wrong weight would show


def test_another_dtype_keeps_the_head_tied(hf_dir):
    full, half = gw.load_hf_gpt2(hf_dir), gw.load_hf_gpt2(hf_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert half.lm_head.weight is half.wte.weight
    assert torch.equal(half.blocks[0].attn.c_proj.weight, full.blocks[0].attn.c_proj.weight.to(torch.bfloat16))


def test_a_sharded_checkpoint_loads(hf_model, hf_dir, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(hf_dir, folder)
    (folder / "model.safetensors").unlink()
    tensors = tensors_of(hf_dir)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        safetensors_torch.save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (folder / gw.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = ids_batch()
    assert (our_logits(gw.load_hf_gpt2(folder), ids) - hf_logits(hf_model, ids)).abs().max() < 1e-4  # as above


def test_a_tied_lm_head_in_the_file_is_accepted(hf_model, hf_dir, tmp_path):
    tensors = tensors_of(hf_dir)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    folder = copy_with(hf_dir, tmp_path / "with_head", tensors)
    ids = ids_batch()
    assert (our_logits(gw.load_hf_gpt2(folder), ids) - hf_logits(hf_model, ids)).abs().max() < 1e-4  # as above


# ----------------------------------------------------------------------------- errors: one line, naming the tensor


def load_error(folder: Path, kind=gw.GPT2WeightsError) -> str:
    with pytest.raises(kind) as info:
        gw.load_hf_gpt2(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_misshapen_tensor_is_named_with_both_shapes(hf_dir, tmp_path):
    tensors = tensors_of(hf_dir)
    tensors["transformer.h.1.attn.c_attn.weight"] = torch.zeros(C, 3 * C - 4)
    message = load_error(copy_with(hf_dir, tmp_path / "bad", tensors))
    assert f"transformer.h.1.attn.c_attn.weight has shape ({C}, {3 * C - 4}), expected ({C}, {3 * C}) " \
           f"for n_embd={C}" in message
    assert "model.safetensors" in message


def test_a_missing_tensor_is_named(openai_dir, tmp_path):
    tensors = tensors_of(openai_dir)
    del tensors["h.2.mlp.c_fc.bias"]
    message = load_error(copy_with(openai_dir, tmp_path / "bad", tensors))
    assert f"no tensor h.2.mlp.c_fc.bias; expected one of shape ({4 * C},)" in message  # as the file spells names


def test_an_unexpected_tensor_is_named(hf_dir, tmp_path):
    tensors = tensors_of(hf_dir)
    tensors[f"transformer.h.{L}.ln_1.weight"] = torch.ones(C)  # one layer more than config.json says
    message = load_error(copy_with(hf_dir, tmp_path / "bad", tensors))
    assert f"unexpected tensor transformer.h.{L}.ln_1.weight of shape ({C},)" in message
    assert f"n_layer={L}" in message


def test_an_untied_lm_head_is_refused(hf_dir, tmp_path):
    tensors = tensors_of(hf_dir)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 0.01
    message = load_error(copy_with(hf_dir, tmp_path / "bad", tensors))
    assert "lm_head.weight differs from the token embedding transformer.wte.weight" in message


@pytest.mark.parametrize("change, words", [
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
    ({"n_inner": 100}, "n_inner=100"),
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"n_head": 5}, "not divisible"),
])
def test_configs_our_gpt_does_not_compute_are_refused(hf_dir, tmp_path, change, words):
    config = json.loads((hf_dir / "config.json").read_text()) | change
    message = load_error(copy_with(hf_dir, tmp_path / "bad", tensors_of(hf_dir), config))
    assert words in message and "config.json" in message


def test_missing_files_say_what_belongs_there_and_how_to_get_it(hf_dir, tmp_path):
    for folder in (tmp_path / "nowhere", tmp_path / "empty"):
        if folder.name == "empty":
            folder.mkdir()
        message = load_error(folder, FileNotFoundError)
        assert str(folder) in message and "--download gpt2" in message
        assert "huggingface.co/openai-community/gpt2" in message
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(hf_dir / "config.json", no_weights)
    message = load_error(no_weights, FileNotFoundError)
    assert "has no model.safetensors" in message and "--download gpt2" in message


def test_a_truncated_weights_file_is_named(hf_dir, tmp_path):
    folder = tmp_path / "truncated"
    shutil.copytree(hf_dir, folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors is truncated or corrupt" in load_error(folder)


# ----------------------------------------------------------------------------- exporting ours to Hugging Face


def test_our_export_loads_into_transformers_with_equal_logits_and_generations(tmp_path):
    model = our_gpt()
    folder = gw.save_hf_gpt2(model, tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["tie_word_embeddings"] is True
    with safetensors_torch.safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(name.startswith("transformer.") for name in f.keys())  # as save_pretrained writes them
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True, local_files_only=True)
    hf.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = ids_batch()
    assert (hf_logits(hf, ids) - our_logits(model, ids)).abs().max() < 1e-4  # HF against ours: see the loading test

    for prompt in ([5, 17, 42], [7], list(range(20, 32))):
        ours = generate(model, [prompt], 10, temperature=0).sequences[0].tolist()
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, pad_token_id=0)[0].tolist()
        assert ours == theirs


def test_export_writes_eos_inside_the_vocabulary(tmp_path):
    tok = Tokenizer.train(TEXT, V)
    folder = gw.save_hf_gpt2(our_gpt(vocab_size=tok.vocab_size), tmp_path / "x", tokenizer=tok)
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == tok.eos_id < config["vocab_size"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gw.save_hf_gpt2(our_gpt(), tmp_path / "y", eos_id=V)
    with pytest.raises(ValueError, match="do not belong together"):
        gw.save_hf_gpt2(our_gpt(vocab_size=V + 5), tmp_path / "z", tokenizer=tok)


def test_round_trip_ours_to_hf_to_ours_is_bit_for_bit(tmp_path):
    model = our_gpt()
    back = gw.load_hf_gpt2(gw.save_hf_gpt2(model, tmp_path / "export"))
    assert back.config == model.config
    original, reloaded = model.state_dict(), back.state_dict()
    assert original.keys() == reloaded.keys()
    for name in original:
        assert torch.equal(original[name], reloaded[name]), name
    assert back.lm_head.weight is back.wte.weight


# ----------------------------------------------------------------------------- a course checkpoint for chapters 5-9


def test_import_gives_a_course_checkpoint_with_grown_vocabulary(hf_model, hf_dir, tmp_path):
    dst = gw.import_hf_gpt2(hf_dir, tmp_path / "gpt2_course")
    tok = Tokenizer.load(dst)  # what every chapter's --init reads
    model = load_gpt(dst, vocab_size=tok.vocab_size)
    assert tok.vocab_size == V + len(SPECIAL_TOKENS) - 1  # <|endoftext|> was GPT-2's already
    assert tok.eos_id == V - 1 and [tok.special_tokens[t] for t in SPECIAL_TOKENS[1:]] == [V, V + 1, V + 2]
    ids = ids_batch()
    logits = our_logits(model, ids)  # (B, T, V + 3)
    assert (logits[..., :V] - hf_logits(hf_model, ids)).abs().max() < 1e-4  # the old ids: GPT-2's own logits (HF's)
    rows = model.wte.weight.detach()
    # new rows: the mean of the old ones. Exact: grow_vocab took this same mean of the same (V, C) float32 rows,
    # copied bit for bit through the checkpoint
    assert torch.equal(rows[V:], rows[:V].mean(dim=0, keepdim=True).expand(3, -1))
    assert model.lm_head.weight is model.wte.weight
    prompt, _ = encode_chat(tok, "Mia found a red kite", "in the park")  # chapter 5's template encodes
    assert max(prompt) < tok.vocab_size
    record = json.loads((dst / "import.json").read_text())
    assert record["vocab_size_before"] == V and record["added_tokens"] == list(SPECIAL_TOKENS[1:])


def test_import_twice_is_a_no_op_and_another_source_rebuilds(hf_dir, tmp_path):
    dst = tmp_path / "gpt2_course"
    gw.import_hf_gpt2(hf_dir, dst)
    stamp = (dst / "model.safetensors").stat().st_mtime_ns
    assert gw.import_hf_gpt2(hf_dir, dst) == dst
    assert (dst / "model.safetensors").stat().st_mtime_ns == stamp  # nothing written again

    tensors = tensors_of(hf_dir)
    tensors["transformer.ln_f.bias"] = tensors["transformer.ln_f.bias"] + 1.0
    other = copy_with(hf_dir, tmp_path / "other", tensors)
    gw.import_hf_gpt2(other, dst)
    assert (dst / "model.safetensors").stat().st_mtime_ns != stamp
    assert torch.equal(load_gpt(dst).ln_f.bias, tensors["transformer.ln_f.bias"])
    assert json.loads((dst / "import.json").read_text())["source"] == str(other.resolve())


# ----------------------------------------------------------------------------- GPT-2's tokenizer from vocab.json


def test_tokenizer_from_vocab_json_has_gpt2s_ranks_and_the_course_special_tokens(hf_dir, merges):
    tok = Tokenizer.gpt2(hf_dir)
    ranks = ranks_from_merges(merges)
    assert tok.ranks == ranks  # vocab.json read back into bytes: the ids are the BPE ranks
    assert tok.special_tokens == {"<|endoftext|>": V - 1, "<|pad|>": V, "<|user|>": V + 1, "<|assistant|>": V + 2}
    reference = Tokenizer.from_ranks(ranks, special_tokens=tok.special_tokens, pattern=GPT2_SPLIT_PATTERN)
    for text in PROMPTS + ["  won't   you\n\ncome? héllo 🙂 ¡ÿ\t", "parkkite dogdog 1234"]:
        ids = tok.encode(text)
        assert ids == reference.encode(text)
        assert tok.decode(ids) == text


def test_tokenizer_from_vocab_json_matches_transformers(hf_dir):
    tok = Tokenizer.gpt2(hf_dir)
    theirs = transformers.GPT2TokenizerFast.from_pretrained(str(hf_dir), local_files_only=True)
    for text in PROMPTS + ["  won't   you\n\ncome? héllo 🙂", "The owl's 42 kites!!"]:
        assert tok.encode(text) == theirs.encode(text), text


def test_save_hf_vocab_writes_gpt2s_files_back(tmp_path, merges, hf_dir):
    """A course tokenizer (4 special tokens, its own ranks) -> vocab.json + merges.txt -> the same tokenizer."""
    tok = Tokenizer.train(TEXT, V)
    folder = gw.save_hf_vocab(tmp_path / "tok", tok.ranks, tok.special_tokens, T)
    back = Tokenizer.gpt2(folder)
    assert back.ranks == tok.ranks and back.special_tokens == tok.special_tokens
    gw.save_hf_vocab(tmp_path / "gpt2_like", ranks_from_merges(merges), {"<|endoftext|>": V - 1})
    assert (tmp_path / "gpt2_like" / "merges.txt").read_text() == (hf_dir / "merges.txt").read_text()
    theirs = transformers.GPT2TokenizerFast.from_pretrained(str(folder), local_files_only=True)
    text = "<|user|>Mia found a kite<|assistant|>in the park<|endoftext|>"
    assert theirs.encode(text) == tok.encode(text, allowed_special="all")


def test_tokenizer_vocab_json_errors_name_the_file(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match="vocab.json.*huggingface.co/openai-community/gpt2"):
        Tokenizer.gpt2(tmp_path)
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    for change, words in (({"a b": 999}, "not a character of GPT-2's byte alphabet"),
                          ({"!": None}, "lacks 1 of the 256 single bytes"),
                          ({"zz": 5}, "gives one id to two tokens")):
        bad = {k: v for k, v in (vocab | change).items() if v is not None}
        (tmp_path / "vocab.json").write_text(json.dumps(bad), encoding="utf-8")
        with pytest.raises(ValueError, match=words):
            Tokenizer.gpt2(tmp_path)


# ----------------------------------------------------------------------------- downloading, with a fake Hub


class FakeHub(types.ModuleType):
    """Stands in for huggingface_hub: model_info lists the files with their size and hashes, hf_hub_download writes
    `served` (which may differ from what the listing promises) into local_dir."""

    def __init__(self, files: dict[str, bytes], served: dict[str, bytes] | None = None, fail: Exception | None = None):
        super().__init__("huggingface_hub")
        self.files, self.served, self.fail = files, served or files, fail
        hub = self

        class HfApi:
            def model_info(self, repo, files_metadata=False):
                if hub.fail is not None:
                    raise hub.fail
                assert files_metadata
                siblings = []
                for name, data in hub.files.items():
                    lfs = ({"size": len(data), "sha256": __import__("hashlib").sha256(data).hexdigest(),
                            "pointer_size": 134} if name.endswith(".safetensors") else None)
                    blob = __import__("hashlib").sha1(b"blob %d\0" % len(data) + data).hexdigest()
                    siblings.append(types.SimpleNamespace(rfilename=name, size=len(data), blob_id=blob, lfs=lfs))
                siblings.append(types.SimpleNamespace(rfilename="pytorch_model.bin", size=1, blob_id="x", lfs=None))
                return types.SimpleNamespace(sha="0123abcd", siblings=siblings)

        self.HfApi = HfApi
        self.fetched = []

    def hf_hub_download(self, repo_id, filename, revision=None, local_dir=None):
        assert repo_id == "openai-community/gpt2" and revision == "0123abcd"
        self.fetched.append(filename)
        path = Path(local_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.served[filename])
        return str(path)


@pytest.fixture
def hub_files(hf_dir):
    names = ("config.json", "model.safetensors", "vocab.json", "merges.txt")
    return {n: (hf_dir / n).read_bytes() for n in names} | {"tokenizer_config.json": b"{}"}


def use_hub(monkeypatch, hub) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setitem(sys.modules, "truststore", None)  # the test process's TLS stays as it is


def test_download_fetches_only_the_files_it_needs_and_checks_them(monkeypatch, tmp_path, hub_files, hf_model):
    hub = FakeHub(hub_files)
    use_hub(monkeypatch, hub)
    folder = gw.download_gpt2("gpt2", tmp_path)
    assert folder == tmp_path / "gpt2"
    assert sorted(hub.fetched) == sorted(hub_files)  # not pytorch_model.bin
    ids = ids_batch()
    assert (our_logits(gw.load_hf_gpt2(folder), ids) - hf_logits(hf_model, ids)).abs().max() < 1e-4  # as above


@pytest.mark.parametrize("file", ["model.safetensors", "vocab.json"])
def test_download_refuses_a_corrupted_file(monkeypatch, tmp_path, hub_files, file):
    served = dict(hub_files)
    data = bytearray(served[file])
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    served[file] = bytes(data)
    use_hub(monkeypatch, FakeHub(hub_files, served))
    with pytest.raises(gw.GPT2DownloadError, match=f"{file}: (sha256|git blob id) .* but the Hub says"):
        gw.download_gpt2("gpt2", tmp_path)
    served[file] = served[file][:-10]
    use_hub(monkeypatch, FakeHub(hub_files, served))
    with pytest.raises(gw.GPT2DownloadError, match=f"{file} has .* bytes but the Hub says"):
        gw.download_gpt2("gpt2", tmp_path)


@pytest.mark.parametrize("error, advice", [
    (ConnectionError("ProxyError: Unable to connect to proxy"), "HTTPS_PROXY"),
    (ConnectionError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"), "pip install truststore"),
    (RuntimeError("Cannot reach https://huggingface.co: offline mode is enabled"), "HF_HUB_OFFLINE"),
    (ConnectionError("Name or service not known"), "could not be reached"),
])
def test_download_failures_say_what_to_do(monkeypatch, tmp_path, hub_files, error, advice):
    use_hub(monkeypatch, FakeHub(hub_files, fail=error))
    with pytest.raises(gw.GPT2DownloadError) as info:
        gw.download_gpt2("gpt2", tmp_path)
    message = str(info.value)
    assert advice in message and "\n" not in message
    assert "https://huggingface.co/openai-community/gpt2/tree/main" in message and "model.safetensors" in message


def test_download_without_the_hub_client_or_with_an_unknown_name(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(gw.GPT2DownloadError, match="pip install huggingface_hub"):
        gw.download_gpt2("gpt2", tmp_path)
    with pytest.raises(ValueError, match="gpt2-medium"):
        gw.download_gpt2("gpt3", tmp_path)


# ----------------------------------------------------------------------------- the appendix's script


@pytest.mark.skipif(not SCRIPT.exists(), reason="the chapter scripts are not part of a copied-out module")
def test_appendix_c_script_runs_quick_on_a_random_gpt2(quick_env, tmp_path):
    out = tmp_path / "appC"
    env = {k: v for k, v in quick_env.items() if k != "LLMFS_GPT2_DIR"}  # no GPT-2 anywhere: the random stand-in
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--quiet", "--out", str(out),
                             "--import-to", str(tmp_path / "course")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RANDOM" in result.stdout and "ch05_sft.py --init" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quick"] is True and summary["weights"] == "random"
    assert summary["round_trip_bit_for_bit"] is True and summary["kv_cache_same_tokens"] is True
    assert summary["transformers_max_abs_logit_diff"] < 1e-4  # HF against ours (2 layers of 32): as the loading test
    assert (out / "report.md").is_file()
    tok = Tokenizer.load(tmp_path / "course")
    assert load_gpt(tmp_path / "course", vocab_size=tok.vocab_size).config.vocab_size == tok.vocab_size

    # a chapter's --init takes the Hugging Face folder itself: imported once into runs/imported/, then trained
    dpo = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch09_dpo.py"), "--quick", "--quiet", "--no-build",
                          "--init", str(out / "random_gpt2"), "--out", str(tmp_path / "dpo_gpt2"), "--lora-rank", "2"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert dpo.returncode == 0, dpo.stdout[-3000:] + dpo.stderr[-3000:]
    assert "is a Hugging Face GPT-2 folder: importing it" in dpo.stdout
    imported = Path(env["LLMFS_RUNS_DIR"]) / "quick" / "imported" / "random_gpt2"
    assert (imported / "import.json").is_file() and (tmp_path / "dpo_gpt2" / "summary.json").is_file()
    assert Tokenizer.load(tmp_path / "dpo_gpt2").vocab_size == tok.vocab_size
