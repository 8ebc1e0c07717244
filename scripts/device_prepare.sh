#!/usr/bin/env bash
# What a GPU machine with no network needs from here, in one folder to carry (default .gpu, ignored by git):
#
#   bash scripts/device_prepare.sh [DIR]
#
#   DIR/wheels/     glowplug's dependencies that the machine's image lacks, and transformers (bench decode's peer;
#                   the image's own is older than the tests use), as cp312 manylinux wheels at the versions installed
#                   in this venv (pip download --no-deps: exactly these, nothing resolved there);
#   DIR/tokenizer/  the default model's tokenizer files, from the folder model_prepare builds from its GGUF (the
#                   synthetic checkpoints of scripts/synthetic_checkpoint.py carry them);
#   DIR/commit      HEAD and whether tracked files outside reports/ differ from it ("<sha> 0|1"): the reports made
#                   there name it, since the copy of the tree there need not be a git checkout.
#
# Run it right before the device call (the commit file describes the tree as it is now), then, with the device tool:
#   run(carry=[".gpu"], timeout_s=600, command="bash scripts/device_check.sh --carry .gpu --seed004 --out /tmp/gpu;
#       tar -C /tmp/gpu -czf $OUT/gpu.tgz .")
# and unpack gpu.tgz into reports/gpu/. The tree and DIR together must stay under the tool's 64 MiB per call; the
# script prints both sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu}
PY=${PYTHON:-.venv/bin/python}
# Not in the device image (the device tool's KINDS.md lists what is), or needed at another version there: the seed004
# step's (glowplug's runtime, transformers) and the CUDA tests' openai client (the suite imports it).
PACKAGES=(
    pydantic pydantic-core annotated-types typing-inspection typing-extensions structlog
    fastapi starlette uvicorn gguf regex transformers
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
    opentelemetry-exporter-otlp opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http
    opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-common opentelemetry-exporter-http-transport
    googleapis-common-protos openai jiter sniffio httpx2 httpcore2 truststore anyio
)
SPECS=$("$PY" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        sys.exit(f"device_prepare: {name} is not installed in this venv; run scripts/setup.sh first")
print(" ".join(out))
EOF
)
rm -rf "$DIR/wheels" "$DIR/tokenizer"
mkdir -p "$DIR/wheels" "$DIR/tokenizer"
# shellcheck disable=SC2086  # one word per requirement
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR/wheels" $SPECS
TOK=$("$PY" -c "from glowplug.engine.models.store import resolve_model; print(resolve_model('smollm2', quiet=True))")
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    [ -f "$TOK/$f" ] && cp "$TOK/$f" "$DIR/tokenizer/$f"
done
DIRTY=$([ -n "$(git status --porcelain --untracked-files=no -- . ':(exclude)reports')" ] && echo 1 || echo 0)
echo "$(git rev-parse HEAD) $DIRTY" >"$DIR/commit"
TREE=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r stat -c %s 2>/dev/null \
        | awk '{s += $1} END {print s + 0}')
CARRIED=$(du -sb "$DIR" | cut -f1)
echo "device_prepare: $(ls "$DIR/wheels" | wc -l) wheels, tokenizer from $TOK, commit $(cat "$DIR/commit")"
echo "device_prepare: $DIR is $((CARRIED / 1048576)) MiB, the tree $((TREE / 1048576)) MiB: together" \
     "$(((CARRIED + TREE) / 1048576)) MiB of the 64 MiB a call carries"
[ $((CARRIED + TREE)) -lt $((64 * 1048576)) ] || { echo "device_prepare: over 64 MiB" >&2; exit 1; }
