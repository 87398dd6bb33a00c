"""Appendix C: OpenAI's GPT-2 weights in and out of our GPT.

Our GPT (model.py) is GPT-2's architecture, so OpenAI's published weights compute the same function in it once three
things are translated:

  1. Names. Hugging Face's `transformer.h.3.attn.c_attn.weight` is our `blocks.3.attn.c_attn.weight`: `h.{i}` is
     `blocks.{i}`, and the `transformer.` prefix goes (OpenAI's own upload has none; `save_pretrained` writes one).
  2. Layout. GPT-2 keeps the four projections of a block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) in its own
     `Conv1D` layer, which stores its weight as (in, out) and computes  y = x W + b,  where nn.Linear stores (out, in)
     and computes  y = x W^T + b.  The same map needs  W_linear = W_conv^T.  Careful: attn.c_proj is square (C x C),
     so forgetting its transpose raises no shape error at all; the model just computes something else. Only comparing
     logits with another implementation catches it (tests/test_gpt2_weights.py does).
  3. The head. GPT-2 scores the next token with the token embedding itself (a tied head), as our GPT does: a file's
     `lm_head.weight`, when it has one, must be the embedding `wte.weight`, or it is a model our GPT cannot hold.

Everything else already agrees: pre-LayerNorm blocks with ε = 1e-5, the tanh GELU, attention scaled by 1/sqrt(head
size), learned positions. config.json is checked to describe exactly that function, and anything else (another
activation, another ε, GPT-2's optional per-layer attention scaling, an MLP not 4C wide) is refused with a one-line
error: loading it would run, and silently compute something else.

A Hugging Face GPT-2 folder: config.json, model.safetensors (or model.safetensors.index.json and its shards), and the
tokenizer's vocab.json + merges.txt (read by `Tokenizer.gpt2(folder)`).

    load_hf_gpt2(folder) -> GPT        save_hf_gpt2(model, folder)      transformers' from_pretrained reads it back
    save_hf_vocab(folder, ranks, ...)  a tokenizer as GPT-2's vocab.json + merges.txt (Tokenizer.gpt2 reads it back)
    import_hf_gpt2(src, dst)           a checkpoint of this course (train.save_gpt + Tokenizer.save), the embedding
                                       grown by the course's special tokens (`grow_vocab`), for chapters 5-9's --init
    download_gpt2(name, cache_dir)     opt-in (a network): the Hub's own client, every file checked by its hash
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

from llm_from_scratch.checkpoint import atomic_write_text, save_tensors
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.tokenizer import EOS_TOKEN, PAD_TOKEN, Tokenizer, _gpt2_byte_to_char
from llm_from_scratch.train import save_gpt

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"  # a sharded checkpoint: {"weight_map": {tensor name: shard file}}
CONV1D = ("c_attn", "c_proj", "c_fc")  # GPT-2's Conv1D layers: their weights are stored (in, out)
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # old transformers' causal-mask buffers: not weights at all
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # two names for GPT-2's tanh approximation of GELU
HUB_MODELS = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
HUB_REQUIRED = ("config.json", WEIGHTS, "vocab.json", "merges.txt")
HUB_OPTIONAL = ("tokenizer.json", "tokenizer_config.json")  # fetched when the repository has them
HOW_TO_GET = ("get one with `python chapters/appC_gpt2.py --download gpt2` (needs a network), or by hand: download "
              "config.json, model.safetensors, vocab.json and merges.txt from "
              "https://huggingface.co/openai-community/gpt2/tree/main into that folder")


class GPT2WeightsError(ValueError):
    """A GPT-2 folder our GPT cannot load: a config it does not compute, or a tensor missing, extra or misshapen."""


class GPT2DownloadError(GPT2WeightsError):
    """The files could not be fetched from the Hub, or arrived different from what the Hub says they are."""


# ----------------------------------------------------------------------------- the name map


def hf_to_ours(name: str) -> tuple[str, bool]:
    """A Hugging Face GPT-2 tensor name -> (our name, whether its matrix must be transposed).

    "transformer.h.3.attn.c_attn.weight" -> ("blocks.3.attn.c_attn.weight", True)
    "h.3.ln_1.bias" (OpenAI's upload: no prefix) -> ("blocks.3.ln_1.bias", False)
    "transformer.wte.weight" -> ("wte.weight", False);  "lm_head.weight" -> ("lm_head.weight", False)
    """
    if name.startswith("transformer."):
        name = name[len("transformer."):]
    if name.startswith("h."):
        name = "blocks." + name[len("h."):]
    parts = name.split(".")
    transpose = parts[-1] == "weight" and parts[-2] in CONV1D  # Conv1D (in, out) -> nn.Linear (out, in)
    return name, transpose


def ours_to_hf(name: str) -> tuple[str, bool]:
    """The reverse map, with the `transformer.` prefix that `save_pretrained` writes:
    "blocks.3.mlp.c_fc.weight" -> ("transformer.h.3.mlp.c_fc.weight", True)."""
    if name.startswith("blocks."):
        name = "h." + name[len("blocks."):]
    parts = name.split(".")
    transpose = parts[-1] == "weight" and parts[-2] in CONV1D
    return "transformer." + name, transpose


# ----------------------------------------------------------------------------- config.json


def read_hf_config(folder: str | os.PathLike) -> dict:
    """config.json of a Hugging Face folder; a missing folder or file says what belongs there and how to get it."""
    folder = Path(folder)
    file = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist: expected a Hugging Face GPT-2 folder; {HOW_TO_GET}")
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: expected a Hugging Face GPT-2 folder; {HOW_TO_GET}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise GPT2WeightsError(f"{file} is not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(config, dict):
        raise GPT2WeightsError(f"{file} is not a model configuration (expected a JSON object)")
    return config


def gpt_config_from_hf(hf: dict, file: str | os.PathLike = "config.json", attn_impl: str = "sdpa") -> GPTConfig:
    """Our GPTConfig from a Hugging Face GPT-2 config, after checking it describes the function our GPT computes.
    Dropout is 0, as everywhere in this course's fine-tuning (GPT-2 pretrained with 0.1)."""
    def need(key: str) -> int:
        if not isinstance(hf.get(key), int):
            raise GPT2WeightsError(f"{file}: no integer {key!r}: not a GPT-2 config")
        return hf[key]

    def refuse(what: str) -> None:
        raise GPT2WeightsError(f"{file}: {what}: our GPT (model.py) does not compute that, so it refuses to load it")

    if hf.get("model_type", "gpt2") != "gpt2":
        refuse(f"model_type={hf['model_type']!r} is not GPT-2")
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        refuse(f"activation_function={act!r} is not GPT-2's tanh GELU ({' or '.join(TANH_GELUS)})")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if abs(eps - 1e-5) > 1e-12:
        refuse(f"layer_norm_epsilon={eps} (ours is nn.LayerNorm's 1e-5)")
    for flag, ours in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if bool(hf.get(flag, ours)) != ours:
            refuse(f"{flag}={hf[flag]}")
    n_embd = need("n_embd")
    if hf.get("n_inner") not in (None, 4 * n_embd):
        refuse(f"n_inner={hf['n_inner']} (our MLP is 4 x n_embd = {4 * n_embd} wide)")
    positions = hf.get("n_positions", hf.get("n_ctx"))
    if not isinstance(positions, int):
        raise GPT2WeightsError(f"{file}: no integer 'n_positions': not a GPT-2 config")
    try:
        return GPTConfig(vocab_size=need("vocab_size"), context_length=positions, n_layer=need("n_layer"),
                         n_head=need("n_head"), n_embd=n_embd, dropout=0.0, bias=True, attn_impl=attn_impl)
    except ValueError as err:  # n_embd not divisible by n_head, an unknown attn_impl
        raise GPT2WeightsError(f"{file}: {err}") from None


def hf_config_from_ours(config: GPTConfig, eos_id: int | None = None, bos_id: int | None = None) -> dict:
    """The config.json `transformers` needs to rebuild our GPT as a GPT2LMHeadModel."""
    for what, i in (("eos_id", eos_id), ("bos_id", bos_id)):
        if i is not None and not 0 <= i < config.vocab_size:
            raise ValueError(f"save_hf_gpt2: {what}={i} is outside the vocabulary of {config.vocab_size} tokens")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.context_length, "n_ctx": config.context_length,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eos_id if bos_id is None else bos_id, "eos_token_id": eos_id,  # GPT-2: one token for both
    }


