"""ISA levels of the native kernels: which level a CPU gets, the GLOWPLUG_MAX_CPU_ISA cap, where a variant comes
from (prebuilt, cached, a lower level while the right one builds in the background), every op at every level this
machine can run against its torch reference, and a capped start's tokens against the uncapped one's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from glowplug.base.machine import ISA_LEVELS, IsaCapError, cpu_isa_level, isa_choice, level_at_least

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/kernels/test_kernels_native.py",
    "tests/kernels/test_native_attention.py",
    "tests/kernels/test_native_gguf.py",
    "tests/kernels/test_native_rows.py",
]
AVX2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}


def _runnable_levels() -> list[str]:
    top = cpu_isa_level()
    return [lv for lv in ISA_LEVELS if level_at_least(top, lv)]


def test_a_cpu_gets_the_highest_level_whose_flags_it_has_in_full() -> None:
    assert cpu_isa_level(frozenset({"sse2"}), "x86_64") == "portable"
    assert cpu_isa_level(AVX2 - {"f16c"}, "x86_64") == "portable"  # AVX2 without F16C: not the avx2 level
    assert cpu_isa_level(AVX2, "x86_64") == "avx2"
    assert cpu_isa_level(AVX512 - {"avx512_vnni"}, "x86_64") == "avx2"  # Skylake-SP: AVX512 without VNNI
    assert cpu_isa_level(AVX512, "x86_64") == "avx512"  # Cascade Lake
    assert cpu_isa_level(AVX512 | {"avx512_bf16"}, "x86_64") == "avx512_bf16"  # Zen 4
    assert cpu_isa_level(AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}, "x86_64") == "amx"
    assert cpu_isa_level(AVX512 | {"avx512_bf16"}, "aarch64") == "portable"  # flags of another architecture


def test_the_cap_lowers_the_level_and_a_bad_cap_names_the_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOWPLUG_MAX_CPU_ISA", "portable")
    choice = isa_choice()
    assert choice.level == "portable" and choice.cap == "portable"
    if choice.cpu_level != "portable":
        assert "capped by GLOWPLUG_MAX_CPU_ISA=portable" in choice.reason
    monkeypatch.setenv("GLOWPLUG_MAX_CPU_ISA", "amx")  # a cap above the CPU changes nothing
    assert isa_choice().level == cpu_isa_level()
    monkeypatch.setenv("GLOWPLUG_MAX_CPU_ISA", "sse4")
    with pytest.raises(IsaCapError, match="'sse4' is not an ISA level: set it to one of portable, avx2, avx512"):
        isa_choice()


def test_a_bad_cap_fails_the_start_before_any_work(tmp_path: Path) -> None:
    env = {**os.environ, "GLOWPLUG_MAX_CPU_ISA": "avx3", "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "glowplug.cli", "startup", "smollm2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "GLOWPLUG_MAX_CPU_ISA='avx3' is not an ISA level" in proc.stderr
    assert not (tmp_path / "cache" / "model").exists(), "nothing was prepared"


def _load_in_child(env: dict[str, str]) -> dict[str, object]:
    script = (
        "import json, sys; from pathlib import Path; from glowplug.kernels.native import load_native; "
        "b = load_native(Path(sys.argv[1])); print(json.dumps({'available': b.available, 'level': b.level, "
        "'reason': b.reason, 'why': b.level_reason, 'background': b.background, 'hit': b.cache_hit}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, env["GLOWPLUG_CACHE_DIR"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler to build")
def test_a_lower_stored_variant_runs_now_and_the_right_one_is_not_waited_for(tmp_path: Path) -> None:
    """Only the portable variant is prebuilt: a start capped at (or having) a higher level loads it at once, says
    why on the row, and leaves the right level to a background build (switched off here, and it says so)."""
    from glowplug.kernels.native import build_variant

    if cpu_isa_level() == "portable":
        pytest.skip("this CPU's level is the portable one")
    prebuilt = tmp_path / "prebuilt"
    build_variant(prebuilt, "portable")
    env = {
        **os.environ,
        "GLOWPLUG_NATIVE_PREBUILT": str(prebuilt),
        "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache"),
        "GLOWPLUG_MAX_CPU_ISA": "avx2",
        "GLOWPLUG_NATIVE_BACKGROUND_BUILD": "0",
    }
    got = _load_in_child(env)
    assert got["available"] and got["level"] == "portable" and got["reason"] == "prebuilt" and got["hit"]
    assert got["why"] == "portable: the best variant stored (avx2 is not built yet)"
    assert got["background"] == "avx2 not built: GLOWPLUG_NATIVE_BACKGROUND_BUILD=0"
    # Without a compiler and without any variant: unavailable, and the reason says how to get one.
    env = {**env, "GLOWPLUG_NATIVE_PREBUILT": str(tmp_path / "none"), "CXX": "/nonexistent/c++", "PATH": "/nonexistent"}
    got = _load_in_child(env)
    assert not got["available"] and "no prebuilt variant (`glowplug kernels build`" in str(got["reason"])


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler to build")
def test_the_background_build_process_stores_a_variant_the_next_start_finds(tmp_path: Path) -> None:
    """What a start runs detached when its level is not built (kernels/native.py `_build_in_background`): the
    kernels' own entry point, in a process of its own; the variant it stores is then found, not built again."""
    from glowplug.kernels.native import build_variant

    cmd = [sys.executable, "-m", "glowplug.kernels.native_build", "portable", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, built = build_variant(tmp_path, "portable")
    assert path.is_file() and not built
    bad = subprocess.run([*cmd[:3], "sse9", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "LEVEL: one of portable" in bad.stderr


@pytest.mark.slow  # one compile per level this machine runs (prebuilt at install: then none) and the op tests
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_every_op_at_every_level_matches_its_reference(level: str, tmp_path: Path) -> None:
    """The kernel tests (every native op against kernels/reference.py and the torch attention, over shapes with
    tails) run again in a process capped at `level`, which must load that level's variant."""
    if level not in _runnable_levels():
        pytest.skip(f"this CPU runs up to {cpu_isa_level()}, not {level}")
    env = {
        **os.environ,
        "GLOWPLUG_MAX_CPU_ISA": level,
        "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache"),
        "GLOWPLUG_EXPECT_ISA_LEVEL": level,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-1500:]


@pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-g++") is None, reason="no aarch64 cross compiler (Debian's g++-aarch64-linux-gnu)"
)
def test_the_portable_variant_compiles_for_aarch64(tmp_path: Path) -> None:
    from glowplug.kernels.native import compile_command

    cmd = compile_command("aarch64-linux-gnu-g++", tmp_path / "glowplug_native.so", "portable")
    # Syntax and templates only: linking would need an aarch64 torch.
    cut = cmd.index("-o")
    proc = subprocess.run([*cmd[:cut], "-fsyntax-only"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


_GENERATE = """
import json, sys
from glowplug.engine.config import EngineConfig
from glowplug.engine.llm import LLM
from glowplug.engine.sampling_params import SamplingParams
llm = LLM(config=EngineConfig.from_flat(model=sys.argv[1], dtype="float32", compile="on", max_model_len=128,
                                         max_num_seqs=4))
outs = llm.generate(["The capital of France is", "1 2 3 4"], SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True))
row = next(r for r in llm.startup.phase_table.rows if r.name == "native_kernels")
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "attributes": dict(row.attributes),
                  "notes": list(row.notes)}, default=str))
"""


@pytest.mark.slow  # two engine starts (the second reuses the first's compiled step)
def test_a_capped_start_runs_the_capped_variant_with_the_same_tokens(tiny_dir, tmp_path: Path) -> None:
    top_level = cpu_isa_level()
    if top_level == "portable":
        pytest.skip("this CPU's level is the portable one: nothing to cap")
    cap = ISA_LEVELS[ISA_LEVELS.index(top_level) - 1]  # the level just below this CPU's
    model = tiny_dir("llama")
    base = {**os.environ, "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")}
    base.pop("GLOWPLUG_MAX_CPU_ISA", None)
    runs = {}
    for level in ("", cap):
        env = {**base, "GLOWPLUG_MAX_CPU_ISA": level} if level else base
        proc = subprocess.run(
            [sys.executable, "-c", _GENERATE, str(model)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[level] = json.loads(proc.stdout.strip().splitlines()[-1])
    top, capped = runs[""], runs[cap]
    assert top["attributes"]["glowplug.isa_level"] == top_level
    assert capped["attributes"]["glowplug.isa_level"] == cap
    assert f"capped by GLOWPLUG_MAX_CPU_ISA={cap}" in capped["attributes"]["glowplug.isa_reason"]
    assert any(f"ISA {cap}: capped by GLOWPLUG_MAX_CPU_ISA={cap}" in n for n in capped["notes"]), capped["notes"]
    assert capped["tokens"] == top["tokens"]


def test_dtype_auto_follows_the_level(monkeypatch: pytest.MonkeyPatch, tiny_dir) -> None:
    """--dtype auto on a CPU: bf16 with hardware bf16, and at the avx2/avx512 levels when the decode step is
    compiled (the native kernels read bf16 weights and multiply in fp32); float32 at the portable level, with the
    step eager, or for a float32 checkpoint."""
    from glowplug.engine.config_check import resolve_dtype_name
    from glowplug.engine.models.arch import load_arch

    arch = load_arch(tiny_dir("llama"))
    bf16_arch, fp32_arch = (
        arch.model_copy(update={"torch_dtype": "bfloat16"}),
        arch.model_copy(update={"torch_dtype": "float32"}),
    )
    top = cpu_isa_level()
    for cap, compiled, want in [("avx2", True, "bfloat16"), ("avx2", False, "float32"), ("portable", True, "float32")]:
        if not level_at_least(top, cap):
            continue
        monkeypatch.setenv("GLOWPLUG_MAX_CPU_ISA", cap)
        assert resolve_dtype_name("auto", bf16_arch, "cpu", compiled=compiled) == want, (cap, compiled)
        assert resolve_dtype_name("auto", fp32_arch, "cpu", compiled=compiled) == "float32"
    if level_at_least(top, "avx512_bf16"):
        monkeypatch.delenv("GLOWPLUG_MAX_CPU_ISA")
        assert resolve_dtype_name("auto", bf16_arch, "cpu", compiled=False) == "bfloat16"
