"""Every model-loading failure names the file, the problem and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glowplug.engine.models.arch import ModelError, load_arch
from glowplug.engine.models.loader import load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _load(d: Path) -> None:
    arch = load_arch(d)
    load_model(d, arch, torch.float32, "cpu", 64)


def test_missing_tensor_is_named(tiny_dir, tmp_path: Path) -> None:
    d = _copy(tiny_dir("llama"), tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'") as e:
        _load(d)
    assert str(d) in str(e.value)


def test_shape_mismatch_gives_expected_and_actual(tiny_dir, tmp_path: Path) -> None:
    d = _copy(tiny_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"has shape \[128, 64\], expected \[96, 64\]"):
        _load(d)


def test_unsupported_model_type_lists_supported(tiny_dir, tmp_path: Path) -> None:
    d = _copy(tiny_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelError, match=r"'gpt2' is not supported; supported model types: llama, mistral, qwen2, qwen3"
    ):
        _load(d)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors_is_reported(tiny_dir, tmp_path: Path, damage: str) -> None:
    d = _copy(tiny_dir("llama"), tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(ModelError, match=r"truncated or corrupt") as e:
        _load(d)
    assert str(f) in str(e.value) and "re-download or re-export" in str(e.value)


def test_missing_config_json(tiny_dir, tmp_path: Path) -> None:
    d = _copy(tiny_dir("llama"), tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelError, match=r"config\.json is missing") as e:
        _load(d)
    assert str(d / "config.json") in str(e.value)


def test_unknown_model_spec_says_what_to_pass(tmp_path: Path) -> None:
    from glowplug.engine.models.store import resolve_model

    with pytest.raises(ModelError, match=r"not found: pass 'smollm2'"):
        resolve_model(str(tmp_path / "nope"))
