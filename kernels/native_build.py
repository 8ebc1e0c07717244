"""`python -m glowplug.kernels.native_build LEVEL DEST`: build one native kernel variant into the artifact store at
DEST and exit (0 built or already there, 1 failed, 2 bad arguments).

A start that has no variant for its ISA level starts this detached (kernels/native.py `_build_in_background`): the
compiler then runs in a process of its own, which the start never waits for and which outlives it, and the next
start finds the variant. Its own entry point, not the CLI's, so that the kernels never call up into the layer above.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    """Build LEVEL's variant into DEST (module docstring); one line on stderr when it cannot."""
    from glowplug.base.machine import ISA_LEVELS

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ISA_LEVELS:
        print(
            f"usage: python -m glowplug.kernels.native_build LEVEL DEST (LEVEL: one of {', '.join(ISA_LEVELS)})",
            file=sys.stderr,
        )
        return 2
    from .native import build_variant

    try:
        build_variant(Path(args[1]), args[0])
    except (OSError, RuntimeError) as exc:
        print(f"glowplug: {args[0]} not built: {str(exc).splitlines()[0] if str(exc) else exc!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