# ----------------------------------------------------------------------------- the weights


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a folder: model.safetensors, or the shards model.safetensors.index.json names."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
            raise GPT2WeightsError(f"{folder / INDEX} is not a safetensors index (expected "
                                   '{"weight_map": {tensor: shard file}})') from None
        for shard in shards:
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{folder / INDEX} names the shard {shard}, which is not in {folder}")
        return [folder / s for s in shards]
    raise FileNotFoundError(f"{folder} has no {WEIGHTS} (nor a sharded {INDEX}): expected a Hugging Face GPT-2 "
                            f"folder; {HOW_TO_GET}")


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """{tensor name: (its file, its shape)}, read from the files' headers only (no tensor is loaded yet)."""
    import safetensors

    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in found:
                        raise GPT2WeightsError(f"{file}: tensor {name} is also in {found[name][0]}")
                    found[name] = (file, tuple(f.get_slice(name).get_shape()))
        except (safetensors.SafetensorError, OSError) as err:
            raise GPT2WeightsError(f"{file} is truncated or corrupt ({type(err).__name__}: {err})") from None
    return found


def _shape_reason(our_name: str, c: GPTConfig) -> str:
    """Which numbers of config.json fix a tensor's shape (said in the error when it does not fit)."""
    if our_name in ("wte.weight", "lm_head.weight"):
        return f"vocab_size={c.vocab_size}, n_embd={c.n_embd}"
    if our_name == "wpe.weight":
        return f"n_positions={c.context_length}, n_embd={c.n_embd}"
    return f"n_embd={c.n_embd}"


