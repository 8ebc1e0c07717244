"""Screenshots of the live start-up page: a thin wrapper over `glowplug bench screenshots` (kept for the README's
and older notes' command lines; the logic lives in glowplug/profiling/bench/screenshots.py).

    .venv/bin/python scripts/page_screenshot.py [--out reports/startup] [--under-load N] [-- [MODEL] SERVE ARGS...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glowplug.profiling.bench.screenshots import ScreenshotsConfig, main


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("reports/startup"))
    parser.add_argument("--chromium", default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for READY")
    parser.add_argument(
        "--under-load",
        type=int,
        default=0,
        metavar="N",
        help="after READY, screenshot the serving view under `glowplug bench serve` with N clients",
    )
    parser.add_argument(
        "serve_args",
        nargs="*",
        help="passed to `glowplug serve` (after --); a first word that is not a flag names the model",
    )
    args = parser.parse_args()
    serve_args = list(args.serve_args)
    model = serve_args.pop(0) if serve_args and not serve_args[0].startswith("-") else "smollm2"
    cfg = ScreenshotsConfig(
        model=model,
        out=args.out,
        under_load=args.under_load,
        timeout_s=args.timeout,
        chromium=args.chromium,
        serve_args=tuple(serve_args),
    )
    return main(cfg, ["bench", "screenshots", model, "--out", str(args.out), "--under-load", str(args.under_load)])


if __name__ == "__main__":
    sys.exit(run())
