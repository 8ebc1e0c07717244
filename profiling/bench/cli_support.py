"""What the benchmark commands share: the engine fields every benchmark config carries, their translation to
EngineConfig fields (in-process benchmarks) or to `glowplug startup` flags (subprocess benchmarks), and the
argparse wiring that turns a config model into a sub-command.

Each benchmark module exposes `register(subparsers, add_model_flags)`; the flags come from the pydantic config via
`glowplug.flags.add_model_flags`, so the config model stays the one schema (flags, JSON reports, tests).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from glowplug.base.errors import require_extra
from glowplug.base.flags import add_model_argument, resolve_model_argument
from glowplug.base.units import ByteSize
from glowplug.engine.config import CompileMode, DType

C = TypeVar("C", bound=BaseModel)
AddModelFlags = Callable[..., list[str]]
Runner = Callable[[Any, list[str] | None], int]


class BenchEngineFields(BaseModel):
    """Engine settings a benchmark passes through to every engine it builds (flat EngineConfig names)."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = Field("smollm2", description="'smollm2' (embedded default) or a local HF folder.")
    dtype: DType = "auto"
    compile: CompileMode = "auto"
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV-cache block.")
    kv_cache_memory: ByteSize | None = Field(
        None,
        ge=1,
        description="KV-cache budget, e.g. 2GiB or 512MiB (plain numbers are bytes); unset = the engine's own sizing.",
    )
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="Force the number of KV blocks.")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget of one engine step; unset = the benchmark's choice (see its doc)."
    )
    seed: int = Field(0, ge=0, description="Engine seed (sampled runs are reproducible).")

    def engine_fields(self, **overrides: Any) -> dict[str, Any]:
        """Flat EngineConfig fields; unset optional knobs are left to the engine's defaults."""
        names = (
            "model",
            "dtype",
            "compile",
            "block_size",
            "kv_cache_memory",
            "num_gpu_blocks_override",
            "max_num_batched_tokens",
            "seed",
        )
        fields = {n: getattr(self, n) for n in names}
        fields.update(overrides)
        return {k: v for k, v in fields.items() if v is not None}

    def startup_argv(self, **overrides: Any) -> list[str]:
        """`glowplug startup MODEL --flag value ...` arguments (after `startup`) for the same settings."""
        fields = self.engine_fields(**overrides)
        argv = [str(fields.pop("model"))]
        for name, value in fields.items():
            argv += engine_flag(name, value)
        return argv


def engine_flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, (tuple, list)):
        return [flag, ",".join(str(v) for v in value)]  # a list flag takes one value per use
    return [flag, str(value)]


def quantization_label(quant: str) -> str:
    return "No Quantization" if quant == "none" else f"Quantization: {quant}"


def check_path(v: Path | None, ok: Callable[[Path], object], problem: str) -> Path | None:
    """A path flag's check, for its config's validator: `v` as given when absent or `ok(v)` holds, else ValueError
    with `problem` ({v}: the path). A wrong path is then a one-line error when the flags are read, not a traceback
    after the imports or the runs."""
    if v is not None and not ok(v):
        raise ValueError(problem.format(v=v))
    return v


def write_json(path: Path, data: Mapping[str, Any] | list[Any]) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def prepare_out_dir(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


# ---------------------------------------------------------------- argparse wiring


def config_from_args(model_cls: type[C], args: argparse.Namespace) -> C:
    return model_cls(**{k: v for k, v in vars(args).items() if k in model_cls.model_fields})


def add_command(
    subparsers: Any,
    name: str,
    *,
    help_text: str,
    description: str | None,
    config_cls: type[BaseModel],
    add_model_flags: AddModelFlags,
    runner: Runner,
) -> argparse.ArgumentParser:
    """A sub-command MODEL [flags from `config_cls`] whose handler builds the config and calls `runner`."""
    p = subparsers.add_parser(
        name, help=help_text, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_argument(p)
    add_model_flags(p, config_cls, exclude={"model"})

    def handler(args: argparse.Namespace) -> int:
        resolve_model_argument(args)
        cfg = config_from_args(config_cls, args)
        if getattr(cfg, "plots", False):  # said before any work, not once the measurements are done
            require_extra(("matplotlib",), "the report's charts (--no-plots leaves them out)", "bench")
        return runner(cfg, getattr(args, "argv", None))

    p.set_defaults(func=handler)
    return p
