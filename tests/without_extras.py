"""Run a module as `python -m` would, in a process where transformers, accelerate and matplotlib cannot be imported.

    python tests/without_extras.py MODULE [ARGS...]

They come with the `test` and `bench` extras, not as runtime dependencies: a meta-path finder placed ahead of every
other one refuses them as if they were not installed, so whatever MODULE does (serve, generate) proves it needs neither.
Used by tests/test_without_extras.py.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

BLOCKED = ("transformers", "accelerate", "matplotlib")


class RefuseExtras(MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (refused by tests/without_extras.py)", name=fullname
            )
        return None  # everything else: the normal finders


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: without_extras.py MODULE [ARGS...]")
    sys.meta_path.insert(0, RefuseExtras())
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
