"""The sampling defaults of a model: what `glowplug generate` and the HTTP API use for every sampling field a
request leaves out, so that the two never sample differently by default.

Where they come from, first match wins:
  a Hugging Face folder   its generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), read
                          with Hugging Face's meaning: `do_sample: false` means greedy whatever the temperature says,
                          and a config that samples without naming a temperature samples at 1.0
  a GGUF file (or the     its `general.sampling.*` metadata (temp, top_p, top_k, min_p, penalty_repeat), the keys
  folder prepared from    llama.cpp writes; the prepared folder holds no generation config of its own, so its GGUF
  one, like smollm2)      is read (the header only, in milliseconds)
  neither                 glowplug's one documented default: greedy (temperature 0). A small model sampled at 1.0
                          rambles, and greedy output is reproducible: the same prompt gives the same text from the
                          CLI, the server and the offline API.
A request's own fields always win. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .sampling_params import SamplingParams

# glowplug's default where the model says nothing: greedy.
GLOWPLUG_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.0}
GLOWPLUG_DEFAULT_SOURCE = "glowplug default (greedy)"
_HF_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_GGUF_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """SamplingParams fields to use when a request does not set them, and where they were read."""

    values: dict[str, Any] = field(default_factory=lambda: dict(GLOWPLUG_SAMPLING_DEFAULTS))
    source: str = GLOWPLUG_DEFAULT_SOURCE

    def apply(self, given: dict[str, Any]) -> dict[str, Any]:
        """The request's fields over these defaults."""
        return {**self.values, **given}

    def describe(self) -> str:
        """`temperature 0 (greedy), from glowplug default (greedy)`: one phrase for a log line or the CLI."""
        parts = [
            f"{k.replace('_', ' ')} {v:g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
            for k, v in self.values.items()
        ]
        greedy = " (greedy)" if float(self.values.get("temperature", 1.0)) == 0.0 else ""
        return f"{', '.join(parts)}{greedy}, from {self.source}"

    def to_dict(self) -> dict[str, Any]:
        """For /v1/models: the values and their source."""
        return {**self.values, "source": self.source}


def _checked(values: dict[str, Any], source: str) -> SamplingDefaults:
    """The model's values, when SamplingParams accepts them; a config out of range falls back to glowplug's."""
    merged = {**GLOWPLUG_SAMPLING_DEFAULTS, **values}
    try:
        SamplingParams(**merged)
    except ValidationError as exc:
        bad = ", ".join(str(e["loc"][0]) for e in exc.errors())
        return SamplingDefaults(source=f"{GLOWPLUG_DEFAULT_SOURCE}; {source} has values out of range ({bad})")
    return SamplingDefaults(merged, source)


def from_generation_config(path: Path) -> SamplingDefaults | None:
    """A Hugging Face generation_config.json's sampling fields, with its do_sample meaning (see module doc)."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    values = {k: cfg[k] for k in _HF_FIELDS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}
    do_sample = cfg.get("do_sample")
    if do_sample is False:
        values["temperature"] = 0.0  # Hugging Face decodes greedily when do_sample is off
    elif do_sample is True:
        values.setdefault("temperature", 1.0)  # ... and samples at 1.0 when it is on and names no temperature
    if not values:
        return None
    return _checked({k: float(v) if k != "top_k" else int(v) for k, v in values.items()}, str(path))


def from_gguf(path: Path) -> SamplingDefaults | None:
    """A GGUF's `general.sampling.*` metadata (llama.cpp's names), or None when the file has none."""
    from .models.gguf_header import read_gguf_metadata

    meta = read_gguf_metadata(path)
    values = {name: meta[key] for key, name in _GGUF_FIELDS.items() if isinstance(meta.get(key), (int, float))}
    if not values:
        return None
    return _checked({k: float(v) if k != "top_k" else int(v) for k, v in values.items()}, f"{path} metadata")


def sampling_defaults(model: str) -> SamplingDefaults:
    """The defaults for model spec `model` ('smollm2', a .gguf file, a folder); glowplug's when it has none."""
    from .models.arch import ModelError
    from .models.store import DEFAULT_ALIASES, default_gguf_path, gguf_file_for

    try:
        path = default_gguf_path() if model in DEFAULT_ALIASES else Path(model).expanduser()
        found: SamplingDefaults | None = None
        if path.is_file() and path.suffix == ".gguf":
            found = from_gguf(path)
        elif path.is_dir():
            found = from_generation_config(path / GENERATION_CONFIG) if (path / GENERATION_CONFIG).is_file() else None
            if found is None:
                gguf = gguf_file_for(path)  # a folder glowplug prepared from a GGUF holds no generation config
                found = from_gguf(gguf) if gguf is not None else None
    except ModelError:
        found = None  # the start-up reports a missing or broken model, with its fix; defaults are not the place
    if found is not None:
        return found
    return SamplingDefaults(source=f"{GLOWPLUG_DEFAULT_SOURCE}: the model has no generation config")
