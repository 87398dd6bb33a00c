"""The language-model training loop (pretraining here; supervised fine-tuning reuses it).

Objective: the mean next-token cross-entropy over the target positions that are not masked out
(label -100),  L = -1/N Σ_t log p(y_t | x_≤t).  exp(L) is the perplexity.

One step, with gradient accumulation over `grad_accum` micro-batches:
    lr_s  = peak · s / warmup                                  linear warmup
          = min + (peak - min) · ½ (1 + cos(π · progress))     then cosine decay to min
    g     = ∇ (1/grad_accum) Σ_micro L_micro
    g     = g · min(1, clip / ‖g‖)                             global-norm gradient clipping
    AdamW(lr_s): weight decay only on matrices (embeddings and linear weights), never on biases or
    LayerNorm gains: decaying a gain or a bias towards 0 has no regularising meaning.

Everything a run writes lands in `out_dir`: `metrics.jsonl` (one JSON line per log/eval), the best
model by validation loss (`model.safetensors` + `config.json` of kind "gpt", see checkpoint.py) and, in
`last/`, the latest weights plus `train_state.pt` (optimizer, step, RNG state) to resume from. A
resumed run continues bit-for-bit: batches are a function of the step number (data.WindowSampler),
and the RNG state saved is the one at the start of the next step. Ctrl-C saves before exiting; a
non-finite loss stops the run and keeps the last good checkpoint (`require_finite`).

Every step is recorded once in `metrics.jsonl`, whenever the run was killed: a run that starts over deletes the
file, and a run that resumes from its checkpoint of step s first cuts it back to steps ≤ s (the records a killed run
wrote past its checkpoint are written again). Within a step the records are appended before the checkpoint is saved:
a kill between the two leaves records past the checkpoint, which the cut removes, never a checkpoint past a record.

Several processes (torchrun, see distributed.py): every rank builds the same global micro-batch and computes its own
rows; DDP averages the gradients. Rank r backpropagates (W/N) Σ_{t∈r} ℓ_t, its share of the global mean (N targets in
the micro-batch, W ranks), so the update is the one-process update on the same global batch, whichever rank holds
which targets. The validation batches are shared out between the ranks and their sums added up; only rank 0 writes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from llm_from_scratch import distributed
from llm_from_scratch.checkpoint import (
    append_metrics,
    load_model,
    load_state,
    load_train_state,
    save_model,
    save_train_state,
    truncate_metrics,
)
from llm_from_scratch.device import DTYPES, autocast, dtype_of, keep_freed_memory
from llm_from_scratch.model import GPT, GPTConfig, eval_mode

Batch = tuple[torch.Tensor, torch.Tensor]  # x (B, T) token ids, y (B, T) targets (-100 = no loss)


@dataclass
class TrainConfig:
    max_steps: int = 2000
    batch_size: int = 32  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # the cosine decays to this
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    eval_interval: int = 200
    eval_batches: int = 20
    log_interval: int = 10
    checkpoint_interval: int = 500
    dtype: str = "float32"  # autocast dtype: "float32" (off) or "bfloat16" (device.choose_dtype picks one)
    compile: bool = False  # torch.compile the model
    seed: int = 0


def require_finite(value: float, what: str, step: int, checkpoint: Path | None,
                   hint: str = "lower --lr, or check the data") -> float:
    """`value` (a loss, a gradient norm) if it is finite; else stop the run with a one-line FloatingPointError that
    names `what` was not finite, at which step, and the last good checkpoint (None: "no checkpoint yet")."""
    value = float(value)
    if math.isfinite(value):
        return value
    kept = f"the last good checkpoint is {checkpoint}" if checkpoint is not None else "no checkpoint yet"
    raise FloatingPointError(f"{what} is {value} at step {step}: stopping; {kept} ({hint})")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to cfg.min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the ≥2-D parameters (matrices, embeddings) only. cfg: a TrainConfig, or any
    config with its lr, betas and weight_decay fields (the reward model's RewardConfig)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **fused_if_cuda(params))


def fused_if_cuda(params: Iterable[torch.Tensor]) -> dict:
    """AdamW's keyword arguments for these parameters: {"fused": True} when every one is on a CUDA GPU (one kernel
    updates them all, instead of a few per parameter tensor), else {} (the default implementation, unchanged on a
    CPU or MPS). Fused AdamW refuses a mix of devices, so one parameter elsewhere is enough for {}.
    Use: torch.optim.AdamW(params, lr=..., **fused_if_cuda(params)), with params a list (it is read here)."""
    devices = {p.device.type for p in params}
    return {"fused": True} if devices == {"cuda"} else {}


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A batch tensor on `device`. CUDA: through pinned (page-locked) host memory with non_blocking=True, so the copy
    runs asynchronously while the CPU goes on queueing kernels. Elsewhere a plain copy: on a CPU `.to` returns the
    tensor itself, and a non_blocking copy from pageable memory to MPS can read the source after it was freed
    (pytorch/pytorch#139550, #189690: silently wrong tokens)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean cross-entropy of the targets y (B, T) under model(x); positions with y = -100 are skipped.
    reduction="sum": their sum instead."""
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction=reduction)


