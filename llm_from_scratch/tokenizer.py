"""Byte-level BPE, trained from scratch and served by tiktoken.

Byte-pair encoding (Sennrich et al. 2016; GPT-2's byte-level variant):

    1. Split the text into chunks with a regex (words, numbers, punctuation, spaces),
       so that no token ever crosses a chunk boundary.
    2. Start from the 256 single bytes: every chunk is a list of byte ids 0..255.
    3. Repeat until the vocabulary is full: count every adjacent pair (a, b) in the
       corpus, take the most frequent one, give it a new id, and replace every
       occurrence of (a, b) by that id (left to right, non-overlapping).

The result is tiktoken's format: ``ranks: dict[bytes, int]``, the byte string of each
token and its rank (0..255 are the single bytes, then the merges in the order they
were learned). Encoding a chunk with ranks (tiktoken's algorithm, ``bpe_encode``
below): start from single bytes and repeatedly merge the adjacent pair whose
concatenation has the lowest rank, until no adjacent pair is in the vocabulary.

Ties between equally frequent pairs are broken by the smallest (a, b) id pair, in
both trainers, so the naive and the fast trainer learn exactly the same merges.
A pair whose bytes are already a token (e.g. "ab"+"c" after "a"+"bc") is never
merged: tiktoken needs every token's bytes to be unique.

The special tokens live here, and so does what is built from them alone: the chat template

    <|user|> prompt <|assistant|> response <|endoftext|>

(`encode_chat`, used by SFT, the reward model and every RL chapter) and the padding of token rows
into a batch (`pad_right`, with `<|pad|>`, which is never the EOS).
"""

from __future__ import annotations

import base64
import heapq
import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex
import tiktoken
import torch
from tqdm import tqdm

from llm_from_scratch.checkpoint import atomic_write_text

# GPT-2's split pattern, in tiktoken's equivalent but faster form (possessive
# quantifiers). Contractions | letters | numbers | punctuation | whitespace.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

# The course's pattern: GPT-2's, but numbers are split into single digits (as the
# LLaMA tokenizers do), so "123" is always the tokens "1" "2" "3" and a tiny model
# can learn carrying instead of memorising a table of number tokens.
COURSE_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++|\p{N}| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

Pair = tuple[int, int]
Merge = tuple[Pair, int]  # ((id_a, id_b), how often the pair occurred when it was merged)


# ----------------------------------------------------------------------------- training


def _check_training_args(text: str, vocab_size: int) -> None:
    if not text:
        raise ValueError("train_bpe: the training text is empty; give it some text to learn merges from")
    if vocab_size < 256:
        raise ValueError(f"train_bpe: vocab_size={vocab_size} is below 256, the number of single bytes")


