"""Parse a Hugging Face `config.json` into the one architecture description our decoder understands.

Llama, Mistral, Qwen2 and Qwen3 differ only in a few switches (qkv bias, q/k norms, sliding window), so they share
one decoder and this module turns each `model_type` into those switches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class ModelError(ValueError):
    """A problem with a model folder or checkpoint; the message names the file and the fix."""


class RopeScaling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


class ModelArch(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: Literal["llama", "mistral", "qwen2", "qwen3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @property
    def num_params(self) -> int:
        h, i, L, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + L * per_layer + h + head

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelError(
            f"{path}: rope type {rope_type!r} is not supported; supported: default, linear, llama3"
        )
    merged["rope_type"] = rope_type
    return theta, RopeScaling.model_validate(merged)


def parse_hf_config(cfg: dict[str, Any], path: Path) -> ModelArch:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{path}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Use a checkpoint of one of those families."
        )
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _rope(cfg, path)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window") if model_type == "mistral" else None
        if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            sliding = cfg.get("sliding_window")
        return ModelArch(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; the others say so with `attention_bias`.
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )
    except KeyError as exc:
        raise ModelError(f"{path}: config.json lacks the required field {exc.args[0]!r}") from exc
    except (ValidationError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelError):
            raise
        raise ModelError(f"{path}: config.json has an invalid value: {exc}") from exc


def load_arch(model_dir: Path) -> ModelArch:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelError(
            f"{path}: config.json is missing. A model folder needs config.json, *.safetensors and tokenizer "
            f"files; re-export it with save_pretrained() or pass the right folder."
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: config.json is not valid JSON ({exc}); re-export the model") from exc
    return parse_hf_config(cfg, path)
