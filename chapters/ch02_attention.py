"""Chapter 2: attention, from one dot product to multi-head causal self-attention.

A demo, read top to bottom: one query worked through by hand (dot products, the causal mask, the softmax), why
scores are divided by sqrt(d), multi-head attention assembled from single heads, the explicit implementation beside
PyTorch's fused scaled_dot_product_attention (plain, with a padding mask, and through a whole GPT), a future token
that never changes an earlier output, the KV cache giving the same outputs, and attention heatmaps of a tiny-world
sentence (an untrained layer, and a hand-built head that looks back at the previous occurrence of the same token).
It prints what it measures; tests/test_attention.py checks each of these properties.

    python chapters/ch02_attention.py              # the real run (seconds on 2 CPU cores)
    python chapters/ch02_attention.py --quick      # a smoke run (also: LLMFS_QUICK=1)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib.pyplot as plt  # noqa: E402
import regex  # noqa: E402
import torch  # noqa: E402

import cli  # noqa: E402  chapters/cli.py: one-line errors at the terminal
from llm_from_scratch.attention import CausalSelfAttention, KVCache, causal_mask, explicit_attention  # noqa: E402
from llm_from_scratch.checkpoint import append_metrics, atomic_write_text
from llm_from_scratch.course import quick_mode, runs_root, shown, start_run, write_summary  # noqa: E402
from llm_from_scratch.device import DEVICE_CHOICES, pick_device, seed_everything  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig  # noqa: E402
from llm_from_scratch.plots import save  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402

SENTENCE = "Mia found a red kite. The kite was red. Mia was happy."
FALLBACK_SPLIT = regex.compile(r" ?\p{L}+|[^\s\p{L}]")  # words (with their leading space) and punctuation


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="output folder (default: runs/attention)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (default 0)")
    ap.add_argument("--device", default="auto",
                    help=f"one of {', '.join(DEVICE_CHOICES)} (default auto: the best available)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: shorter sequences, written under runs/quick/ (also LLMFS_QUICK=1)")
    ap.add_argument("--quiet", action="store_true", help="only the key numbers (no per-token tables)")
    cli.add_fast_arg(ap)
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    return args


# ----------------------------------------------------------------------------- 1. one query, by hand


def worked_example() -> dict:
    """One query against four keys, with numbers small enough to check on paper.

    Head size d = 4, so scores are q . k / sqrt(4) = q . k / 2. The query (token 2) has a 2 in its first
    coordinate, so its score against key j is just key j's first coordinate: 0, ln 3, ln 4 and 5.
    Token 3 comes after token 2, so the causal mask hides it; exp of the visible scores is 1, 3, 4,
    and the weights are 1/8, 3/8, 4/8.
    """
    q = [2.0, 0.0, 0.0, 0.0]
    keys = [[0.0, 1.0, 0.0, 0.0], [math.log(3), 0.0, 1.0, 0.0], [math.log(4), 0.0, 0.0, 1.0], [5.0, 0.0, 0.0, 0.0]]
    values = [[8.0, 0.0], [0.0, 8.0], [4.0, 4.0], [100.0, 100.0]]
    query_pos, d = 2, len(q)

    # scores: one scalar dot product per key, scaled by 1/sqrt(d)
    scores = [sum(qi * ki for qi, ki in zip(q, k)) / math.sqrt(d) for k in keys]
    # the causal mask: a key after the query gets -inf, so exp(-inf) = 0 removes it from the softmax
    masked = [s if j <= query_pos else float("-inf") for j, s in enumerate(scores)]
    exps = [math.exp(s) for s in masked]
    weights = [e / sum(exps) for e in exps]
    output = [sum(w * v[c] for w, v in zip(weights, values)) for c in range(len(values[0]))]
    # the same scores without the mask: the future token would take most of the attention
    unmasked_exps = [math.exp(s) for s in scores]
    leak = unmasked_exps[-1] / sum(unmasked_exps)

    # the library's explicit_attention on the same numbers: (B, H, T, D) = (1, 1, 1, 4) for one query
    lib_out, lib_w = explicit_attention(
        torch.tensor(q).view(1, 1, 1, d), torch.tensor(keys).view(1, 1, 4, d), torch.tensor(values).view(1, 1, 4, 2),
        mask=torch.tensor([j <= query_pos for j in range(4)]).view(1, 1, 1, 4),
    )
    return {"scores": scores, "exps": exps, "weights": weights, "output": output, "future_weight_without_mask": leak,
            "library_weights": lib_w.flatten().tolist(), "library_output": lib_out.flatten().tolist()}


def sqrt_d_demo(d: int = 64, n_keys: int = 16, trials: int = 2000) -> dict:
    """Why divide by sqrt(d): with unit-variance q and k, q . k is a sum of d products, so its standard
    deviation is sqrt(d). Unscaled scores of size ~8 (d = 64) make the softmax nearly one-hot."""
    q = torch.randn(trials, 1, d)
    k = torch.randn(trials, n_keys, d)
    raw = (q @ k.transpose(-2, -1)).squeeze(1)  # (trials, n_keys)
    scaled = raw / math.sqrt(d)
    return {"d": d, "n_keys": n_keys, "std_raw": raw.std().item(), "std_scaled": scaled.std().item(),
            "max_weight_raw": raw.softmax(-1).max(-1).values.mean().item(),
            "max_weight_scaled": scaled.softmax(-1).max(-1).values.mean().item()}


# ----------------------------------------------------------------------------- 2. heads, and the fused kernel


def attention_weights(attn: CausalSelfAttention, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The (B, H, T, T) attention weights of `attn` on x: its own projections, then explicit_attention."""
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, attn.n_head, attn.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    return explicit_attention(q, k, v, mask)[1]