def _plan_load(found: dict[str, tuple[Path, tuple[int, ...]]], model: GPT) -> dict[str, tuple[str, Path, bool]]:
    """{our name: (the file's name for it, its file, transpose)} for every weight of `model`, and the file's
    lm_head.weight (checked later to be the embedding), after checking that nothing is missing, extra or misshapen."""
    c = model.config
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}  # (out, in) for every nn.Linear
    prefix = "transformer." if any(n.startswith("transformer.") for n in found) else ""  # how this file spells names
    plan: dict[str, tuple[str, Path, bool]] = {}
    for hf_name, (file, shape) in found.items():
        if hf_name.endswith(MASK_BUFFERS):
            continue
        ours, transpose = hf_to_ours(hf_name)
        if ours not in expected:
            raise GPT2WeightsError(f"{file}: unexpected tensor {hf_name} of shape {shape}: a GPT-2 of n_layer="
                                   f"{c.n_layer} (config.json) has no such weight")
        if ours in plan:
            raise GPT2WeightsError(f"{file}: {hf_name} and {plan[ours][0]} are both {ours}")
        want = expected[ours][::-1] if transpose else expected[ours]  # how the file must store it
        if shape != want:
            raise GPT2WeightsError(f"{file}: {hf_name} has shape {shape}, expected {want} for "
                                   f"{_shape_reason(ours, c)}")
        plan[ours] = (hf_name, file, transpose)
    missing = [name for name in expected if name not in plan and name != "lm_head.weight"]  # the head: tied
    if missing:
        hf_name, transpose = ours_to_hf(missing[0])
        hf_name = prefix + hf_name[len("transformer."):]
        want = expected[missing[0]][::-1] if transpose else expected[missing[0]]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        files = ", ".join(sorted({str(f) for f, _ in found.values()})) or "the weights file"
        raise GPT2WeightsError(f"{files}: no tensor {hf_name}{more}; expected one of shape {want} for "
                               f"{_shape_reason(missing[0], c)}")
    return plan


def load_hf_gpt2(path: str | os.PathLike, device: str | torch.device = "cpu", attn_impl: str = "sdpa",
                 dtype: torch.dtype | None = None) -> GPT:
    """A Hugging Face GPT-2 folder -> our GPT (float32 unless `dtype`), with every tensor checked.

    The model is built on the "meta" device (shapes, no memory, no random initialisation to throw away), then given
    memory and filled one tensor at a time straight from the files, so loading needs the model's memory once."""
    import safetensors

    folder = Path(path)
    config = gpt_config_from_hf(read_hf_config(folder), folder / "config.json", attn_impl)
    files = weight_files(folder)
    with torch.device("meta"):
        model = GPT(config)
    plan = _plan_load(_tensor_shapes(files), model)
    model = model.to_empty(device=device).to(dtype or torch.float32)
    model.lm_head.weight = model.wte.weight  # to_empty gives every name its own memory: tie the head again
    with torch.no_grad():
        for file in files:
            with safetensors.safe_open(str(file), framework="pt") as f:
                for ours, (hf_name, where, transpose) in plan.items():
                    if where == file and ours != "lm_head.weight":
                        t = f.get_tensor(hf_name)
                        model.get_parameter(ours).copy_(t.t() if transpose else t)
        if "lm_head.weight" in plan:  # a file that stores the head must store the embedding again
            hf_name, where, _ = plan["lm_head.weight"]
            with safetensors.safe_open(str(where), framework="pt") as f:
                head = f.get_tensor(hf_name).to(device=model.wte.weight.device, dtype=model.wte.weight.dtype)
            if not torch.equal(head, model.wte.weight):
                diff = float((head - model.wte.weight).abs().max())
                raise GPT2WeightsError(f"{where}: {hf_name} differs from the token embedding {plan['wte.weight'][0]} "
                                       f"(largest difference {diff:.3g}): an untied output head, which our GPT cannot "
                                       "hold (model.py ties the head to the embedding)")
    return model


