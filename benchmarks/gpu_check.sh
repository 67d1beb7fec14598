#!/usr/bin/env bash
# The GPU check: everything in this repository that only a CUDA GPU runs, in one go.
#
#   1. the tests of the compiled Triton kernels — stage 05's flash attention, stage 07's paged decode
#      attention, stage 09's timings of both — that is, the whole of tests/test_gpu_kernels.py,
#      tests/test_stage05_flash.py and tests/test_stage07_paged_attention.py (on a GPU their kernels
#      run compiled; on a CPU, in Triton's interpreter or skipped). Every test marked `gpu` is in
#      these files; the rest of tests/ runs the same on any machine. No `-x`; a per-test time limit
#      when pytest-timeout is installed.
#   2. `make bench-gpu`'s benchmarks, run with the python given (no venv, no install, no network):
#      benchmarks/flash_attention.py, benchmarks/paged_attention.py and
#      benchmarks/engine_decode.py --device cuda --rows 1,16,64.
#
# Needs: a CUDA GPU, and python with torch, triton, safetensors, tokenizers, numpy and pytest.
# Nothing is installed or downloaded. From the repository root, on any such machine:
#
#     bash benchmarks/gpu_check.sh [LOG_DIR]
#
# Logs go to $OUT when it is set, else to LOG_DIR, else to reports/gpu-check/ (git-ignored): one
# log per step and summary.txt (at most 7 files). The exit status is 0 when every step passed.
# Without a GPU it still runs: the GPU tests skip and every benchmark says "skipped".
#
# The engine benchmark needs a checkpoint. In order: $AIE_MODEL_DIR; the course model when
# `aie fetch-model` put it in data/models/; else a checkpoint of random weights built in a
# scratch folder from the config.json, tokenizer.json and tokenizer_config.json found in
# $GPU_CHECK_MODEL_FILES (default .gpu-check-model/, git-ignored: copy those three files there from
# data/models/smollm2-135m-instruct/ before sending the tree to a GPU machine without the model),
# with the tests' random-weight scheme
# (tests/conftest.py). Random weights are the course model's shapes and dtype, so its speeds are
# the same; its tokens mean nothing (the benchmark only compares the two engines' tokens).
#
# Variables: PYTHON (default python3), OUT, AIE_MODEL_DIR, GPU_CHECK_MODEL_FILES,
# GPU_CHECK_BUDGET_S (seconds for the whole check, default 1800: each step gets at most what is
# left of it, so that a slow step still leaves the logs of the others), GPU_CHECK_TEST_TIMEOUT_S
# (per test, default 180).

set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-python3}"
LOGS="${OUT:-${1:-reports/gpu-check}}"
mkdir -p "$LOGS" || exit 2
LOGS="$(cd "$LOGS" && pwd)"
BUDGET="${GPU_CHECK_BUDGET_S:-1800}"
TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT_S:-180}"
MODEL_FILES="${GPU_CHECK_MODEL_FILES:-.gpu-check-model}"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/aie-gpu-check.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
START=$SECONDS
SUMMARY=()
FAILED=0

# run NAME LIMIT_S COMMAND...: COMMAND's output to the screen and $LOGS/NAME.log, within LIMIT_S
# and within what is left of the budget; its status and seconds go into the summary.
run() {
    local name=$1 limit=$2 left t0 rc status
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    ((limit > left)) && limit=$left
    if ((limit < 10)) && ! declare -F "$1" >/dev/null; then
        SUMMARY+=("$(printf '%-16s not run: the budget of %s s is spent' "$name" "$BUDGET")")
        FAILED=1
        return
    fi
    echo
    t0=$SECONDS
    if declare -F "$1" >/dev/null; then  # a function of this script: no time limit of its own
        echo "=== $name"
        "$@" 2>&1 | tee "$LOGS/$name.log"
    else
        echo "=== $name (at most ${limit} s): $*"
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    fi
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status="ok" ;;
        124 | 137) status="TIMED OUT after ${limit} s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    ((rc == 0)) || FAILED=1
    SUMMARY+=("$(printf '%-16s %-28s %4d s' "$name" "$status" $((SECONDS - t0)))")
}

