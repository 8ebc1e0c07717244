"""Parse a Hugging Face `config.json` into the one architecture description our decoder understands.

Llama, Mistral, Qwen2 and Qwen3 differ only in a few switches (qkv bias, q/k norms, sliding window), so they share
one decoder and this module turns each `model_type` into those switches. Gemma 3 (`gemma3_text`, the text model of
the family) adds a few more: RMSNorm scaling by (1 + w), norms after attention and after the MLP as well as before,
embeddings scaled by sqrt(hidden), GELU (tanh) in the MLP, a query scale of its own, and layers that alternate
between a sliding window (with a local RoPE base) and full attention.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# Gemma 3's defaults where a config (or a GGUF, which stores neither) leaves them out: transformers'
# Gemma3TextConfig.
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer attends to everything, the others to a sliding window
GEMMA3_ROPE_LOCAL_THETA = 10_000.0

LayerType = Literal["full_attention", "sliding_attention"]


class ModelError(ValueError):
    """A problem with a model folder or checkpoint; the message names the file and the fix."""


def model_file(model_dir: Path, name: str, fix: str) -> Path:
    """`model_dir / name`, which the model needs: ModelError saying it is missing, and `fix`, when it is not a file."""
    path = model_dir / name
    if not path.is_file():
        raise ModelError(f"{path}: {name} is missing. {fix}")
    return path


class RopeScaling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


class ModelArch(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # "gemma3" is the text model of Gemma 3 (Hugging Face calls it gemma3_text).
    model_type: Literal["llama", "mistral", "qwen2", "qwen3", "gemma3"]
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
    hidden_act: Literal["silu", "gelu_pytorch_tanh"] = "silu"
    # Per-layer attention kind, only for families whose attention path applies `sliding_window` per layer (Gemma 3).
    # None with a `sliding_window` (Mistral, Qwen) means one window for every layer, which the attention path does
    # not apply: the context is capped at the window instead (kv_sizing.model_len_limit), where it changes nothing.
    layer_types: tuple[LayerType, ...] | None = None
    # RoPE base of the sliding-window layers when it differs from `rope_theta` (Gemma 3's local layers).
    rope_local_theta: float | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 when set.
    query_pre_attn_scalar: float | None = None

    @property
    def gemma_norms(self) -> bool:
        """Gemma's layer shape: RMSNorm scales by (1 + w) in fp32, each sublayer's output is normed again before the
        residual add (four norms per layer), and the embeddings are scaled by sqrt(hidden)."""
        return self.model_type == "gemma3"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window (in keys, the query's own included) that the attention path applies at `layer`, or
        None for full causal attention."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def num_params(self) -> int:
        h, i, L, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        norms = (4 if self.gemma_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + norms
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + L * per_layer + h + head

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size

    def projection_shapes(self, lm_head: bool = True) -> list[tuple[int, int]]:
        """(N, K) of every distinct projection the quantizer converts: the fused q/k/v, o, the fused gate/up, down,
        and with `lm_head` the LM head. The kernel dispatcher is calibrated on exactly these."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
        if lm_head:
            shapes.append((self.vocab_size, self.hidden_size))
        return list(dict.fromkeys(shapes))


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelError(f"{path}: rope type {rope_type!r} is not supported; supported: default, linear, llama3")
    merged["rope_type"] = rope_type
    return theta, RopeScaling.model_validate(merged)


def _gemma3_fields(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a gemma3_text config.json, read as transformers' Gemma3TextConfig reads them (its
    defaults where a field is missing). What glowplug does not run is refused rather than ignored."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ModelError(
                f"{path}: {key} = {cfg[key]} is set; glowplug's Gemma 3 has no soft-capping (Gemma 3 "
                f"checkpoints leave it null)"
            )
    if cfg.get("use_bidirectional_attention"):
        raise ModelError(
            f"{path}: use_bidirectional_attention is set (an embedding model); glowplug runs causal "
            f"language models only"
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelError(f"{path}: hidden_activation {act!r} is not supported for gemma3_text (gelu_pytorch_tanh is)")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ModelError(
            f"{path}: layer_types must name full_attention or sliding_attention for each of the "
            f"{layers} layers (got {types})"
        )
    # transformers >= 5 nests the RoPE parameters per layer type; older configs give rope_theta and
    # rope_local_base_freq (and a rope_scaling that applies to the full-attention layers only).
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {}) if "full_attention" in params else {}
    local = dict(params.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ModelError(f"{path}: RoPE type {local['rope_type']!r} on the sliding-window layers is not supported")
    theta_cfg = {**cfg, "rope_parameters": full or None}
    theta, scaling = _rope(theta_cfg, path)
    if "rope_theta" not in full and "rope_theta" not in cfg:
        theta = 1_000_000.0  # Gemma3TextConfig's default for the full-attention layers
    return {
        "hidden_act": act,
        "layer_types": tuple(types),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_ROPE_LOCAL_THETA))),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "sliding_window": int(cfg.get("sliding_window") or 4096),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "qk_norm": True,
    }


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
        gemma = _gemma3_fields(cfg, path) if model_type == "gemma3_text" else {}
        theta, scaling = (gemma["rope_theta"], gemma["rope_scaling"]) if gemma else _rope(cfg, path)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window") if model_type == "mistral" else None
        if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            sliding = cfg.get("sliding_window")
        fields: dict[str, Any] = dict(
            model_type="gemma3" if gemma else model_type,
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
        return ModelArch(**{**fields, **gemma})
    except KeyError as exc:
        raise ModelError(f"{path}: config.json lacks the required field {exc.args[0]!r}") from exc
    except (ValidationError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelError):
            raise
        raise ModelError(f"{path}: config.json has an invalid value: {exc}") from exc


def load_arch(model_dir: Path) -> ModelArch:
    path = model_file(
        model_dir,
        "config.json",
        "A model folder needs config.json, *.safetensors and tokenizer files; re-export it with save_pretrained() "
        "or pass the right folder.",
    )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: config.json is not valid JSON ({exc}); re-export the model") from exc
    return parse_hf_config(cfg, path)
