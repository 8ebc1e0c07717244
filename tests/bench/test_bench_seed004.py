"""`glowplug bench seed004`'s report from a stored run (fixtures/seed004: what scripts/device_check.sh's seed004 step
wrote on a CPU at the tiny-qwen3 shape, `--device cpu --lengths 256,512 --budget 1500`; its `bench decode` part hit
the budget after three of its four engines, so the JSON holds those): the start-up table beside seed 004, the floor,
the targets' verdicts, the decode targets from the decode JSON; and the probe and the script's argument checks."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_no_blank_or_nan, markdown_cells

from glowplug.profiling.bench import startup_sweep as sb
from glowplug.profiling.bench.vllm_startup_rows import SEED_004

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures" / "seed004"


@pytest.fixture
def data() -> dict[str, Any]:
    return json.loads((FIXTURES / "seed004.json").read_text())


@pytest.fixture
def decode() -> list[dict[str, Any]]:
    return json.loads((FIXTURES / "decode.json").read_text())


def _table(text: str, first_header: str) -> dict[str, dict[str, str]]:
    """A Markdown table of `text` as row name -> column header -> cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    head = [c.strip() for c in lines[start].strip().strip("|").split(" | ")]
    out = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        out[cells[0]] = dict(zip(head, cells))
    return out


def test_the_start_table_sets_each_start_beside_the_seed_at_its_length(data: dict[str, Any]) -> None:
    text = sb.render_markdown(data)
    assert_no_blank_or_nan(text)
    table = _table(text, "Seed 004 row")
    runs = {(r["kind"], r["max_model_len"]): r["report"] for r in data["runs"]}
    disk = data["probe"]["disk_gbps"]
    for (kind, length), report in runs.items():
        col = f"glowplug {kind} {length}"
        actual = report["phases"]["actual_total_time"]
        assert table["actual_total_time"][col] == f"{actual:,.2f}"
        assert table["kv_cache_profiling"][col] == f"{report['phases']['kv_cache_profiling']:,.2f}"
        floor = report["attributes"]["floor"]
        want = floor["glowplug.floor.weights_bytes"] / (disk * 1e9) + floor["glowplug.floor.import_torch_s"]
        assert table[sb.FLOOR_ROW][col] == f"{want:,.2f}"
        assert table[sb.OVER_FLOOR_ROW][col] == f"{actual / want:,.2f}"
        if kind == "warm":  # the seed's value at the same length, as the seed printed it
            seed = SEED_004["qwen-4b"][length]
            assert table["actual_total_time"][f"seed qwen-4b {length}"] == f"{seed['actual_total_time']:,.2f}"
            assert table["load_weights"][f"seed qwen-4b {length}"] == f"{seed['load_weights']:,.2f}"
            assert table[sb.FLOOR_ROW][f"seed qwen-4b {length}"] == "n/a (the seed has no floor)"
    # every second accounted for: the last mapped row is the wall clock
    for col in (f"glowplug {k} {n}" for k, n in runs):
        assert table["glowplug: every leaf + unattributed - overlap"][col] == table["actual_total_time"][col]


def test_the_start_targets_follow_the_numbers(data: dict[str, Any]) -> None:
    verdicts = {v.target.split(",")[0].split(" (")[0]: v for v in sb.start_verdicts(data)}
    cold = next(r for r in data["runs"] if r["kind"] == "cold")
    actual = cold["report"]["phases"]["actual_total_time"]
    bound = sb.COLD_OVER_SEED * SEED_004["qwen-4b"][cold["max_model_len"]]["actual_total_time"]
    v = verdicts["cold time to READY"]
    assert v.passed == (actual <= bound) and f"{bound:.2f} s" in v.bound
    warm = [r["report"]["phases"] for r in data["runs"] if r["kind"] == "warm"]
    worst_seed = max(
        p["actual_total_time"] / SEED_004["qwen-4b"][r["max_model_len"]]["actual_total_time"]
        for p, r in zip(warm, [r for r in data["runs"] if r["kind"] == "warm"])
    )
    v = verdicts["warm time to READY / seed qwen-4b's actual_total_time at the same length"]
    assert v.measured.startswith(f"{worst_seed:.3f}x") and v.passed == (worst_seed <= sb.WARM_OVER_SEED)
    slowest = max(p["graph_capturing"] for p in warm)
    v = verdicts["warm graph_capturing"]
    assert v.measured.startswith(f"{slowest:.2f} s") and v.passed == (slowest <= sb.GRAPH_CAPTURE_S)


