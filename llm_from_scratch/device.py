"""Where the tensors live, how random numbers start, and when to compute in bfloat16.

* `pick_device("auto")` tries CUDA, then Apple's MPS, then the CPU; naming a device that is not
  there is an error that lists the ones that are. On CUDA it also lets float32 matrix multiplications run in
  TensorFloat-32 (`allow_tf32`): every chapter picks its device there, so this is the one place that sets it.
* `describe(device)` is the line a chapter prints first: the device, and the precision its float32 math runs in;
  chapters/cli.py has the first `pick_device` of a chapter script print it (`announce_first_pick`).
* `seed_everything(seed)` seeds Python's `random`, NumPy and torch (CPU and every GPU) at once.
* `autocast(device)` runs matrix multiplications in bfloat16 on CUDA GPUs that support it
  (Ampere and newer): half the memory traffic, tensor cores, and the same exponent range as float32
  so no loss scaling is needed. Elsewhere it is off unless asked for (`dtype=torch.bfloat16` on CPU).
* `choose_dtype("auto", device)` is the precision a chapter trains in: bfloat16 on CUDA, float32 on
  MPS and on every CPU. A CPU with bf16 units can run the tiny model's pretraining step faster in
  bfloat16 (`train.fastest_dtype` times the two), but a choice made by a timing race differs between
  machines and even between runs on one machine, and the course's chain of runs must be the same
  wherever it is rebuilt: so "auto" never races on a CPU. `--dtype bfloat16` asks for it; every run
  records its precision.
* `keep_freed_memory()` stops glibc from handing large freed blocks back to the system after every step (Linux);
  `train.train` calls it on a CPU. The numbers computed do not change; the step gets faster and the process keeps
  more memory (its docstring says how much).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import sys

import numpy as np
import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")


def available_devices() -> list[str]:
    """The device types this machine can run on, best first."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    found.append("cpu")
    return found


def pick_device(name: str = "auto") -> torch.device:
    """`"auto"` → the best available (cuda → mps → cpu); otherwise the named device, checked to exist.

    Accepts an index too (`"cuda:1"`). Raises ValueError naming what is available. A CUDA device gets TF32 float32
    matmuls (`allow_tf32`); a CPU or MPS device changes nothing.
    """
    name = str(name).strip().lower()
    kind = name.split(":")[0]
    if kind not in DEVICE_CHOICES:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(DEVICE_CHOICES)}")
    have = available_devices()
    if kind == "auto":
        return _picked(torch.device(have[0]))
    if kind not in have:
        raise ValueError(f"device {name!r} is not available on this machine; available: {', '.join(have)}")
    if kind == "cuda" and ":" in name:
        index = int(name.split(":")[1])
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return _picked(torch.device(name))


def _picked(device: torch.device) -> torch.device:
    global _announce
    allow_tf32(device)
    if _announce is not None:
        announce, _announce = _announce, None  # once: the chapter's own device, not a later helper's pick
        announce(device)
    return device


def allow_tf32(device: torch.device | str) -> bool:
    """On CUDA, let float32 matrix multiplications use TensorFloat-32 tensor cores (Ampere and newer): inputs rounded
    to a 10-bit mantissa, products summed in float32, several times float32's speed. It matters where a run computes
    in float32 on a GPU: `--dtype float32`, and chapters 6 to 10, which train without autocast. Only CUDA's flag is
    set (`torch.set_float32_matmul_precision("high")` would also let oneDNN round on some CPUs), so CPU and MPS
    arithmetic stays bit for bit what it was. LLMFS_TF32=0 in the environment keeps full float32 on CUDA too.
    Returns True when TF32 is now allowed."""
    if torch.device(device).type != "cuda" or os.environ.get("LLMFS_TF32", "1") == "0":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True  # the legacy flag: the one every torch >= 2.3 reads
    return True


_announce = None  # a callable(device) that the next pick_device calls once (announce_first_pick)


def announce_first_pick(callback=None, on: bool = True) -> None:
    """Have the next `pick_device` call `callback(device)` once (default: print `describe(device)`), so that a
    script prints its device and precision when it picks them; on=False takes back an announcement not yet made.
    chapters/cli.py's `run` sets it for every chapter. Under torchrun only rank 0 prints (the others' lines would
    repeat it)."""
    global _announce
    if not on or (callback is None and os.environ.get("RANK", "0") != "0"):
        _announce = None
        return
    _announce = callback or (lambda device: print(describe(device), flush=True))


