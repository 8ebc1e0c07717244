#!/usr/bin/env bash
# mypy on base/, kernels/, engine/ and lifecycle/ under the names they are installed as (glowplug.base, ...): the
# source folders are mapped to those names by pyproject's package-dir, which mypy cannot read, so a tree of links
# with that layout is made under build/ and checked. Settings: [tool.mypy] in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TREE=build/typecheck
rm -rf "$TREE" && mkdir -p "$TREE/glowplug"
for f in glowplug/*.py; do ln -s "$ROOT/$f" "$TREE/glowplug/"; done
for d in base engine kernels lifecycle profiling; do ln -s "$ROOT/$d" "$TREE/glowplug/$d"; done
PYTHON=${PYTHON:-.venv/bin/python}
cd "$TREE"
exec "$ROOT/$PYTHON" -m mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$ROOT/build/mypy-cache" \
    --python-executable "$ROOT/$PYTHON" --explicit-package-bases \
    -p glowplug.base -p glowplug.kernels -p glowplug.engine -p glowplug.lifecycle "$@"