def save_hf_gpt2(model: GPT, path: str | os.PathLike, tokenizer: Tokenizer | None = None, eos_id: int | None = None,
                 bos_id: int | None = None) -> Path:
    """Our GPT -> a Hugging Face GPT-2 folder that `transformers.GPT2LMHeadModel.from_pretrained` loads with no
    missing or unexpected weight: config.json and model.safetensors (`transformer.`-prefixed names, the Conv1D
    matrices transposed back to (in, out), the tied head stored once as the embedding), written atomically.

    eos_id/bos_id: the EOS (and BOS) token id written into config.json; default the tokenizer's EOS, else GPT-2's
    50256 when the vocabulary has it. With a tokenizer (of the model's vocabulary size), its files are written too
    (vocab.json, merges.txt, tokenizer_config.json: `save_hf_vocab`)."""
    c = model.config
    if not c.bias:
        raise ValueError("save_hf_gpt2: this GPT has no biases (bias=False), and GPT-2's layout always has them")
    if tokenizer is not None and tokenizer.vocab_size != c.vocab_size:
        raise ValueError(f"save_hf_gpt2: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                         f"is {c.vocab_size}: they do not belong together")
    if eos_id is None:
        eos_id = tokenizer.eos_id if tokenizer is not None else (50256 if c.vocab_size > 50256 else None)
    folder = Path(path)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: transformers re-ties it to the embedding (tie_word_embeddings)
        hf_name, transpose = ours_to_hf(name)
        tensors[hf_name] = (t.t() if transpose else t).detach().contiguous()  # (out, in) -> Conv1D's (in, out)
    save_tensors(folder / WEIGHTS, tensors, metadata={"format": "pt"})
    config = hf_config_from_ours(c, eos_id, bos_id)
    atomic_write_text(folder / "config.json", json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        save_hf_vocab(folder, tokenizer.ranks, tokenizer.special_tokens, c.context_length)
    return folder


# ----------------------------------------------------------------------------- the tokenizer's files


def _split_in_two(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens BPE joins into `token`: encode its bytes with only the tokens ranked below it (merges.txt's
    line for it). Raises when no merge makes it (ranks BPE could never produce)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, i = min((ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
        if best >= rank:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"save_hf_vocab: token {token!r} (rank {rank}) is not the merge of two earlier tokens")
    return parts[0], parts[1]


def save_hf_vocab(folder: str | os.PathLike, ranks: dict[bytes, int], special_tokens: dict[str, int],
                  context_length: int | None = None) -> Path:
    """A tokenizer in GPT-2's byte-level files: vocab.json {spelled token: id} (the special tokens included, as GPT-2's
    has <|endoftext|>), merges.txt (one "A B" line per merged token, in rank order) and tokenizer_config.json (which
    of them are special). Read back by `Tokenizer.gpt2(folder)` and by transformers' GPT2Tokenizer(Fast). Both split
    text with GPT-2's pattern: for the course's tokenizer, which splits numbers into digits, that changes nothing,
    since its BPE never learned a merge of two digits."""
    folder = Path(folder)
    spell = _gpt2_byte_to_char()
    vocab = {"".join(spell[b] for b in token): i for token, i in ranks.items()}
    vocab.update(special_tokens)
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            a, b = _split_in_two(token, rank, ranks)
            merges.append("".join(spell[x] for x in a) + " " + "".join(spell[x] for x in b))
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
              "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN}
    if context_length is not None:
        config["model_max_length"] = context_length
    if PAD_TOKEN in special_tokens:
        config["pad_token"] = PAD_TOKEN
    others = [t for t in special_tokens if t not in (EOS_TOKEN, PAD_TOKEN)]
    if others:
        config["additional_special_tokens"] = others
    vocab_sorted = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    atomic_write_text(folder / "vocab.json", json.dumps(vocab_sorted, ensure_ascii=False) + "\n")
    atomic_write_text(folder / "merges.txt", "#version: 0.2\n" + "".join(m + "\n" for m in merges))
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return folder


# ----------------------------------------------------------------------------- a checkpoint for chapters 5-9


def grow_vocab(model: GPT, vocab_size: int) -> GPT:
    """A copy of `model` whose embedding (and tied head) has `vocab_size` rows: the old rows, then new ones.

    Each new row is the mean of the old rows. The head scores token v with h . E_v, linear in the row, so a mean row
    scores h . mean(E) = the mean of the real tokens' logits, in every context: a new token starts as likely as an
    average token, and the model's distribution over the old ones barely moves. A zero row would score exactly 0
    whatever the real tokens score (far above or below them), and a random row would score at random; fed as input,
    the mean row is an average token too, not a vector unlike any the model has seen (Hewitt, 2021)."""
    old = model.wte.weight.detach()  # (V_old, C)
    n_old = old.size(0)
    if vocab_size < n_old:
        raise ValueError(f"grow_vocab: {vocab_size} tokens is fewer than the model's {n_old}")
    new_rows = old.mean(dim=0, keepdim=True).expand(vocab_size - n_old, -1)  # (V_new - V_old, C)
    state = dict(model.state_dict())
    state["wte.weight"] = state["lm_head.weight"] = torch.cat([old, new_rows])  # (V_new, C)
    with torch.device("meta"):
        grown = GPT(dataclasses.replace(model.config, vocab_size=vocab_size))
    grown = grown.to_empty(device=old.device).to(old.dtype)
    grown.lm_head.weight = grown.wte.weight  # tie again after to_empty
    grown.load_state_dict(state)
    return grown


def _sha256(files: list[Path]) -> str:
    h = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def import_hf_gpt2(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """A Hugging Face GPT-2 folder -> a checkpoint of this course in `dst` (model.safetensors + config.json of kind
    "gpt", and the tokenizer of `Tokenizer.save`), so every chapter script's `--init dst` starts from GPT-2.

    The tokenizer is GPT-2's BPE from src/vocab.json (tiktoken's download when there is none) plus the course's special
    tokens: <|endoftext|> is GPT-2's own (id 50256); <|pad|>, <|user|>, <|assistant|> get ids after it, so the
    embedding grows by their rows (`grow_vocab`). dst/import.json records the source and the sha256 of its weights
    and vocabulary: a second call with the same source does nothing, a different source rebuilds."""
    src, dst = Path(src), Path(dst)
    read_hf_config(src)  # a clear error for a folder that is not one
    record = {"source": str(src.resolve()), "weights_sha256": _sha256(weight_files(src)),
              "vocab_sha256": _sha256([src / "vocab.json"]) if (src / "vocab.json").is_file() else None}
    done = dst / "import.json"
    if done.is_file() and all((dst / f).is_file() for f in ("model.safetensors", "config.json",
                                                             Tokenizer.FILE_RANKS, Tokenizer.FILE_META)):
        try:
            previous = json.loads(done.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            previous = {}
        if all(previous.get(k) == record[k] for k in ("weights_sha256", "vocab_sha256")):
            return dst  # already imported from these very files
    done.unlink(missing_ok=True)  # until the new import is complete, dst holds no finished one

    tok = Tokenizer.gpt2(src) if record["vocab_sha256"] else Tokenizer.gpt2()
    model = load_hf_gpt2(src)
    n_old = model.config.vocab_size
    ordinary = max([*tok.ranks.values(), tok.eos_id]) + 1  # ids GPT-2 was trained with: they must have rows
    if ordinary > n_old or tok.vocab_size < n_old:
        raise GPT2WeightsError(f"{src}: the tokenizer (vocab.json) has {tok.vocab_size} tokens, ids up to "
                               f"{ordinary - 1} before the added ones, but the embedding has {n_old} rows: they do not "
                               "belong together")
    model = grow_vocab(model, tok.vocab_size)
    save_gpt(model, dst)
    tok.save(dst)
    added = [t for t, i in tok.special_tokens.items() if i >= n_old]
    record.update(vocab_size_before=n_old, vocab_size=tok.vocab_size, added_tokens=added,
                  new_rows="the mean of the old rows")
    atomic_write_text(done, json.dumps(record, indent=2) + "\n")  # last: marks the import finished
    return dst


# ----------------------------------------------------------------------------- downloading (opt-in)


def _git_blob_sha1(path: Path) -> str:
    """The id git (and the Hub) gives a small file: sha1 of "blob <size>\\0" + its bytes."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_hub_file(path: Path, size: int | None, sha256: str | None, blob_id: str | None) -> None:
    """A downloaded file against the Hub's metadata: its size, and its sha256 (LFS files, the weights) or its git
    blob id (small files). A mismatch is a GPT2DownloadError naming the file and both values."""
    got = path.stat().st_size
    if size is not None and got != size:
        raise GPT2DownloadError(f"{path} has {got:,} bytes but the Hub says {size:,}: an interrupted or corrupted "
                                "download; delete it and download again")
    if sha256 is not None:
        digest = _sha256([path])
        if digest != sha256:
            raise GPT2DownloadError(f"{path}: sha256 {digest} but the Hub says {sha256}: a corrupted download; "
                                    "delete it and download again")
    elif blob_id is not None and _git_blob_sha1(path) != blob_id:
        raise GPT2DownloadError(f"{path}: git blob id {_git_blob_sha1(path)} but the Hub says {blob_id}: a corrupted "
                                "download; delete it and download again")


def _download_advice(err: BaseException, repo: str, folder: Path, files: list[str]) -> str:
    """One line: what went wrong, and what to do about it (proxy, certificates, offline, or the files by hand)."""
    chain, e = [], err
    while e is not None and len(chain) < 8:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = " | ".join(chain).lower()
    if "offline" in text:
        hint = "downloads are switched off (HF_HUB_OFFLINE=1): unset it, or copy the files by hand"
    elif "proxy" in text:
        hint = "a proxy refused or failed: set HTTPS_PROXY=http://host:port to the proxy this network needs"
    elif "ssl" in text or "certificate" in text:
        hint = ("the TLS certificate was not trusted (a company proxy?): `pip install truststore` (then the system's "
                "certificates are used), or point SSL_CERT_FILE / REQUESTS_CA_BUNDLE at your CA bundle")
    else:
        hint = "huggingface.co could not be reached: check the network (behind a proxy: HTTPS_PROXY=http://host:port)"
    cause = chain[0].replace("\n", " ")[:300]
    return (f"could not download {repo} into {folder} ({cause}). {hint}. Without a network, copy "
            f"{', '.join(files)} from https://huggingface.co/{repo}/tree/main (on a machine with one) into {folder}")


def download_gpt2(name: str = "gpt2", cache_dir: str | os.PathLike = "runs") -> Path:
    """OpenAI's GPT-2 (`name`: gpt2, gpt2-medium, gpt2-large or gpt2-xl, the Hub's `openai-community/<name>`) into
    cache_dir/name, with the Hub's own client `huggingface_hub`: config.json, model.safetensors, vocab.json,
    merges.txt and the tokenizer files only, at one revision, each checked against the size and hash the Hub lists
    for it. Files already there and intact are not fetched again. Needs a network; nothing else in the course does."""
    if name not in HUB_MODELS:
        raise ValueError(f"download_gpt2: unknown model {name!r}: choose one of {', '.join(HUB_MODELS)}")
    try:
        import huggingface_hub
    except ImportError:
        raise GPT2DownloadError("downloading GPT-2 needs the Hub's client: `pip install huggingface_hub`") from None
    try:  # the system's certificate store (company proxies), when truststore is installed
        import truststore

        truststore.inject_into_ssl()
    except ImportError:
        pass
    repo, folder = HUB_MODELS[name], Path(cache_dir) / name
    wanted = list(HUB_REQUIRED)
    try:
        info = huggingface_hub.HfApi().model_info(repo, files_metadata=True)
        listed = {s.rfilename: s for s in info.siblings}
        missing = [f for f in HUB_REQUIRED if f not in listed]
        if missing:
            raise GPT2DownloadError(f"{repo} on the Hub has no {', '.join(missing)}: this course reads "
                                    f"{', '.join(HUB_REQUIRED)}")
        wanted += [f for f in HUB_OPTIONAL if f in listed]
        for f in wanted:
            huggingface_hub.hf_hub_download(repo_id=repo, filename=f, revision=info.sha, local_dir=folder)
    except GPT2DownloadError:
        raise
    except Exception as err:  # the client's errors: network, proxy, TLS, offline mode, ...
        raise GPT2DownloadError(_download_advice(err, repo, folder, wanted)) from err
    for f in wanted:
        s = listed[f]
        lfs = s.lfs
        sha256 = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
        check_hub_file(folder / f, s.size, sha256, s.blob_id)
    return folder
