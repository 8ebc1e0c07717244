"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain PyTorch.

Module and parameter names mirror Hugging Face's, so a checkpoint's state dict loads with no renaming and the
quantizers can find linear layers by their usual names. The forward pass takes a flattened batch of tokens and an
`AttentionMetadata` describing which sequence each token belongs to, as paged-attention engines do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention
from .arch import ModelArch, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference implementation does; the order
        # matters for bf16/fp16 parity.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, max_pos: int) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends the band in between.
        old_len = scaling.original_max_position_embeddings or max_pos
        low_wl = old_len / scaling.low_freq_factor
        high_wl = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / scaling.factor, inv)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, blended, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, built once the model leaves the meta device."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, max_positions: int, device: torch.device | str) -> None:
        a = self.arch
        inv = rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, shaped to broadcast over heads; looked up once per forward."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; the rotate-half convention of HF checkpoints.
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        h, d = arch.hidden_size, arch.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, *rope), RotaryEmbedding.apply(k, *rope)
        o = paged_attention(q, k, v, self.layer, meta, self.scale)
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, i = arch.hidden_size, arch.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, meta)
        return self.norm(x)


class DecoderLM(nn.Module):
    """input_ids [T] + positions [T] + metadata -> hidden states [T, hidden]; `compute_logits` on chosen rows."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = Backbone(arch)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.state_dict().items()}