def fastest_dtype(model: torch.nn.Module, batches: list[Batch], repeats: int = 2,
                  margin: float = 1.2) -> tuple[str, dict[str, float]]:
    """Time the model's own training step (forward + backward over these batches) in float32 and under bfloat16
    autocast; "bfloat16" only if it is at least `margin` times faster. Returns the choice and the seconds per
    batch of each. The model's weights and the random state are left as they were; its gradients are cleared."""
    device = next(model.parameters()).device
    rng = torch.get_rng_state()
    seconds = {}
    for name in DTYPES:
        times = []
        for _ in range(repeats + 1):  # the first pass is a warm-up
            t0 = time.perf_counter()
            for x, y in batches:
                with autocast(device, dtype_of(name)):
                    loss = lm_loss(model, x.to(device), y.to(device))
                loss.backward()
            times.append((time.perf_counter() - t0) / len(batches))
        seconds[name] = min(times[1:])
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    return ("bfloat16" if seconds["bfloat16"] * margin < seconds["float32"] else "float32"), seconds


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float = 1.0) -> float:
    """Clip the gradients' global norm to grad_clip (0 = no clipping), step, zero the gradients.
    Returns the norm before clipping (a spike there is the first sign of a learning rate too high)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf")).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def accumulate_gradients(model: torch.nn.Module, micro_batches: list[Batch],
                         amp: torch.dtype | None = None) -> tuple[float, int]:
    """Gradient accumulation: the gradient of one large batch, built from K micro-batches that fit in memory.

    With L_k the mean token loss of micro-batch k, backpropagate L_k / K for each k, so that the summed gradients
    are ∇ (1/K) Σ_k L_k, the gradient of the mean loss (equal to one big batch's when the micro-batches hold
    equally many targets). Adds to the parameters' .grad; the optimizer step comes after (optimizer_step).
    Returns the mean loss (1/K) Σ_k L_k and the number of targets seen (y ≠ -100). amp: the autocast dtype or None.

    Under torchrun (model wrapped by distributed.wrap) each rank computes its rows of every micro-batch, as the
    module docstring says; the K-1 first backward passes skip DDP's all-reduce. The loss and count returned are the
    global ones, the same on every rank."""
    device = next(model.parameters()).device
    K, W = len(micro_batches), distributed.world_size()
    if W > 1 and not distributed.is_wrapped(model):
        raise ValueError("accumulate_gradients under torchrun: pass the model wrapped by distributed.wrap, or the "
                         "ranks' gradients are never averaged and their copies drift apart")
    loss_sum, tokens = 0.0, 0
    for k, (x, y) in enumerate(micro_batches):  # x, y (B, T) each: the global micro-batch
        n = int((y != -100).sum())  # N, its targets
        if W > 1:
            rows = distributed.shard_rows(len(x))
            x, y = x[rows], y[rows]  # (B/W, T): this rank's share
        x, y = to_device(x, device), to_device(y, device)  # pinned and asynchronous on CUDA only
        with distributed.sync_gradients(model, sync=k == K - 1):  # DDP decides this in the forward pass
            with autocast(device, amp):
                if W == 1:
                    loss = lm_loss(model, x, y)  # L_k
                else:  # (W/N) Σ_{t∈r} ℓ_t: DDP's average over the ranks is then L_k
                    loss = lm_loss(model, x, y, reduction="sum") * (W / n if n else float("nan"))
            (loss / K).backward()
        loss_sum += loss.item()
        tokens += n
    if W > 1:
        loss_sum = distributed.all_reduce([loss_sum]).item() / W
    return loss_sum / K, tokens


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device, dtype: str = "float32",
             shared: bool = False) -> float:
    """Mean loss per target token over `batches` (dropout off during, training mode restored after).
    shared=True (every rank must call it then): under torchrun, rank r evaluates batches r, r+W, ... and the sums
    are added over the ranks."""
    W, r = (distributed.world_size(), distributed.rank()) if shared else (1, 0)
    total, count = 0.0, 0
    with eval_mode(model):
        for i, (x, y) in enumerate(batches):
            if i % W != r:
                continue
            x, y = to_device(x, device), to_device(y, device)
            with autocast(device, dtype_of(dtype)):
                n = int((y != -100).sum())
                total += lm_loss(model, x, y).item() * n
                count += n
    if W > 1:
        total, count = distributed.all_reduce([total, count]).tolist()
    return total / max(1, count)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_gpt(model: GPT, folder: str | Path) -> Path:
    """A GPT checkpoint (kind "gpt"): `model.safetensors` + `config.json`, written atomically."""
    return save_model(model, folder, "gpt", asdict(model.config))


def load_gpt(folder: str | Path, device: str | torch.device = "cpu", vocab_size: int | None = None, **overrides) -> GPT:
    """Rebuild a GPT from a checkpoint folder. `vocab_size`: the tokenizer's, checked against the checkpoint's (a
    mismatch means the wrong tokenizer). `overrides` change config fields (e.g. attn_impl, dropout)."""
    return load_model(folder, "gpt", lambda config: GPT(GPTConfig(**{**config, **overrides})), device, vocab_size)


def save_checkpoint(out_dir: Path, model: GPT, optimizer, step: int, rng: dict, extra: dict) -> None:
    """`last/`: weights + everything needed to continue at `step` (the next step to run). train_state.pt holds the
    weights too, and a resume reads them from there: two files cannot be replaced at once, and a kill between the
    two writes would otherwise pair this step's weights with the previous checkpoint's optimizer state."""
    save_gpt(model, out_dir / "last")
    save_train_state(out_dir / "last" / "train_state.pt", {"step": step, "model": model.state_dict(),
                                                           "optimizer": optimizer.state_dict(), "rng": rng, **extra})


def train(model: GPT, cfg: TrainConfig, get_batch: Callable[[int], Batch], val_batches: Callable[[], Iterable[Batch]],
          out_dir: str | Path, resume: bool = True, on_eval: Callable[[int, GPT], dict] | None = None,
          quiet: bool = False) -> dict:
    """Train `model` in place for cfg.max_steps optimizer steps; returns a summary dict.

    get_batch(i): the i-th micro-batch (a pure function of i, for exact resumption).
    val_batches(): a fresh iterable of validation batches.
    on_eval(step, model): called at every evaluation (on rank 0 only under torchrun); may return extra metrics.
    Under torchrun every rank calls train() alike; the model is wrapped in DDP here, and only rank 0 writes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    amp = dtype_of(cfg.dtype)
    main = distributed.is_main()
    if device.type == "cpu":  # the same numbers, no page faults per step, some memory kept (device.keep_freed_memory)
        keep_freed_memory()
    optimizer = configure_optimizer(model, cfg)
    start, tokens_seen, best_val, rng = 0, 0, float("inf"), None
    state_file, metrics = out_dir / "last" / "train_state.pt", out_dir / "metrics.jsonl"
    checkpoint = None  # the last good checkpoint, named when a loss goes non-finite
    if distributed.broadcast_object(resume and state_file.is_file()):  # rank 0 decides for all: one decision
        state = load_train_state(state_file)
        if "model" in state:
            model.load_state_dict(state["model"])
        else:  # a checkpoint from before train_state.pt held the weights
            load_state(model, out_dir / "last" / "model.safetensors")
        optimizer.load_state_dict(state["optimizer"])
        start, tokens_seen, best_val, rng = state["step"], state["tokens_seen"], state["best_val"], state["rng"]
        ranks = state.get("rng_ranks", [])  # every rank's state, when several ranks saved it
        _set_rng_state(ranks[distributed.rank()] if len(ranks) == distributed.world_size() else rng)
        if main:
            truncate_metrics(metrics, start)  # drop what a killed run recorded past its checkpoint: it is replayed
        checkpoint = out_dir / "last"
        if not quiet:
            print(f"resuming {out_dir} at step {start}")
    else:  # starting over: nothing of an earlier run in this folder is kept to be recorded twice or resumed from
        if main:
            metrics.unlink(missing_ok=True)
            state_file.unlink(missing_ok=True)
        torch.manual_seed(cfg.seed + distributed.rank())  # each rank its own dropout masks
    distributed.barrier()  # no rank starts before rank 0 has cleared the folder
    forward = distributed.wrap(model)  # DDP when under torchrun
    forward = torch.compile(forward) if cfg.compile else forward
    model.train()

    def extra():
        return {"tokens_seen": tokens_seen, "best_val": best_val, "config": asdict(cfg)}

    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", disable=quiet or not main,
               dynamic_ncols=True)
    t_last, tokens_last = time.perf_counter(), tokens_seen
    step, next_step, rng = start, start, _rng_state()  # next_step: the step a resumed run would run next
    try:
        for step in range(start, cfg.max_steps):
            rng = _rng_state()  # the state a resumed run must restore to replay this step exactly
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro_batches = [get_batch(step * cfg.grad_accum + micro) for micro in range(cfg.grad_accum)]
            train_loss, tokens = accumulate_gradients(forward, micro_batches, amp)
            tokens_seen += tokens
            require_finite(train_loss, "the training loss", step, checkpoint)
            grad_norm = optimizer_step(model, optimizer, cfg.grad_clip)
            done = next_step = step + 1

            if done % cfg.log_interval == 0 or done == cfg.max_steps:
                now = time.perf_counter()
                tps = (tokens_seen - tokens_last) / max(1e-9, now - t_last)
                t_last, tokens_last = now, tokens_seen
                if main:
                    append_metrics(metrics, {"step": done, "tokens": tokens_seen, "loss/train": train_loss,
                                             "train/lr": lr, "train/grad_norm": grad_norm, "train/tokens_per_s": tps})
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tps:,.0f}")
            if done % cfg.eval_interval == 0 or done == cfg.max_steps:
                val = evaluate(model, val_batches(), device, cfg.dtype, shared=True)  # the same on every rank
                record = {"step": done, "tokens": tokens_seen, "loss/val": val,
                          "val/perplexity": math.exp(min(val, 50))}
                if on_eval is not None and main:
                    record.update(on_eval(done, model) or {})
                if main:
                    append_metrics(metrics, record)
                if val < best_val:
                    best_val = val
                    if main:
                        save_gpt(model, out_dir)
                if not quiet:
                    bar.write(f"step {done}: val loss {val:.4f} (best {best_val:.4f})")
            if done % cfg.checkpoint_interval == 0 or done == cfg.max_steps:  # after this step's records (see above)
                weights = torch.stack([p.detach().float().norm() for p in model.parameters()]).norm().item()
                require_finite(weights, "the weights' norm", step, checkpoint)  # nan weights are no good checkpoint
                ranks = distributed.all_gather_objects(_rng_state())  # each rank's dropout stream, for a resume
                if main:
                    save_checkpoint(out_dir, model, optimizer, done, ranks[0],
                                    {**extra(), **({"rng_ranks": ranks} if len(ranks) > 1 else {})})
                checkpoint = out_dir / "last"
            bar.update(1)
    except KeyboardInterrupt:
        # before this step's update: replay it from its start state; after: continue with the next one
        if main:  # (the other ranks' random states are not gathered here: a resume starts them from rank 0's)
            save_checkpoint(out_dir, model, optimizer, next_step, rng if next_step == step else _rng_state(), extra())
        bar.close()
        print(f"\ninterrupted at step {next_step}: saved {out_dir / 'last'}; run the same command again to resume")
        raise
    bar.close()
    distributed.barrier()  # rank 0's last files are written before any rank reads them
    return {"steps": cfg.max_steps, "tokens": tokens_seen, "best_val": best_val}
