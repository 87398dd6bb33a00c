#!/usr/bin/env bash
# The GPU check (issue 29, "Devices"): what a person with a CUDA GPU runs from the repository root.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]    # OUT_DIR: default $OUT when set, else gpu_check_out/
#
# Parts, each with its own time limit in seconds (in brackets; T_<PART>=N in the environment changes one, e.g.
# T_COURSE=600), their sum under 8 minutes, so that the whole check fits in 8 minutes on an H100-class GPU:
#   env      [15]  nvidia-smi, the torch / CUDA / cuDNN / NCCL versions, each GPU, the line a chapter prints first
#   parity   [25]  5 training steps of a tiny GPT on cuda against the same steps on the CPU, float32
#                  (tests/test_device_parity.py's compare_steps, called directly so that it cannot be skipped)
#   devtests [30]  tests/test_device_parity.py, tests/test_device.py and tests/test_bench_train.py under pytest
#   suite    [65]  python -m pytest -q -x -m "not slow" (no test takes its device from the environment; the ones
#                  that ask for device "auto" get cuda here)
#   bench   [110]  benchmarks/bench_train.py --device cuda --preset gpt2-124m, bf16 autocast, eager and
#                  torch.compile, with MFU against the GPU's datasheet peak
#   course  [180]  python chapters/run_all.py --quick (device auto: cuda), its runs under OUT_DIR/runs
#   ddp      [50]  torchrun --standalone --nproc_per_node=2 chapters/ch05_sft.py --quick: NCCL, one GPU per rank
#                  (distributed.setup puts rank r on cuda:r), so it needs 2 GPUs and is skipped on a single one
# Each part's output goes to OUT_DIR/<part>.log and the terminal; OUT_DIR/summary.txt lists each part's status and
# seconds. A part that fails or runs out of time does not stop the next one; the script then exits 1.
set -euo pipefail

if [[ ! -f chapters/run_all.py ]]; then
  echo "gpu_check.sh: run it from the repository root (bash benchmarks/gpu_check.sh)" >&2
  exit 2
fi
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python}"
SUMMARY="$OUT_DIR/summary.txt"
RUNS="$OUT_DIR/runs"
ON_PATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"  # the repository and tests/, for the two scripts below
: > "$SUMMARY"
failed=()
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

record() {  # record NAME STATUS SECONDS
  printf '%-8s %-8s %5ss\n' "$1" "$2" "$3" | tee -a "$SUMMARY"
}

part() {  # part NAME LIMIT COMMAND...: COMMAND under a time limit (its whole process group), output tee'd
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  echo "=== $name (limit ${limit}s): $*" | tee "$OUT_DIR/$name.log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/$name.log" || rc=$?
  local took=$((SECONDS - start)) status=ok
  if ((rc == 124 || rc == 137)); then
    status=TIMEOUT
  elif ((rc != 0)); then
    status="FAIL($rc)"
  fi
  [[ $status == ok ]] || failed+=("$name")
  record "$name" "$status" "$took"
}

skip() {  # skip NAME WHY
  echo "=== $1: skipped: $2" | tee "$OUT_DIR/$1.log"
  record "$1" skipped 0
}

cat > "$OUT_DIR/env_check.py" <<'PYTHON'
import subprocess

import torch

from llm_from_scratch.device import describe, pick_device

try:
    subprocess.run(["nvidia-smi"], check=False)
except OSError as err:
    print(f"nvidia-smi: {err}")
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print(f"torch {torch.__version__} | CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()} | NCCL {nccl}")
assert torch.cuda.is_available(), "torch sees no CUDA GPU"
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
print(describe(pick_device("cuda")))  # the line every chapter prints first
PYTHON

cat > "$OUT_DIR/parity_check.py" <<'PYTHON'
import sys

from test_device_parity import compare_steps

r = compare_steps("cuda", "cpu")
print(f"cuda vs cpu, the loss of each step: {r.losses_a} vs {r.losses_b}")
verdict = "ok" if r.ok else "MISMATCH: " + r.mismatch
print(f"max loss difference {r.loss_rel_diff:.2e} (relative); weights {r.update_rel_diff:.2e} of the distance moved "
      f"(max |diff| {r.weight_diff:.2e}): {verdict}")
sys.exit(0 if r.ok else 1)
PYTHON

part env "${T_ENV:-15}" env PYTHONPATH="$ON_PATH" "$PY" "$OUT_DIR/env_check.py"
part parity "${T_PARITY:-25}" env PYTHONPATH="$ON_PATH" "$PY" "$OUT_DIR/parity_check.py"
part devtests "${T_DEVTESTS:-30}" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_device_parity.py \
  tests/test_device.py tests/test_bench_train.py
part suite "${T_SUITE:-65}" "$PY" -m pytest -q -x -m "not slow" -p no:cacheprovider
part bench "${T_BENCH:-110}" "$PY" benchmarks/bench_train.py --device cuda --preset gpt2-124m --no-fp32 \
  --impls sdpa --steps 10
part course "${T_COURSE:-180}" env LLMFS_RUNS_DIR="$RUNS" "$PY" chapters/run_all.py --quick --quiet --again

GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
NPROC=$((GPUS < 2 ? GPUS : 2))
if ((NPROC < 2)); then
  skip ddp "$GPUS CUDA GPU(s): 2 NCCL ranks need 2 GPUs (distributed.setup puts rank r on cuda:r)"
else
  # python -m torch.distributed.run is torchrun, with this interpreter; it reuses the course's quick pretraining run
  part ddp "${T_DDP:-50}" env LLMFS_RUNS_DIR="$RUNS" "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node="$NPROC" chapters/ch05_sft.py --quick --quiet --out "$RUNS/quick/sft_ddp"
fi

echo
echo "summary ($SUMMARY), ${SECONDS}s in all:"
cat "$SUMMARY"
if ((${#failed[@]})); then
  echo "failed or out of time: ${failed[*]}"
  exit 1
fi
echo "every part passed"