def merge_pair(ids: list[int], pair: Pair, new_id: int) -> list[int]:
    """Replace every occurrence of `pair` in `ids` by `new_id`, left to right."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def learn_merges_naive(text: str, vocab_size: int, pattern: str = GPT2_SPLIT_PATTERN) -> list[Merge]:
    """The teaching version: recount every pair of the whole corpus before each merge.

    The text is split into chunks by `pattern` (pairs never cross a chunk), each chunk a list of byte values. Each
    step counts every adjacent pair (a, b) in every chunk, takes the most frequent (ties: the smallest pair) among
    those whose bytes are not already a token, replaces it everywhere by the new id 256, 257, ... (merge_pair) and
    records (pair, count). It stops at vocab_size tokens or when no pair is left.
    O(merges x corpus length): fine for a paragraph, hopeless for a megabyte.
    """
    _check_training_args(text, vocab_size)
    chunks = [list(c.encode("utf-8")) for c in regex.findall(pattern, text)]
    token_bytes = [bytes([i]) for i in range(256)]
    known = set(token_bytes)
    merges: list[Merge] = []
    for new_id in range(256, vocab_size):
        counts = Counter()
        for ids in chunks:
            counts.update(zip(ids, ids[1:]))
        # most frequent first, then the smallest pair; skip pairs whose bytes are already a token
        candidates = [(-n, p) for p, n in counts.items() if token_bytes[p[0]] + token_bytes[p[1]] not in known]
        if not candidates:
            break  # every chunk is a single token: nothing left to merge
        neg_count, pair = min(candidates)
        chunks = [merge_pair(ids, pair, new_id) for ids in chunks]
        token_bytes.append(token_bytes[pair[0]] + token_bytes[pair[1]])
        known.add(token_bytes[-1])
        merges.append((pair, -neg_count))
    return merges


def learn_merges(text: str, vocab_size: int, pattern: str = GPT2_SPLIT_PATTERN, progress: bool = False) -> list[Merge]:
    """The fast version; learns exactly the merges of `learn_merges_naive`.

    Three ideas make it fast:
      * identical chunks are counted once (a word that occurs 10,000 times is one entry with weight 10,000);
      * pair counts are kept up to date after each merge, touching only the chunks that contain the merged pair
        (`where[pair]` indexes them);
      * the best pair comes off a max-heap of (-count, pair); entries made stale by later updates are skipped
        when popped (lazy deletion), and every count change pushes a fresh entry.
    """
    _check_training_args(text, vocab_size)
    chunk_counts = Counter(regex.findall(pattern, text))
    words = [list(c.encode("utf-8")) for c in chunk_counts]  # distinct chunks as byte ids
    freqs = list(chunk_counts.values())  # how often each distinct chunk occurs

    pair_counts: dict[Pair, int] = defaultdict(int)
    where: dict[Pair, set[int]] = defaultdict(set)  # pair -> indices of words that (may) contain it
    for w, ids in enumerate(words):
        for pair in zip(ids, ids[1:]):
            pair_counts[pair] += freqs[w]
            where[pair].add(w)
    heap = [(-n, pair) for pair, n in pair_counts.items()]
    heapq.heapify(heap)

    token_bytes = [bytes([i]) for i in range(256)]
    known = set(token_bytes)
    merges: list[Merge] = []
    bar = _progress(vocab_size - 256, "BPE merges") if progress else None
    for new_id in range(256, vocab_size):
        # 1. the most frequent pair that is still current and makes a new token
        best = None
        while heap:
            neg_count, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) != -neg_count or neg_count == 0:
                continue  # stale entry: the count changed after it was pushed
            if token_bytes[pair[0]] + token_bytes[pair[1]] in known:
                continue  # same rule as the naive trainer: bytes must stay unique
            best = (pair, -neg_count)
            break
        if best is None:
            break
        pair, count = best

        # 2. merge it in every word that contains it, updating the pair counts of just those words
        changed: set[Pair] = set()
        for w in where.pop(pair):
            ids = words[w]
            merged = merge_pair(ids, pair, new_id)
            if len(merged) == len(ids):
                continue  # `where` is lazy: this word lost the pair in an earlier merge
            for p in zip(ids, ids[1:]):
                pair_counts[p] -= freqs[w]
                changed.add(p)
            for p in zip(merged, merged[1:]):
                pair_counts[p] += freqs[w]
                where[p].add(w)
                changed.add(p)
            words[w] = merged
        del pair_counts[pair]
        changed.discard(pair)
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))

        token_bytes.append(token_bytes[pair[0]] + token_bytes[pair[1]])
        known.add(token_bytes[-1])
        merges.append((pair, count))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.total = len(merges)  # out of pairs early: end the bar at 100% of the merges there were
        bar.refresh()
        bar.close()
    return merges


def ranks_from_merges(merges: list[Merge]) -> dict[bytes, int]:
    """tiktoken-style ranks: the 256 single bytes, then one token per merge, in order."""
    token_bytes = [bytes([i]) for i in range(256)]
    for (a, b), _count in merges:
        token_bytes.append(token_bytes[a] + token_bytes[b])
    return {tb: rank for rank, tb in enumerate(token_bytes)}


def train_bpe_naive(text: str, vocab_size: int, pattern: str = GPT2_SPLIT_PATTERN) -> dict[bytes, int]:
    """Ranks learned by the naive trainer (for teaching and for checking the fast one)."""
    return ranks_from_merges(learn_merges_naive(text, vocab_size, pattern))


def train_bpe(text: str, vocab_size: int, pattern: str = GPT2_SPLIT_PATTERN,
              progress: bool = False) -> dict[bytes, int]:
    """Ranks learned by the fast trainer. Fewer than `vocab_size` when the text runs out of pairs."""
    return ranks_from_merges(learn_merges(text, vocab_size, pattern, progress=progress))


def _progress(total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="merge")


# ----------------------------------------------------------------------------- encoding


def _encode_chunk(chunk: bytes, ranks: dict[bytes, int]) -> list[int]:
    if chunk in ranks:
        return [ranks[chunk]]
    parts = [chunk[i : i + 1] for i in range(len(chunk))]
    while len(parts) > 1:
        # the adjacent pair whose concatenation has the lowest rank (the first one on a tie)
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[p] for p in parts]


def bpe_encode(text: str, ranks: dict[bytes, int], pattern: str = GPT2_SPLIT_PATTERN) -> list[int]:
    """Pure-Python reference encoder: the same tokens as `tiktoken.Encoding` with these ranks and pattern."""
    ids: list[int] = []
    for chunk in regex.findall(pattern, text):
        ids.extend(_encode_chunk(chunk.encode("utf-8"), ranks))
    return ids


def bpe_decode(ids: Iterable[int], ranks: dict[bytes, int]) -> str:
    """Inverse of `bpe_encode` (invalid UTF-8 at a cut becomes U+FFFD, as in tiktoken)."""
    vocab = {rank: tb for tb, rank in ranks.items()}
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- the Tokenizer


class Tokenizer:
    """A trained (or GPT-2's) BPE served by `tiktoken.Encoding`, plus the course's special tokens.

    Special tokens: `<|endoftext|>` ends a document or a chat reply (EOS), `<|pad|>` pads batches
    (never equal to EOS, so padding can be told apart from a real end), `<|user|>` and
    `<|assistant|>` open the turns of the chat template.
    """

    FILE_RANKS = "tokenizer.tiktoken"  # tiktoken's own format: "<base64 bytes> <rank>" per line
    FILE_META = "tokenizer.json"  # pattern, special tokens, name

    def __init__(self, encoding: tiktoken.Encoding, pattern: str):
        for tok in (EOS_TOKEN, PAD_TOKEN):
            if tok not in encoding._special_tokens:
                raise ValueError(f"Tokenizer: the encoding {encoding.name!r} has no {tok!r} special token")
        self.encoding = encoding
        self.pattern = pattern

    # --- construction
    @classmethod
    def from_ranks(
        cls,
        ranks: dict[bytes, int],
        special_tokens: dict[str, int] | None = None,
        pattern: str = GPT2_SPLIT_PATTERN,
        name: str = "llmfs-bpe",
    ) -> Tokenizer:
        """Build from tiktoken-style ranks; special tokens default to the course's four, after the ranks."""
        if special_tokens is None:
            first = max(ranks.values()) + 1
            special_tokens = {tok: first + i for i, tok in enumerate(SPECIAL_TOKENS)}
        clash = set(special_tokens.values()) & set(ranks.values())
        if clash:
            raise ValueError(f"Tokenizer.from_ranks: special token ids {sorted(clash)} are also ordinary token ranks")
        enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_tokens)
        return cls(enc, pattern)

    @classmethod
    def train(
        cls, text: str, vocab_size: int, pattern: str = COURSE_SPLIT_PATTERN, progress: bool = False
    ) -> Tokenizer:
        """Train BPE on `text` so that ordinary tokens + the four special tokens make `vocab_size` in all."""
        n_ordinary = vocab_size - len(SPECIAL_TOKENS)
        if n_ordinary < 256:
            raise ValueError(
                f"Tokenizer.train: vocab_size={vocab_size} leaves {n_ordinary} ordinary tokens; "
                f"it must be at least 256 + {len(SPECIAL_TOKENS)} special tokens = {256 + len(SPECIAL_TOKENS)}"
            )
        return cls.from_ranks(train_bpe(text, n_ordinary, pattern, progress=progress), pattern=pattern)

    @classmethod
    def gpt2(cls, folder: str | os.PathLike | None = None) -> Tokenizer:
        """GPT-2's BPE (50,257 tokens: 50,256 ordinary ones and `<|endoftext|>`, the EOS) plus `<|pad|>`,
        `<|user|>`, `<|assistant|>` after it.

        folder=None: tiktoken's "gpt2" encoding (downloaded once by tiktoken, then cached). A folder: built offline
        from the `vocab.json` of a Hugging Face GPT-2 folder (appendix C). For GPT-2 the id of a token in vocab.json
        IS its BPE rank (the merges were numbered in the order they were learned, after the 256 single bytes), so
        the ranks are vocab.json read back into bytes; merges.txt is not needed. Special tokens of the course already
        in vocab.json (a model this course exported) keep their ids; the others follow the largest id."""
        if folder is not None:
            ranks, specials = _gpt2_vocab_ranks(Path(folder) / "vocab.json")
            next_id = max([*ranks.values(), *specials.values()]) + 1
            for tok in SPECIAL_TOKENS:
                if tok not in specials:
                    specials[tok], next_id = next_id, next_id + 1
            return cls.from_ranks(ranks, special_tokens=specials, pattern=GPT2_SPLIT_PATTERN, name="gpt2-llmfs")
        try:
            base = tiktoken.get_encoding("gpt2")
        except Exception as err:  # no network, no cache
            raise RuntimeError(
                "Tokenizer.gpt2(): tiktoken could not load its 'gpt2' encoding. tiktoken downloads the GPT-2 BPE "
                "files once and caches them in the folder named by the TIKTOKEN_CACHE_DIR environment variable "
                "(default: a 'data-gym-cache' folder in the system temp dir). Offline, run "
                "`TIKTOKEN_CACHE_DIR=/some/dir python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` on a "
                "machine with internet, copy /some/dir here and set TIKTOKEN_CACHE_DIR to it; or pass "
                "Tokenizer.gpt2(folder) a folder holding GPT-2's vocab.json (from "
                "https://huggingface.co/openai-community/gpt2). "
                f"(cause: {type(err).__name__}: {err})"
            ) from err
        specials = {EOS_TOKEN: base.eot_token}
        for i, tok in enumerate(SPECIAL_TOKENS[1:]):
            specials[tok] = base.n_vocab + i
        enc = tiktoken.Encoding(
            "gpt2-llmfs", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks, special_tokens=specials
        )
        return cls(enc, base._pat_str)

    # --- use
    def encode(self, text: str, allowed_special: str | Iterable[str] = frozenset()) -> list[int]:
        """Token ids of `text`. Special-token text raises ValueError unless listed in `allowed_special` (or "all")."""
        if allowed_special != "all":
            allowed_special = frozenset(allowed_special)
        return self.encoding.encode(text, allowed_special=allowed_special)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(int(token_id))

    @property
    def ranks(self) -> dict[bytes, int]:
        return self.encoding._mergeable_ranks

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.encoding._special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def eos_id(self) -> int:
        return self.encoding._special_tokens[EOS_TOKEN]

    @property
    def pad_id(self) -> int:
        return self.encoding._special_tokens[PAD_TOKEN]

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.encoding.name!r}, vocab_size={self.vocab_size})"

    # --- files
    def save(self, path: str | os.PathLike) -> Path:
        """Write `tokenizer.tiktoken` (the ranks, tiktoken's format) and `tokenizer.json` into folder `path`."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        lines = [f"{base64.b64encode(tb).decode('ascii')} {rank}"
                 for tb, rank in sorted(self.ranks.items(), key=lambda kv: kv[1])]
        meta = {"name": self.encoding.name, "pattern": self.pattern, "special_tokens": self.special_tokens}
        atomic_write_text(folder / self.FILE_RANKS, "\n".join(lines) + "\n")
        atomic_write_text(folder / self.FILE_META, json.dumps(meta, indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Read a folder written by `save`. Missing or malformed files raise an error naming the file and line."""
        folder = Path(path)
        ranks_file, meta_file = folder / cls.FILE_RANKS, folder / cls.FILE_META
        for f in (ranks_file, meta_file):
            if not f.is_file():
                raise FileNotFoundError(f"Tokenizer.load: {f} does not exist "
                                        "(expected a folder written by Tokenizer.save)")
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
            pattern, specials, name = meta["pattern"], meta["special_tokens"], meta["name"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"Tokenizer.load: {meta_file} is not a valid tokenizer description ({err})") from err
        ranks: dict[bytes, int] = {}
        for lineno, line in enumerate(ranks_file.read_text(encoding="ascii").splitlines(), start=1):
            if not line:
                continue
            try:
                b64, rank = line.split()
                ranks[base64.b64decode(b64, validate=True)] = int(rank)
            except ValueError as err:
                raise ValueError(f"Tokenizer.load: {ranks_file}, line {lineno}: expected '<base64> <rank>', "
                                 f"got {line!r}") from err
        return cls.from_ranks(ranks, special_tokens=specials, pattern=pattern, name=name)