def multihead_by_hand(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Multi-head attention as H separate single-head attentions on slices of q, k, v, concatenated and projected."""
    C, D = attn.n_embd, attn.head_dim
    q, k, v = attn.c_attn(x).split(C, dim=2)  # each (B, T, C): all heads side by side
    outputs = []
    for h in range(attn.n_head):
        cols = slice(h * D, (h + 1) * D)  # head h owns D of the C columns
        y_h, _ = explicit_attention(q[:, None, :, cols], k[:, None, :, cols], v[:, None, :, cols], mask=None)
        outputs.append(y_h[:, 0])  # y_h: (B, 1, T, D)
    return attn.c_proj(torch.cat(outputs, dim=-1))  # (B, T, C)


def padding_mask(lengths: list[int], T: int, device) -> torch.Tensor:
    """(B, 1, T, T) booleans for a left-padded batch: causal, never a pad key, and every query sees itself
    (so a padding query's softmax stays finite; its output is never used)."""
    keep = torch.stack([torch.arange(T, device=device) >= T - m for m in lengths])  # (B, T): True = real token
    mask = causal_mask(T, T, device) & keep[:, None, :]  # (B, T, T)
    mask = mask | torch.eye(T, dtype=torch.bool, device=device)
    return mask[:, None]  # broadcast over heads


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def explicit_vs_fused(explicit: CausalSelfAttention, fused: CausalSelfAttention, x: torch.Tensor) -> dict:
    """Max |explicit - sdpa| of two layers with the same weights on x (B = 4 rows): causal, and with the mask of a
    left-padded batch; then the same on the logits of two tiny GPTs with the same weights, fed a left-padded batch."""
    T, device = x.size(1), x.device
    lengths = [T, T - 5, T // 2, 3]  # real tokens per row; the rest is left padding
    mask = padding_mask(lengths, T, device)
    gpt_explicit = GPT(GPTConfig.preset("tiny", vocab_size=768, attn_impl="explicit")).to(device).eval()
    gpt_fused = GPT(GPTConfig.preset("tiny", vocab_size=768, attn_impl="sdpa")).to(device).eval()
    gpt_fused.load_state_dict(gpt_explicit.state_dict())
    with torch.no_grad():
        plain = max_diff(explicit(x), fused(x))
        padded = max_diff(explicit(x, mask), fused(x, mask))
        idx = torch.randint(0, 768, (len(lengths), T), device=device)
        attention_mask = torch.stack([torch.arange(T, device=device) >= T - m for m in lengths]).long()
        gpt = max_diff(gpt_explicit(idx, attention_mask), gpt_fused(idx, attention_mask))
    return {"plain": plain, "padded": padded, "gpt": gpt, "lengths": lengths, "n_layer": gpt_explicit.config.n_layer}


def future_and_cache(explicit: CausalSelfAttention, fused: CausalSelfAttention, x: torch.Tensor) -> dict:
    """What generation (chapter 3) relies on. past / last: how much a different last token changes the earlier outputs
    and the last one; cache: max |diff| between the fused layer fed one token at a time through a KV cache and the
    whole sequence at once."""
    B, T, C = x.shape
    with torch.no_grad():
        y = explicit(x)
        x_changed = x.clone()
        x_changed[:, -1] = torch.randn(B, C, device=x.device)  # a different last token
        y_changed = explicit(x_changed)
        cache = KVCache(n_layer=1, batch_size=B, n_head=fused.n_head, max_len=T, head_dim=fused.head_dim,
                        device=x.device)
        steps = []
        for t in range(T):  # one token at a time, as in generation
            steps.append(fused(x[:, t:t + 1], kv_cache=cache))
            cache.advance(1)  # GPT.forward does this after its last layer
    return {"past": max_diff(y_changed[:, :-1], y[:, :-1]), "last": max_diff(y_changed[:, -1], y[:, -1]),
            "cache": max_diff(torch.cat(steps, dim=1), y)}


# ----------------------------------------------------------------------------- 3. pictures


def sentence_tokens(quick: bool) -> tuple[list[int], list[str], str | None]:
    """Token ids and axis labels of SENTENCE, and where the tokenizer came from.

    With chapter 1's tokenizer (runs/tokenizer): its tokens, labelled by their text (a space shown as '·').
    Without it: a plain split into words and punctuation, labelled by position, and None for the tokenizer.
    """
    folder = runs_root(quick) / "tokenizer"
    try:
        tok = Tokenizer.load(folder)
    except FileNotFoundError:
        words = FALLBACK_SPLIT.findall(SENTENCE)
        distinct = {w: i for i, w in enumerate(dict.fromkeys(words))}
        return [distinct[w] for w in words], [str(i) for i in range(len(words))], None
    ids = tok.encode(SENTENCE)
    labels = [tok.decode([i]).replace(" ", "·") for i in ids]
    return ids, labels, f"chapter 1's, {tok.vocab_size} tokens, from {shown(folder)}"


def duplicate_token_head(ids: list[int], recency: float = 3.0) -> tuple[CausalSelfAttention, torch.Tensor]:
    """A one-head CausalSelfAttention whose weights are set by hand, and its input, for the token sequence `ids`.

    The input of position i is [one-hot of its token | one-hot of its position], so C = (distinct tokens) + T.
    W_q, W_k and the query bias are chosen so that (after the 1/sqrt(d) scaling, which they undo)

        score(i, j) = match * [token j == token i]  -  self_penalty * [j == i]  +  recency * j

    * a key holding the same token scores `match` (large);
    * the query's own key loses `self_penalty` (smaller than `match`), so an EARLIER copy beats it, but it
      still beats every other token when there is no earlier copy;
    * `recency * j` breaks ties between several earlier copies in favour of the latest one.
    With self_penalty = recency * T no gap between copies can outweigh the penalty, and match = 2 * self_penalty.
    Values and the output projection are the identity, so each output copies the input it attends to:
    its position part says where the same token appeared last.
    """
    T = len(ids)
    vocab = {t: i for i, t in enumerate(dict.fromkeys(ids))}  # distinct tokens -> 0..V-1
    V = len(vocab)
    C = V + T
    self_penalty = recency * T
    match = 2 * self_penalty
    x = torch.zeros(1, T, C)
    for pos, t in enumerate(ids):
        x[0, pos, vocab[t]] = 1.0  # which token
        x[0, pos, V + pos] = 1.0  # where it is

    attn = CausalSelfAttention(C, n_head=1, bias=True, attn_impl="explicit").eval()
    scale = math.sqrt(C)  # head size C: explicit_attention divides by sqrt(C), we multiply it back
    eye = torch.eye(C)
    w_q, w_k, w_v, b_q = torch.zeros(C, C), eye.clone(), eye.clone(), torch.zeros(C)
    w_q[:V, :V] = match * scale * torch.eye(V)  # q . k gets `match` when the token parts are the same one-hot
    w_q[V:, V:] = -self_penalty * scale * torch.eye(T)  # ... and -self_penalty when the position parts are
    b_q[V:] = recency * scale * torch.arange(T, dtype=torch.float32)  # ... and recency * j via key j's position
    with torch.no_grad():
        attn.c_attn.weight.copy_(torch.cat([w_q, w_k, w_v]))  # nn.Linear computes x W^T + b, so rows are outputs
        attn.c_attn.bias.copy_(torch.cat([b_q, torch.zeros(2 * C)]))
        attn.c_proj.weight.copy_(eye)
        attn.c_proj.bias.zero_()
    return attn, x


def heatmap(ax, weights: torch.Tensor, labels: list[str], title: str, axis_titles: bool = True):
    """One (T, T) attention matrix: row = query (the token that looks), column = key (the token looked at)."""
    im = ax.imshow(weights.detach().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
    T = len(labels)
    ax.set_xticks(range(T), labels, rotation=90, fontsize=7, fontfamily="monospace")
    ax.set_yticks(range(T), labels, fontsize=7, fontfamily="monospace")
    ax.set_title(title)
    if axis_titles:
        ax.set(xlabel="key (looked at)", ylabel="query (looking)")
    return im


def draw_untrained(ids: list[int], labels: list[str], path: Path, dim: int = 64, heads: int = 4) -> dict:
    """Heatmaps of an untrained layer (PyTorch's default random init) on random token and position embeddings; the
    largest weight above the diagonal, how far the rows' sums are from 1, and the last token's largest weight."""
    n = len(ids)
    untrained = CausalSelfAttention(dim, heads, attn_impl="explicit").eval()
    tok_emb = torch.randn(max(ids) + 1, dim)  # random token embeddings
    pos_emb = torch.randn(n, dim)  # random position embeddings
    with torch.no_grad():
        w = attention_weights(untrained, (tok_emb[ids] + pos_emb)[None])[0]  # (H, T, T)
    fig, axes = plt.subplots(2, 2, figsize=(9, 9), layout="constrained")
    for h, ax in enumerate(axes.flat):
        im = heatmap(ax, w[h], labels, f"untrained head {h}", axis_titles=False)
    fig.supxlabel("key (looked at)")
    fig.supylabel("query (looking)")
    fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle("An untrained attention layer: random, but causal (nothing above the diagonal)")
    save(fig, path)
    row_sums = w.sum(-1)
    return {"heads": heads, "above": w.triu(diagonal=1).abs().max().item(),  # weight on future keys: exactly 0
            "row_sum_error": max_diff(row_sums, torch.ones_like(row_sums)),
            "last_row_max": w[:, -1].max().item()}  # the last query sees all n keys; uniform would be 1/n each


def draw_hand_built(ids: list[int], labels: list[str], path: Path) -> tuple[int, list[str]]:
    """The heatmap of duplicate_token_head on `ids`; how many tokens attend to (and copy the position of) the previous
    occurrence of their token, or themselves when there is none; and each repeated token as 'token@i -> token@j (w)'."""
    head, x_onehot = duplicate_token_head(ids)
    with torch.no_grad():
        w = attention_weights(head, x_onehot)[0, 0]  # (T, T)
        y = head(x_onehot)[0]  # (T, C): each output copies the one-hot input it attends to
    fig, ax = plt.subplots(figsize=(6.5, 6.5), layout="constrained")
    title = "A hand-built head: look back at the previous\noccurrence of the same token (else at yourself)"
    im = heatmap(ax, w, labels, title)
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    save(fig, path)
    n_distinct, repeats, correct = len(set(ids)), [], 0
    for i in range(len(ids)):
        earlier = [j for j in range(i) if ids[j] == ids[i]]
        expected = earlier[-1] if earlier else i
        looked = int(w[i].argmax())
        found = int(y[i, n_distinct:].argmax())  # the position part of the output
        correct += looked == expected == found
        if earlier:
            repeats.append(f"{labels[i]}@{i} -> {labels[looked]}@{looked} ({w[i, looked]:.2f})")
    return correct, repeats


# ----------------------------------------------------------------------------- the chapter


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = args.out or runs_root(args.quick) / "attention"
    start_run(out, fresh=("metrics.jsonl",))  # this run's metrics only; no summary until it finishes
    device = pick_device(args.device)
    seed_everything(args.seed)
    say = print
    detail = (lambda *a, **k: None) if args.quiet else print
    say(f"device: {device}, torch {torch.__version__}, output: {out}")

    # 1. one query by hand, then the library on the same numbers; why sqrt(d) ------------------
    ex = worked_example()
    say("1. one query against four keys, by hand (head size d = 4; the query is token 2, token 3 is its future)")
    say("   scores q.k/sqrt(d):   " + "  ".join(f"{s:.4f}" for s in ex["scores"]) + "   (0, ln 3, ln 4, 5)")
    say("   causal mask:          token 3 comes later -> score -inf -> exp(-inf) = 0")
    say("   exp(masked scores):   " + "  ".join(f"{e:.4f}" for e in ex["exps"]))
    say("   softmax weights:      " + "  ".join(f"{w:.4f}" for w in ex["weights"]) + "   (1/8, 3/8, 4/8, 0)")
    say(f"   output = sum_j w_j v_j = 1/8 (8,0) + 3/8 (0,8) + 1/2 (4,4) = "
        f"({ex['output'][0]:.4f}, {ex['output'][1]:.4f})")
    say("   explicit_attention:   weights " + "  ".join(f"{w:.4f}" for w in ex["library_weights"])
        + f", output ({ex['library_output'][0]:.4f}, {ex['library_output'][1]:.4f})")
    say(f"   without the mask token 3 would take {ex['future_weight_without_mask']:.1%} of the attention: "
        "the future would leak in")

    sd = sqrt_d_demo()
    say(f"   why sqrt(d): random unit-variance q, k with d = {sd['d']}: q.k has std {sd['std_raw']:.2f} "
        f"(about sqrt(d) = {math.sqrt(sd['d']):.0f}), q.k/sqrt(d) has std {sd['std_scaled']:.2f}")
    say(f"   over {sd['n_keys']} keys the largest softmax weight averages {sd['max_weight_raw']:.2f} unscaled (nearly "
        f"one-hot, tiny gradients) and {sd['max_weight_scaled']:.2f} scaled")

    # 2. multi-head = single heads side by side, concatenated and projected -----------------------
    B, T, C, H = 4, (32 if args.quick else 64), 128, 4
    explicit = CausalSelfAttention(C, H, attn_impl="explicit").to(device).eval()
    fused = CausalSelfAttention(C, H, attn_impl="sdpa").to(device).eval()
    fused.load_state_dict(explicit.state_dict())  # the same weights in both
    x = torch.randn(B, T, C, device=device)
    with torch.no_grad():
        y_explicit = explicit(x)
        diff_heads = max_diff(multihead_by_hand(explicit, x), y_explicit)
    say(f"2. multi-head, C = {C}, {H} heads of size {C // H}: x {tuple(x.shape)} -> q, k, v {(B, H, T, C // H)} each "
        f"-> y {tuple(y_explicit.shape)}; parameters {sum(p.numel() for p in explicit.parameters()):,} "
        f"(c_attn 3C^2 + 3C, c_proj C^2 + C)")
    say(f"   {H} single-head attentions, concatenated, then c_proj == CausalSelfAttention: "
        f"max |diff| = {diff_heads:.2e}")

    # 3. the explicit layer and the fused kernel compute the same function; the future never reaches the past ----
    same = explicit_vs_fused(explicit, fused, x)
    say(f"3. explicit vs sdpa (same weights, B={B}, T={T}): max |diff| = {same['plain']:.2e} causal, "
        f"{same['padded']:.2e} with a left-padding mask (rows of {same['lengths']} real tokens), "
        f"{same['gpt']:.2e} on the logits of a {same['n_layer']}-layer GPT")
    gen = future_and_cache(explicit, fused, x)
    say(f"   causality: changing the last token changes earlier outputs by {gen['past']:.2e} (the last one by "
        f"{gen['last']:.2f}); KV cache, one token at a time vs all at once: max |diff| = {gen['cache']:.2e}")
    say("   how much faster the fused kernel is, as T grows: python benchmarks/bench_attention.py")

    # 4. heatmaps ----------------------------------------------------------------------------------
    ids, labels, tok_note = sentence_tokens(args.quick)
    say(f"4. heatmaps of {SENTENCE!r}: {len(ids)} tokens ({tok_note or 'split into words'})")
    if tok_note is None:
        say(f"   note: no chapter-1 tokenizer in {runs_root(args.quick) / 'tokenizer'} (run chapters/ch01_tokenizer.py "
            "first); the sentence is split into words and the axes are labelled by position:")
        say("   " + " ".join(f"{i}={w.strip()}" for i, w in enumerate(FALLBACK_SPLIT.findall(SENTENCE))))
    n = len(ids)
    un = draw_untrained(ids, labels, out / "heatmap_untrained.png")
    say(f"   untrained layer ({un['heads']} heads): largest weight above the diagonal {un['above']:.1e}, rows sum to 1 "
        f"within {un['row_sum_error']:.1e}; the last token's largest weight is {un['last_row_max']:.2f} "
        f"(uniform: 1/{n} = {1 / n:.2f}): random scores of modest size give a spread-out softmax")
    correct, repeats = draw_hand_built(ids, labels, out / "heatmap_hand_built.png")
    say(f"   hand-built head: {correct}/{n} tokens attend to (and copy the position of) the previous occurrence of "
        f"their token, or themselves when there is none")
    detail("   repeated tokens: " + ", ".join(repeats))

    # 5. save --------------------------------------------------------------------------------------
    summary = {
        "device": str(device), "torch": torch.__version__, "seed": args.seed, "quick": args.quick,
        "worked_example_weights": ex["weights"], "worked_example_output": ex["output"],
        "future_weight_without_mask": ex["future_weight_without_mask"],
        "sqrt_d": sd, "multihead_by_hand_max_abs_diff": diff_heads,
        "explicit_vs_sdpa_max_abs_diff": same["plain"], "explicit_vs_sdpa_padded_max_abs_diff": same["padded"],
        "explicit_vs_sdpa_gpt_logits_max_abs_diff": same["gpt"],
        "causality_past_max_abs_change": gen["past"], "kv_cache_max_abs_diff": gen["cache"],
        "untrained_weight_above_diagonal": un["above"], "hand_built_head_correct": correct, "sentence_tokens": n,
        "tokenizer": tok_note or "none (words)",
    }
    append_metrics(out / "metrics.jsonl", summary)
    try:
        rel = out.resolve().relative_to(runs_root(args.quick).resolve()).as_posix()
    except ValueError:  # --out outside the runs folder: links relative to its parent
        rel = out.name
    atomic_write_text(out / "report.md", report(summary, rel))
    write_summary(out, summary, args.quick)  # last: marks the run finished
    say(f"max |explicit - sdpa| = {max(same['plain'], same['padded'], same['gpt']):.2e}; "
        f"hand-built head {correct}/{n}; saved to {shown(out)}")
    return summary


def report(s: dict, rel: str) -> str:
    sd = s["sqrt_d"]
    lines = [
        "## Chapter 2: attention", "",
        "- by hand: scores 0, ln 3, ln 4 (a future key masked) -> weights "
        + ", ".join(f"{w:.3f}" for w in s["worked_example_weights"]) + "; without the mask the future key takes "
        f"{s['future_weight_without_mask']:.1%}",
        f"- why sqrt(d): with d = {sd['d']}, unscaled scores have std {sd['std_raw']:.2f} and the largest "
        f"softmax weight averages {sd['max_weight_raw']:.2f}; scaled: std {sd['std_scaled']:.2f}, "
        f"{sd['max_weight_scaled']:.2f}",
        f"- multi-head = single heads concatenated and projected: max |diff| {s['multihead_by_hand_max_abs_diff']:.1e}",
        f"- explicit vs sdpa, max |diff|: {s['explicit_vs_sdpa_max_abs_diff']:.1e} (causal), "
        f"{s['explicit_vs_sdpa_padded_max_abs_diff']:.1e} (left padding), "
        f"{s['explicit_vs_sdpa_gpt_logits_max_abs_diff']:.1e} (GPT logits)",
        f"- causality: a new last token changes earlier outputs by {s['causality_past_max_abs_change']:.1e}; "
        f"KV cache vs full attention: {s['kv_cache_max_abs_diff']:.1e}",
        f"- hand-built previous-occurrence head: {s['hand_built_head_correct']}/{s['sentence_tokens']} tokens attend "
        "where designed",
        "", f"![untrained attention]({rel}/heatmap_untrained.png)", f"![hand-built head]({rel}/heatmap_hand_built.png)",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run(main)