def describe(device: torch.device | str) -> str:
    """One line: the device (a GPU by name), the precision float32 matrix products run in there, and whether bf16
    autocast is on by default (`choose_dtype("auto")`). A chapter that trains with `--dtype` (chapters 4 and 5)
    prints the precision it chose after this line."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            tf32 = torch.backends.cuda.matmul.allow_tf32
        except RuntimeError:  # torch >= 2.9 refuses to read it after the newer fp32_precision flag was set alone
            tf32 = torch.backends.cuda.matmul.fp32_precision == "tf32"
        name, matmuls = f"{device} ({torch.cuda.get_device_name(index)})", "TF32" if tf32 else "float32"
    else:
        threads = torch.get_num_threads()
        name = f"cpu ({threads} thread{'s' if threads != 1 else ''})" if device.type == "cpu" else str(device)
        matmuls = "float32"
    bf16 = "on" if default_autocast_dtype(device) == torch.bfloat16 else "off"
    return f"device {name} | float32 matmuls: {matmuls} | bf16 autocast by default: {bf16} | torch {torch.__version__}"


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) so a run can be repeated exactly."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def default_autocast_dtype(device: torch.device | str) -> torch.dtype | None:
    """bfloat16 on CUDA GPUs that support it; None (full float32) everywhere else."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def autocast(device: torch.device | str, dtype: torch.dtype | None | str = "default"):
    """A context manager for mixed precision on `device`.

    dtype="default": `default_autocast_dtype(device)`; None: off (plain float32);
    a torch dtype (e.g. torch.bfloat16 on CPU): on, with that dtype.
    """
    device = torch.device(device)
    if isinstance(dtype, str):
        if dtype != "default":
            raise ValueError(f"autocast: dtype must be 'default', None or a torch dtype, got {dtype!r}")
        dtype = default_autocast_dtype(device)
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


DTYPES = ("float32", "bfloat16")


def choose_dtype(requested: str, device: torch.device | str, measure=None) -> str:
    """The training precision by name. "float32" or "bfloat16" are taken as asked; "auto" -> "bfloat16" on CUDA
    GPUs that support it, "float32" on MPS, and on a CPU `measure()` (a function that times the model's own
    training step and returns the faster precision) when one is given, else "float32"."""
    if requested == "auto":
        if torch.device(device).type == "cpu" and measure is not None:
            return measure()
        return "bfloat16" if default_autocast_dtype(device) == torch.bfloat16 else "float32"
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}: choose auto, {' or '.join(DTYPES)}")
    return requested


def dtype_of(name: str) -> torch.dtype | None:
    """The autocast dtype for a precision name: None for "float32" (autocast off), torch.bfloat16 for "bfloat16"."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return torch.bfloat16 if name == "bfloat16" else None


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Let the memory allocator keep large freed blocks for the next step instead of giving them back (glibc only).

    glibc serves every block over 32 MiB with a fresh mmap and unmaps it when it is freed. A training step at the
    course's CPU shapes frees and asks again for several such blocks each step (the logits of 32 × 128 tokens over
    4,096 words are 64 MiB, and so are their log-softmax and its gradient), and the kernel zeroes every new page on
    first touch: about 280 MB of page faults per step. With mmap off (M_MMAP_MAX = 0) and the heap trimmed only above
    1 GiB free, the blocks go back to the heap and the next step reuses them. The arithmetic is untouched, so every
    result is the same bit for bit.

    The price is memory: freed blocks stay with the process, and PyTorch's 64-byte-aligned requests do not always fit
    the hole a block of the same size left, so the heap settles higher. Measured (README, "Speed"): the tiny GPT's
    step 1.29× faster at a peak of 894 instead of 717 MiB; a 50,257-word vocabulary 1.69× faster at 1,546 instead of
    1,156 MiB. LLMFS_KEEP_FREED_MEMORY=0 in the environment turns it off. Returns True when the setting took; False
    when turned off, and on other C libraries (macOS, Windows, musl), where nothing changes."""
    if not sys.platform.startswith("linux") or os.environ.get("LLMFS_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):  # one without mallopt (not glibc)
        return False
    trim_first = bool(mallopt(M_TRIM_THRESHOLD, 2**30))  # keep what is freed before it can be taken back
    return bool(mallopt(M_MMAP_MAX, 0)) and trim_first