# ----------------------------------------------------------------------------- GPT-2's vocab.json (appendix C)


def _gpt2_byte_to_char() -> dict[int, str]:
    """GPT-2's table byte -> printable character (`bytes_to_unicode` in OpenAI's encoder.py).

    vocab.json and merges.txt spell every token's bytes as a string, one character per byte, chosen to be printable:
    the 188 bytes that print as themselves ("!" to "~", "¡" to "¬", "®" to "ÿ") keep their character, and the 68
    others (control bytes, the space, ...) get chr(256), chr(257), ... in byte order. So a space is "Ġ" (chr(288)),
    a newline "Ċ", and " the" is spelled "Ġthe"."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def _gpt2_vocab_ranks(path: Path) -> tuple[dict[bytes, int], dict[str, int]]:
    """vocab.json {spelled token: id} -> (ranks {token bytes: id}, the course's special tokens found in it)."""
    if not path.is_file():
        raise FileNotFoundError(f"Tokenizer.gpt2: {path} does not exist (expected GPT-2's vocab.json, from "
                                "https://huggingface.co/openai-community/gpt2/resolve/main/vocab.json)")
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"Tokenizer.gpt2: {path} is not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError(f"Tokenizer.gpt2: {path} is not a vocabulary: expected one JSON object {{token: id}}")
    specials = {tok: vocab.pop(tok) for tok in SPECIAL_TOKENS if tok in vocab}
    char_to_byte = {c: b for b, c in _gpt2_byte_to_char().items()}
    ranks: dict[bytes, int] = {}
    for spelled, i in vocab.items():
        bad = [c for c in spelled if c not in char_to_byte]
        if bad:
            raise ValueError(f"Tokenizer.gpt2: {path}: token {spelled!r} (id {i}) has {bad[0]!r}, which is not a "
                             "character of GPT-2's byte alphabet (bytes_to_unicode)")
        token = bytes(char_to_byte[c] for c in spelled)
        if token in ranks:
            raise ValueError(f"Tokenizer.gpt2: {path}: ids {ranks[token]} and {i} spell the same bytes {token!r}")
        ranks[token] = i
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"Tokenizer.gpt2: {path} lacks {len(missing)} of the 256 single bytes (first: byte "
                         f"{missing[0]}, spelled {_gpt2_byte_to_char()[missing[0]]!r}): some text could not be encoded")
    ids = [*ranks.values(), *specials.values()]
    if len(set(ids)) != len(ids):
        raise ValueError(f"Tokenizer.gpt2: {path} gives one id to two tokens")
    return ranks, specials


# ----------------------------------------------------------------------------- the chat template and padding


def chat_prompt(prompt: str) -> str:
    """The text the model sees before it answers."""
    return f"{USER_TOKEN}{prompt}{ASSISTANT_TOKEN}"


def encode_chat(tok: Tokenizer, prompt: str, response: str | None = None) -> tuple[list[int], int]:
    """Token ids of the templated example, and how many of them are prompt. Without a response: the prompt only.

    The special tokens are placed by id; the prompt and response texts are encoded as ordinary text, so a
    user who types "<|assistant|>" gets a clear error instead of forging a turn of the conversation."""
    special = tok.special_tokens
    prompt_ids = [special[USER_TOKEN]] + tok.encode(prompt) + [special[ASSISTANT_TOKEN]]
    if response is None:
        return prompt_ids, len(prompt_ids)
    return prompt_ids + tok.encode(response) + [tok.eos_id], len(prompt_ids)


def pad_right(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-id rows -> ids (N, T) padded on the right, attention mask (N, T), and the index of each row's last
    real token (N,)."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask, mask.sum(dim=1) - 1
