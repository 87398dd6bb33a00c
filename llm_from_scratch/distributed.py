"""Many processes, one model: data parallelism with torchrun and DistributedDataParallel (DDP).

    torchrun --standalone --nproc_per_node=W chapters/ch04_pretrain.py ...

starts W copies of the same script, the ranks 0..W-1, each with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in its environment. Data parallelism:

  * every rank holds the whole model, on its own device (cuda:LOCAL_RANK, or the CPU);
  * each global batch of B rows is cut into W shards, and rank r computes the loss L_r of its own shard;
  * DDP all-reduces the gradients during the backward pass and divides by W,   g = (1/W) Σ_r ∇L_r,
    so every rank applies the same update and the W copies never drift apart.

The same loss as one process. One process minimises the mean over all N target tokens of the batch,
(1/N) Σ_t ℓ_t. Rank r holds n_r of them (Σ_r n_r = N) and its mean is L_r = (1/n_r) Σ_{t∈r} ℓ_t. Scaled by
w_r = W n_r / N (`shard_weight`), DDP's average becomes (1/W) Σ_r w_r L_r = (1/N) Σ_t ℓ_t: the one-process loss,
however the targets fall (an SFT batch's prompts are masked out, so n_r differs between ranks). Without w_r a rank
with few targets would count as much as one with many. Every rank builds the whole global batch (it is cheap) and
keeps its rows, so it knows N without asking the others.

Gradient accumulation over K micro-batches backpropagates L_k / K for each (train.accumulate_gradients). The
all-reduce is needed once per optimizer step: the first K-1 backward passes run under DDP's `no_sync()`
(`sync_gradients`), and the last one all-reduces the summed gradients.

Only rank 0 writes files (`is_main`); a number one rank measured alone is summed or averaged over the ranks
(`all_reduce`) before it is logged or used for a decision every rank must take alike. Several machines need one
shared file system for the runs folder (rank 0 writes, the others read). Without torchrun, `setup()`
starts nothing, every helper here returns at once, and the code is the one-process code: one code path.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from llm_from_scratch.device import pick_device

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher that sets the same variables) started this process."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def setup(device: str = "auto") -> torch.device:
    """Join the process group torchrun prepared, if any, and return this rank's device.

    Without torchrun: `pick_device(device)`, nothing else. Under torchrun: CUDA → cuda:LOCAL_RANK with NCCL; CPU →
    gloo. Apple's MPS has no backend for several processes, so MPS under torchrun is an error. Ranks other than 0 stop
    printing to stdout (W copies of every line are no help); their errors still reach stderr."""
    picked = pick_device(device)
    if not launched_by_torchrun():
        return picked
    rank, local_rank, world = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if picked.type == "mps":
        raise ValueError(f"torchrun on {picked.type} (--device {device}): MPS has no multi-process backend; run one "
                         "process on a Mac, or several CPU processes with --device cpu")
    if picked.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank}, but this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s): lower --nproc_per_node")
        picked = torch.device("cuda", local_rank)
        torch.cuda.set_device(picked)
    if not dist.is_initialized():  # rank 0 alone evaluates and builds missing runs while the others wait: a long
        # timeout (NCCL's default is 10 minutes)
        dist.init_process_group("nccl" if picked.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(hours=2),
                                **({"device_id": picked} if picked.type == "cuda" else {}))
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    return picked


def cleanup() -> None:
    """Leave the process group (at the end of a script; nothing to do without torchrun)."""
    if dist.is_initialized():
        gc.collect()  # a DDP wrapper still alive holds the group: gloo then aborts at exit ("terminate called...")
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0: the one process that writes checkpoints, metrics, figures and summaries."""
    return rank() == 0


def wrap(model: nn.Module) -> nn.Module:
    """DistributedDataParallel around `model` when there are several ranks; the model itself otherwise.
    DDP copies rank 0's weights to every rank at once, so the copies start equal."""
    if world_size() == 1:
        return model
    device = next(model.parameters()).device
    # no buffer sync in the forward pass (our models have no buffers): no collective there, so ranks may run different
    # numbers of forward passes (an evaluation, a no-grad pass) without a deadlock. (torch ≥ 2.13 names it anew.)
    no_sync = ({"forward_sync_buffers": False}
               if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
               else {"broadcast_buffers": False})
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                               **no_sync)


