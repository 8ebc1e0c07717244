"""A separate process for the cache fault tests: one start-up (or one calibration), result as JSON on stdout.

Separate processes are what the two-writers cases need, and what the compile cases need too: Inductor keeps
compiled kernels in memory, so only a fresh process shows what a damaged cache on disk does to a start.
Usage: python tests/cache_fault_worker.py '<json args>'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import cache_faults_util as util


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("start_at"):  # line both writers up on the same instant
        time.sleep(max(0.0, args["start_at"] - time.time()))
    cache = Path(args["cache"])
    if args.get("calibrate"):
        from glowplug.kernels.dispatch import calibrate

        table = calibrate([tuple(s) for s in args["calibrate"]], cache, repeats=1, stream_bytes=1 << 16)
        print("RESULT:" + json.dumps({"measured": sorted(table.measured)}))
        return
    if args.get("fake_gguf_from"):
        util.install_fake_converter(Path(args["fake_gguf_from"]))
    print("RESULT:" + json.dumps(util.start(args["model"], cache, args.get("config", {}))))


if __name__ == "__main__":
    main()
