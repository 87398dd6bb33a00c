"""What every chapter script shares: the common flags, and errors read as one line at the terminal.

A chapter script's own errors (an unknown device, a missing or empty --text, a malformed JSONL line, a
corrupt checkpoint, a missing earlier run, a NaN loss) are printed as `error: ...` with exit code 2,
as argparse prints a bad flag; `--debug` shows the whole traceback instead.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llm_from_scratch import distributed, reproducible  # noqa: E402
from llm_from_scratch.checkpoint import CheckpointError  # noqa: E402
from llm_from_scratch.course import PrerequisiteError, rebuild_hint  # noqa: E402
from llm_from_scratch.device import announce_first_pick  # noqa: E402

# the errors bad input causes (the library raises ValueError or FileNotFoundError for those, with a message that
# names the file, line or flag); anything else keeps its traceback
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, CheckpointError, PrerequisiteError,
               FloatingPointError)


def parser(doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def finite_float(text: str) -> float:
    """An argparse type: a float that is not nan or ±inf (float() accepts "nan" and "inf", and a nan learning rate
    would train on, every loss nan). argparse prints `error: argument --lr: must be a finite number, got nan`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0 (a learning rate, a coefficient that must not be 0)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_common_args(ap: argparse.ArgumentParser, out: str, dtype: bool = False) -> None:
    """--device, --seed, --out, --quick, --quiet, --debug (and --dtype for the scripts that train a GPT)."""
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or mps (default auto: cuda, then mps, then cpu)")
    if dtype:
        ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="training precision; auto = bfloat16 on CUDA GPUs that support it, float32 on MPS and on "
                             "every CPU (the same chain on every CPU)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--out", type=Path, help=f"output folder (default runs/{out}; quick runs: runs/quick/{out})")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run in seconds (also LLMFS_QUICK=1); writes under runs/quick/")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    add_fast_arg(ap)
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")


def add_fast_arg(ap: argparse.ArgumentParser) -> None:
    """--fast: every CPU core and torch's own kernels instead of the reproducible CPU mode (cli.run reads it)."""
    ap.add_argument("--fast", action="store_true",
                    help="leave the reproducible CPU mode (2 threads, AVX2 kernels, MKL's COMPATIBLE branch: the "
                         "same chain on any x86-64 CPU) for every core and the CPU's widest kernels; faster, but "
                         "another chain of runs, other numbers (also LLMFS_FAST=1; "
                         "llm_from_scratch/reproducible.py)")


def add_lora_args(ap: argparse.ArgumentParser) -> None:
    """--lora-rank, --lora-alpha, --lora-targets (chapters 7-9, appendix A); check them with check_lora_args."""
    ap.add_argument("--lora-rank", type=int, default=0, metavar="R",
                    help="train LoRA adapters of rank R on the frozen SFT weights instead of every weight; the "
                         "reference is then the same network with the adapters off, not a second copy, and --lr "
                         f"defaults to {LORA_LR_SCALE}x full fine-tuning's (appendix A; default 0: full fine-tuning)")
    ap.add_argument("--lora-alpha", type=positive_float, metavar="ALPHA",
                    help="LoRA's α: the update is (α / R) B A (default 2R)")
    ap.add_argument("--lora-targets", default="all", choices=["attn", "mlp", "all"],
                    help="which linear layers get adapters: attention's, the MLP's, or both (default all)")


# LoRA's learning rate where --lr is not given: this many times full fine-tuning's. The adapters start at zero and
# are few; measured on chapter 9's DPO (seed 0), LoRA r=8 at 10x the rate followed full fine-tuning's held-out gold
# and KL step for step (appendix A)
LORA_LR_SCALE = 10


def check_lora_args(ap: argparse.ArgumentParser, a: dict, default_lr: float) -> None:
    """The LoRA flags make sense together, and --lr gets its default (a: the parsed flags as a dict, changed in
    place): default_lr, or with --lora-rank LORA_LR_SCALE times it."""
    if a["lora_rank"] < 0:
        ap.error("--lora-rank must be ≥ 0 (0: full fine-tuning)")
    if not a["lora_rank"] and (a["lora_alpha"] is not None or a["lora_targets"] != "all"):
        ap.error("--lora-alpha and --lora-targets need --lora-rank R (R ≥ 1)")
    if a["lr"] is None:
        a["lr"] = default_lr * (LORA_LR_SCALE if a["lora_rank"] else 1)