def test_the_decode_targets_come_from_the_decode_report(data: dict[str, Any], decode: list[dict[str, Any]]) -> None:
    text = sb.render_markdown({**data, "decode": decode})
    assert_no_blank_or_nan(text)
    verdicts = {v.target: v for v in sb.decode_verdicts(decode)}
    rows = {(r["quantization"], r["batch"], r["max_model_len"]): r for r in decode if not r.get("skipped")}
    short, long = min(r["max_model_len"] for r in decode), max(r["max_model_len"] for r in decode)

    def tps(key: tuple[str, int, int]) -> float:
        return statistics.median(rows[key]["tokens_per_s"])

    int4 = tps(("int4", 1, short)) / tps(("none", 1, short))
    v = verdicts["int4 batch-1 decode tok/s / bf16 batch-1"]
    assert v.measured == f"{int4:.2f}x" and v.passed == (int4 >= sb.INT4_VS_BF16)
    scale = tps(("none", 64, short)) / tps(("none", 1, short))
    v = verdicts["bf16 batch-64 decode tok/s / batch-1"]
    assert v.measured == f"{scale:.1f}x" and v.passed == (scale >= sb.BATCH64_VS_BATCH1)
    share = statistics.median(rows[("none", 1, short)]["probe_share"])
    v = verdicts["batch-1 bf16 weight traffic / the bandwidth probe (the bandwidth-bound rate)"]
    assert v.measured.startswith(f"{100 * share:.1f}%") and v.passed == (share >= sb.DECODE_PROBE_SHARE)
    hf = next(r for k, r in rows[("none", 1, short)]["peer_ratios"].items() if k.startswith("transformers"))
    v = verdicts["batch-1 bf16 decode / transformers bf16 generate (worst paired run)"]
    assert v.measured.startswith(f"{min(hf):.2f}x") and v.passed == (min(hf) >= sb.DECODE_VS_HF)
    pairs = [a / b for a, b in zip(rows[("none", 1, long)]["step_ms"], rows[("none", 1, short)]["step_ms"])]
    v = verdicts[f"bf16 batch-1 step at max model len {long} / at {short}"]
    assert v.measured.startswith(f"{statistics.median(pairs):.3f}x")
    # On a CPU nothing is captured: the pool's target says so instead of passing or failing.
    v = verdicts["CUDA graph pool / the largest captured batch's activations"]
    assert v.passed is None and v.word == "not measured"
    cells = [row[-1] for row in markdown_cells(text) if len(row) == 4 and row[0] != "Target"]
    assert {"PASS", "FAIL", "not measured"} >= set(cells)


def test_from_runs_renders_and_keeps_the_decode_report(data: dict[str, Any], tmp_path: Path) -> None:
    cfg = sb.Seed004BenchConfig(
        from_runs=FIXTURES / "seed004.json", decode_json=FIXTURES / "decode.json", out_dir=tmp_path
    )
    assert sb.main(cfg, ["bench", "seed004", "--from-runs", "x"]) == 0
    written = json.loads((tmp_path / sb.REPORT_JSON).read_text())
    assert written["runs"] == data["runs"] and written["decode"] == json.loads((FIXTURES / "decode.json").read_text())
    md = (tmp_path / sb.REPORT_MD).read_text()
    assert f"- the starts ran as: `glowplug {' '.join(data['argv'])}`" in md
    assert "## Targets" in md and "Partial run" not in md


def test_a_run_stopped_early_renders_what_it_finished(data: dict[str, Any]) -> None:
    cut = {**data, "partial": True, "runs": data["runs"][:-1]}
    text = sb.render_markdown(cut)
    assert "**Partial run**" in text
    last = data["runs"][-1]
    assert f"glowplug warm {last['max_model_len']}" not in text
    assert_no_blank_or_nan(text)


def test_the_read_probe_reads_the_files_in_order_up_to_its_limit(tmp_path: Path) -> None:
    files = [tmp_path / "a", tmp_path / "b"]
    files[0].write_bytes(b"x" * 3000)
    files[1].write_bytes(b"y" * 5000)
    sb.evict_from_page_cache(files)
    assert sb.read_probe(files, 6000, chunk=1024).bytes == 6000
    assert sb.read_probe(files, 10**9, chunk=1024).bytes == 8000


def test_device_check_parses_and_refuses_a_wrong_step() -> None:
    script = ROOT / "scripts" / "device_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    bad = subprocess.run(["bash", str(script), "--only", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "seed004" in bad.stderr
    bad = subprocess.run(["bash", str(script), "--seed004", "--shape", "gpt-5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "qwen-4b" in bad.stderr
