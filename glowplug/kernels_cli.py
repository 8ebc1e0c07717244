"""`glowplug kernels build | levels`: the native kernel variants from the command line.

`build` compiles one variant per ISA level (kernels/native.py) into the prebuilt store beside the sources, or into
`--dest`; scripts/setup.sh runs it at install time so that no start waits for a compiler. `levels` says which level
this machine runs at, why, and which variants are stored. The flags are validated by the pydantic models below,
like every other flag; torch is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from glowplug.base.machine import ISA_LEVELS


class BuildFlags(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    levels: tuple[str, ...] = Field(
        (),
        description="ISA levels to build (default: every level this architecture "
        f"has: {', '.join(ISA_LEVELS)} on x86). Repeat, or separate with commas.",
    )
    dest: Path | None = Field(
        None,
        description="Artifact store to build into (default: the prebuilt store beside "
        "the kernel sources, or $GLOWPLUG_NATIVE_PREBUILT).",
    )
    jobs: int = Field(0, ge=0, description="Compilers run at once (default: the CPU count).")
    quiet: bool = Field(False, description="Print nothing; the exit status says whether every level built.")

    @field_validator("levels", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else list(v)
        out = tuple(p.strip().lower() for item in items for p in str(item).split(",") if p.strip())
        bad = [p for p in out if p not in ISA_LEVELS]
        if bad:
            raise ValueError(f"not an ISA level: {', '.join(bad)} (the levels: {', '.join(ISA_LEVELS)})")
        return out


def register(sub: Any) -> None:
    """Add `glowplug kernels ...` to the top-level subparsers."""
    kernels = sub.add_parser("kernels", help="Build the native kernel variants (one per ISA level) and show the level.")
    ksub = kernels.add_subparsers(dest="kernels_command", required=True, metavar="ACTION")
    fields = BuildFlags.model_fields
    b = ksub.add_parser("build", help="Compile a variant per ISA level now (install time), so starts never compile.")
    b.add_argument("--levels", action="append", metavar="LEVEL", help=fields["levels"].description)
    b.add_argument("--dest", help=fields["dest"].description)
    b.add_argument("--jobs", type=int, default=0, help=fields["jobs"].description)
    b.add_argument("--quiet", action="store_true", help=fields["quiet"].description)
    b.set_defaults(func=_build)
    lv = ksub.add_parser("levels", help="The ISA level this machine runs the kernels at, why, and the stored variants.")
    lv.set_defaults(func=_levels)


def _build(args: argparse.Namespace) -> int:
    flags = BuildFlags.model_validate({k: getattr(args, k) for k in ("levels", "dest", "jobs", "quiet")})
    from glowplug.kernels.native import build_variant, buildable_levels, prebuilt_root

    levels = flags.levels or buildable_levels()
    dest = flags.dest or prebuilt_root()
    jobs = flags.jobs or os.cpu_count() or 1

    def one(level: str) -> tuple[str, str, float]:
        t0 = time.perf_counter()
        try:
            path, built = build_variant(dest, level)
        except (OSError, RuntimeError) as exc:
            return level, f"FAILED: {str(exc).splitlines()[0]}", time.perf_counter() - t0
        return level, f"{'built' if built else 'already there'}: {path}", time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each level is one compiler process
        results = list(pool.map(one, levels))
    if not flags.quiet:
        print(f"glowplug kernels: variants in {dest}")
        for level, outcome, seconds in results:
            print(f"  {level:<12} {seconds:6.1f} s  {outcome}")
    failed = [level for level, outcome, _ in results if outcome.startswith("FAILED")]
    if failed and not flags.quiet:
        print(
            f"glowplug kernels: {len(failed)} level(s) did not build ({', '.join(failed)}); a CPU of such a "
            "level runs the best level that did",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _levels(args: argparse.Namespace) -> int:
    from glowplug.base.artifacts.cachedir import cache_dir_from_env
    from glowplug.base.machine import IsaCapError, isa_choice
    from glowplug.kernels.native import LEVEL_FLAGS, find_variant, prebuilt_root

    try:
        choice = isa_choice()
    except IsaCapError as exc:
        print(f"glowplug: error: {exc}", file=sys.stderr)
        return 2
    print(f"level: {choice.reason}")
    print(f"prebuilt store: {prebuilt_root()}")
    cache = cache_dir_from_env()
    for level in ISA_LEVELS:
        found = find_variant(level, cache)
        where = f"{found[1]}: {found[0]}" if found else "not built"
        added = [f for f in LEVEL_FLAGS[level] if f not in LEVEL_FLAGS[ISA_LEVELS[max(ISA_LEVELS.index(level) - 1, 0)]]]
        print(f"  {level:<12} {('+' + ' '.join(added)) if added else '(no ISA flags)':<44} {where}")
    return 0