def unwrap(model: nn.Module) -> nn.Module:
    """The network inside DDP and torch.compile wrappers (what a checkpoint saves)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def is_wrapped(model: nn.Module) -> bool:
    """True when `model` is DDP (or torch.compile of DDP): what a training step under torchrun needs."""
    return isinstance(getattr(model, "_orig_mod", model), nn.parallel.DistributedDataParallel)


def sync_gradients(model: nn.Module, sync: bool):
    """A context for one forward and backward pass: with sync=False, DDP keeps the gradients local (no all-reduce)
    and only adds them up; the next pass with sync=True all-reduces the sums. Without DDP: nothing happens."""
    if sync or not is_wrapped(model):
        return contextlib.nullcontext()
    return getattr(model, "_orig_mod", model).no_sync()


def shard_rows(n_rows: int) -> slice:
    """The rows of a global batch of n_rows that this rank computes: a contiguous W-th, the first ranks one row
    longer when W does not divide n_rows. A batch smaller than W would leave a rank with nothing: an error."""
    W, r = world_size(), rank()
    if n_rows < W:
        raise ValueError(f"a batch of {n_rows} rows cannot be shared by {W} processes: use a batch of at least {W}")
    base, extra = divmod(n_rows, W)
    start = r * base + min(r, extra)
    return slice(start, start + base + (r < extra))


def shard_weight(local_targets: int, global_targets: int) -> float:
    """w_r = W n_r / N: the factor on this rank's mean loss that makes DDP's average the mean over all N targets."""
    if global_targets == 0:
        return 0.0
    return world_size() * local_targets / global_targets


def all_reduce(values: torch.Tensor | list[float], op: str = "sum") -> torch.Tensor:
    """The sum (op="sum") or mean (op="mean") of `values` over the ranks, on every rank; `values` itself without
    torchrun. A list of floats travels as one float64 tensor (one message for several statistics)."""
    if op not in ("sum", "mean"):
        raise ValueError(f"all_reduce: op must be 'sum' or 'mean', got {op!r}")
    tensor = torch.as_tensor(values, dtype=torch.float64) if not torch.is_tensor(values) else values.clone()
    if world_size() == 1:
        return tensor
    home = tensor.device
    if dist.get_backend() == "nccl":  # NCCL moves GPU tensors only
        tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    if op == "mean":
        tensor = tensor / world_size()
    return tensor.to(home)


def global_means(columns: dict[str, torch.Tensor], n_global: int) -> dict[str, float]:
    """Means over a global batch of n_global items (pairs, rows) shared out between the ranks, from each rank's
    per-item values (name -> (n_r,)): the ranks' sums added up (one message for every column), over n_global. The
    same numbers on every rank; one process: the sums of its items over n_global."""
    # summed in float64 on the CPU: MPS has no float64 (one process may call this on a Mac); a no-op copy on a CPU
    sums = all_reduce([v.detach().cpu().double().sum().item() for v in columns.values()])  # (len(columns),)
    return {name: total / n_global for name, total in zip(columns, sums.tolist())}


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (any picklable value), in rank order, on every rank; [obj] without torchrun."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj):
    """Rank 0's `obj` (any picklable value) on every rank; `obj` itself without torchrun. The other ranks pass
    anything (None) and wait here until rank 0 arrives."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for without torchrun)."""
    if world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def main_first():
    """Rank 0 runs the block first (building a dataset, training a tokenizer), the others after it, and find what
    it wrote. If rank 0's block fails, the others raise instead of trying it themselves. Without torchrun: the
    block, once."""
    if world_size() == 1:
        yield
        return
    if is_main():
        try:
            yield
        except BaseException:
            broadcast_object(False)  # the others stop waiting, and stop
            raise
        broadcast_object(True)
    else:
        if not broadcast_object(None):
            raise RuntimeError("rank 0 failed in the work it does first (its error is above); stopping this rank")
        yield