setup() {
    echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm \
        --format=csv,noheader
    "$PY" - <<'EOF' || return 1
import importlib.metadata, os, platform, sys
import torch
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
for name in ("triton", "safetensors", "tokenizers", "numpy", "pytest", "pytest-timeout", "transformers"):
    try:
        print(f"  {name}: {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"  {name}: MISSING")
if os.environ.get("TRITON_INTERPRET"):
    print(f"  note: TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} is set: kernels will be interpreted")
import aie_lessons.gpu_kernels, aie_lessons.engine.compiled_runner, aie_lessons.engine.paged_engine  # noqa: E401
print("  aie_lessons: the GPU kernels and both engines import")
EOF
    local model
    model="$("$PY" -c 'from aie_lessons.infra.paths import default_model_dir; print(default_model_dir())')" || return 1
    if compgen -G "$model/*.safetensors" >/dev/null; then
        echo "model: $model"
        echo "$model" >"$SCRATCH/model_dir"
    elif [ -f "$MODEL_FILES/config.json" ] && [ -f "$MODEL_FILES/tokenizer.json" ]; then
        echo "model: no checkpoint at $model; building random weights for $MODEL_FILES/config.json"
        "$PY" - "$MODEL_FILES" "$SCRATCH/random-model" <<'EOF' || return 1
import json, shutil, sys, time
from pathlib import Path

sys.path.insert(0, "tests")
from conftest import random_weights  # the tests' scheme (see its note on the final norm)
from safetensors.torch import save_file

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True)
for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    if (src / name).exists():
        shutil.copy(src / name, dst / name)
config = json.loads((dst / "config.json").read_text())
start = time.perf_counter()
weights = random_weights(config)
save_file(weights, str(dst / "model.safetensors"))
print(f"  {sum(w.numel() for w in weights.values()) / 1e6:.1f} M random fp32 parameters written to "
      f"{dst} in {time.perf_counter() - start:.1f} s")
EOF
        echo "$SCRATCH/random-model" >"$SCRATCH/model_dir"
    else
        echo "model: none (no checkpoint at $model, no config.json and tokenizer.json in $MODEL_FILES):" \
             "the engine benchmark is left out"
    fi
}

run setup 0 setup
if [ -f "$SCRATCH/model_dir" ]; then
    export AIE_MODEL_DIR="$(cat "$SCRATCH/model_dir")"
fi

TIMEOUT_FLAG=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_FLAG=(--timeout "$TEST_TIMEOUT")
run tests 900 "$PY" -m pytest tests/test_gpu_kernels.py tests/test_stage05_flash.py \
    tests/test_stage07_paged_attention.py -m "not oracle" -rfEs --durations=10 -p no:cacheprovider \
    "${TIMEOUT_FLAG[@]}"
run flash_attention 300 "$PY" benchmarks/flash_attention.py
run paged_attention 300 "$PY" benchmarks/paged_attention.py
if [ -n "${AIE_MODEL_DIR:-}" ]; then
    run engine_decode 1200 "$PY" benchmarks/engine_decode.py --device cuda --rows 1,16,64
else
    SUMMARY+=("$(printf '%-16s not run: no checkpoint (see setup.log)' engine_decode)")
    FAILED=1
fi

{
    echo
    echo "=== summary: $((SECONDS - START)) s, logs in $LOGS"
    printf '%s\n' "${SUMMARY[@]}"
    if [ -f "$LOGS/tests.log" ]; then
        echo "tests: $(grep -E '^=+ .*(passed|failed|error|skipped).* in [0-9.]+s' "$LOGS/tests.log" | tail -1 | tr -d '=')"
        grep -E '^(FAILED|ERROR) ' "$LOGS/tests.log" | head -20
    fi
    grep -h '^skipped' "$LOGS"/flash_attention.log "$LOGS"/paged_attention.log "$LOGS"/engine_decode.log 2>/dev/null \
        | sed 's/^/benchmark /'
} | tee "$LOGS/summary.txt"
exit $FAILED