def add_async_args(ap: argparse.ArgumentParser) -> None:
    """--async, --is-cap, --rollout-threads (chapters 7 and 8, appendix B); check them with check_async_args."""
    ap.add_argument("--async", dest="async_rollouts", action="store_true",
                    help="a worker process samples step t+1's batch with the weights of step t while step t's update "
                         "runs (one step off-policy; each token's loss weighted by min(π_old / μ, --is-cap), "
                         "llm_from_scratch/async_rollouts.py); the run goes to <name>_async (appendix B)")
    ap.add_argument("--is-cap", type=positive_float, default=2.0, metavar="C",
                    help="with --async: the cap C of the truncated importance weights (default 2)")
    ap.add_argument("--rollout-threads", type=int, default=0, metavar="N",
                    help="with --async: the worker's CPU threads; the trainer keeps the rest (default: half)")


def check_async_args(ap: argparse.ArgumentParser, a: dict) -> None:
    if not a["async_rollouts"] and (a["is_cap"] != 2.0 or a["rollout_threads"]):
        ap.error("--is-cap and --rollout-threads need --async")
    if a["is_cap"] < 1:
        ap.error(f"--is-cap must be ≥ 1 (a cap below 1 shrinks every on-policy token's weight), got {a['is_cap']}")
    if a["rollout_threads"] < 0:
        ap.error("--rollout-threads must be ≥ 0 (0: half of the CPU threads)")


def add_ptx_args(ap: argparse.ArgumentParser) -> None:
    """--ptx-coef, --ptx-batch-size (chapters 7 and 8): PPO-ptx, the SFT loss mixed into every RL update."""
    ap.add_argument("--ptx-coef", type=finite_float, default=0.0, metavar="γ",
                    help="PPO-ptx (InstructGPT): every update also minimises γ × the SFT loss of a batch of "
                         "chapter 5's training demonstrations, so that RL on one task does not cost the others "
                         "(the alignment tax); the run goes to <name>_ptx<γ> (default 0: off). The mix holds the "
                         "word-problem demonstrations too, wrong strategies included (data/README.md): on chapter 7's "
                         "word problems it pulls back toward what RL removes")
    ap.add_argument("--ptx-batch-size", type=int, default=16, metavar="N",
                    help="with --ptx-coef: demonstrations per batch, one batch per step (default 16)")


def check_ptx_args(ap: argparse.ArgumentParser, a: dict) -> None:
    if a["ptx_coef"] < 0:
        ap.error(f"--ptx-coef must be ≥ 0, got {a['ptx_coef']}")
    if a["ptx_batch_size"] < 1:
        ap.error("--ptx-batch-size must be ≥ 1")
    if a["ptx_coef"] and os.environ.get("WORLD_SIZE", "1") != "1":
        ap.error("--ptx-coef runs in one process: leave out torchrun")


def add_prerequisite_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--no-build", action="store_true",
                    help="when an earlier chapter's run is missing, stop and print the command that makes it "
                         "(default: run that chapter first, with its real defaults)")


def run(main, argv: list[str] | None = None):
    """Call main(argv); a user error becomes `error: ...` on stderr and exit code 2 (unless --debug). First the CPU
    mode is set and printed (reproducible.apply: the course's float32 order, unless --fast or LLMFS_FAST=1), before
    any torch operation; the chapter's first device pick prints the device and its precision (device.describe):
    every chapter, one place."""
    args = sys.argv[1:] if argv is None else argv
    mode = reproducible.apply(fast=reproducible.fast_requested(args))
    if "--help" not in args and "-h" not in args and os.environ.get("RANK", "0") == "0":
        print(mode, flush=True)
    announce_first_pick()
    try:
        return main(argv)
    except USER_ERRORS as err:
        if "--debug" in args:
            raise
        hint = rebuild_hint(err.folder) if isinstance(err, CheckpointError) else ""  # which chapter remakes it
        print(f"error: {err}{hint}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    finally:
        announce_first_pick(on=False)  # a main that never picked a device leaves nothing behind for later code
        try:
            distributed.cleanup()  # leave torchrun's process group, if the chapter joined one
        except Exception as err:  # noqa: BLE001 (never hide the run's own error behind this one)
            print(f"warning: leaving the process group failed: {err}", file=sys.stderr)
