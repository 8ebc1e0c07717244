"""Weights used where they lie: under the default `auto`, a GGUF's quantized tensors are computed on from the mapped
file. Two engine processes on one file: each one's weight pages are file-backed (no anonymous copy of them), and the
second shares the first's pages (the kernel's /proc/PID/smaps is the oracle)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "gguf"
FILE = DATA / "qwen2-bias-q4_k_m.gguf"

# An engine on the file; prints the stored bytes its load_weights row reports and the smaps totals of the file's
# mappings, then waits (stdin) so that the other process starts while this one holds its pages.
_WORKER = """
import json, sys
from glowplug.engine.llm import LLM
from glowplug.engine.sampling_params import SamplingParams

llm = LLM(sys.argv[1], compile="off", max_model_len=128, num_gpu_blocks_override=16, max_num_seqs=2)
out = llm.generate(["The scheduler"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
row = next(r for r in llm.startup.phase_table.rows if r.name == "load_weights")
totals = {"Rss": 0, "Shared_Clean": 0, "Private_Dirty": 0, "Anonymous": 0}
current = False
for line in open("/proc/self/smaps"):
    head = line.split()
    if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line: range perms offset dev inode [path]
        current = len(head) >= 6 and head[5] == sys.argv[1]
    elif current and head and head[0].rstrip(":") in totals:
        totals[head[0].rstrip(":")] += int(head[1]) * 1024
print(json.dumps({"stored": row.attributes.get("glowplug.gguf_stored_bytes", 0), "smaps": totals,
                  "tokens": out[0].outputs[0].token_ids}), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_two_engines_share_the_files_pages(tmp_path: Path) -> None:
    procs: list[subprocess.Popen[str]] = []
    results = []
    try:
        for _ in range(2):
            p = subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(FILE)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                cwd=tmp_path,
            )
            procs.append(p)
            assert p.stdout is not None
            line = "{"
            while line and not line.startswith('{"stored"'):  # the start-up log goes to stdout too
                line = p.stdout.readline()
            assert line, f"the engine process exited with {p.poll()} before reporting"
            results.append(json.loads(line))
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=60)
    first, second = results
    stored = first["stored"]
    assert stored > 0.5 * FILE.stat().st_size, "auto did not run the quantized tensors in place"
    for r in results:
        # The weights are the file's pages: resident, never copied into anonymous memory or dirtied.
        assert r["smaps"]["Rss"] >= 0.9 * stored, r
        assert r["smaps"]["Anonymous"] == 0 and r["smaps"]["Private_Dirty"] == 0, r
    # The second engine maps the pages the first one already holds.
    assert second["smaps"]["Shared_Clean"] >= 0.9 * stored, second
    assert first["tokens"] == second["tokens"]
