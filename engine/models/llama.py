"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and Gemma 3's text model) in plain PyTorch.

Gemma 3 runs the same code with the switches ModelArch derives for it (see arch.py): (1 + w) norms and four of them
per layer (`gemma_norms`), GELU (tanh) in the MLP, its query scale, and per-layer sliding windows with their own
RoPE base (`layer_window`, `rope_local_theta`).

Two forward paths share the modules:
- `forward(input_ids, positions, meta)`: any batch (prefill chunks and decodes mixed), eager, over `AttentionMetadata`.
- `decode(packed, caches)`: a decode-only batch as one traceable function of one int64 input tensor (see
  engine/attention.py), which engine/compile.py compiles. Each layer's body is a nested compile region, so Inductor
  compiles one layer and stamps it out for the others.

The projections are fused at load time: q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (one weight read and one
kernel call each instead of three and two). Checkpoints keep Hugging Face's names; `checkpoint_shapes` lists what a
checkpoint must hold and `engine/models/loader.py` fuses on load. The quantizers see the fused names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from glowplug.engine.attention import AttentionMetadata, decode_attention, paged_attention
from glowplug.engine.kv_cache import LayerKV
from glowplug.engine.parallel import SINGLE, TPShard, all_reduce_sum, gather_vocab
from glowplug.kernels.modules import DenseLinear, NativeSwitch, enable_dense_native

from .arch import ModelArch, RopeScaling

# fused module (suffix within a layer) -> the checkpoint modules it concatenates, in row order
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fused_rows(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Rows each part contributes to its fused module."""
    q, kv, i = (
        arch.num_attention_heads * arch.head_dim,
        arch.num_key_value_heads * arch.head_dim,
        arch.intermediate_size,
    )
    return {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (i, i)}


class RMSNorm(nn.Module):
    """`offset`: Gemma's form, x * (1 + w) with w as its checkpoints store it (zero-centred), all in fp32 and cast
    once at the end; otherwise Llama's, cast back before multiplying by w. Each follows its reference's order,
    which matters for bf16/fp16 parity."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(dtype)
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
    """cos/sin tables for every position, built once the model leaves the meta device and indexed by position.
    `theta`/`scaling` default to the model's; Gemma 3's sliding-window layers get a second table with their local
    base and no scaling."""

    def __init__(self, arch: ModelArch, theta: float | None = None, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.theta = arch.rope_theta if theta is None else theta
        self.scaling = arch.rope_scaling if scaling is None else scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, max_positions: int, device: torch.device | str) -> None:
        a = self.arch
        inv = rope_inv_freq(a.head_dim, self.theta, self.scaling, a.max_position_embeddings).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, shaped to broadcast over heads; looked up once per forward."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # x: [T, heads, D]; the rotate-half convention of HF checkpoints.
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    """`arch` is the rank's own (TPShard.local_arch: its heads); `reduce`: o_proj is row-parallel, so its partial
    outputs are summed across the ranks."""

    def __init__(self, arch: ModelArch, layer: int, reduce: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.reduce = reduce
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        h, d = arch.hidden_size, arch.head_dim
        self.qkv_proj = DenseLinear(h, (self.num_heads + 2 * self.num_kv_heads) * d, bias=arch.qkv_bias)
        self.o_proj = DenseLinear(self.num_heads * d, h, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps, offset=arch.gemma_norms)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps, offset=arch.gemma_norms)
        self.scale = (arch.query_pre_attn_scalar or d) ** -0.5
        # This layer's sliding window (None: full attention); a plain int, so the compiled step specialises on it.
        self.window = arch.layer_window(layer)
        # The compiled decode step's attention through the native op (set by `enable_native`).
        self.native_attention = False

    def enable_native(self, small_m: int, activation_dtype: torch.dtype) -> NativeSwitch:
        """kernels.modules.enable_native_decode's switch: decode attention through the native op where the CPU and
        this head_dim allow it (batch size and dtype do not matter to it). A sliding-window layer switches too: the
        op takes the window and reads only the blocks inside it."""
        from glowplug.kernels.native import attention_supported

        self.native_attention = attention_supported(self.head_dim)
        return NativeSwitch("attention", self.native_attention)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k, v = (
            q.reshape(t, self.num_heads, d),
            k.reshape(t, self.num_kv_heads, d),
            v.reshape(t, self.num_kv_heads, d),
        )
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self._qkv(x, *rope)
        o = paged_attention(q, k, v, self.layer, meta, self.scale, self.window)
        y = self.o_proj(o.reshape(x.shape[0], -1))
        return all_reduce_sum(y) if self.reduce else y

    def decode(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKV, packed: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        o = decode_attention(q, k, v, cache, packed, self.scale, self.native_attention, self.window)
        y = self.o_proj(o.reshape(x.shape[0], -1))
        return all_reduce_sum(y) if self.reduce else y


class MLP(nn.Module):
    """`arch` is the rank's own (its part of the intermediate); `reduce`: down_proj is row-parallel."""

    def __init__(self, arch: ModelArch, reduce: bool = False) -> None:
        super().__init__()
        self.reduce = reduce
        h, i = arch.hidden_size, arch.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = DenseLinear(h, 2 * i, bias=arch.mlp_bias)
        self.down_proj = DenseLinear(i, h, bias=arch.mlp_bias)
        self.gelu = arch.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # One expression: the activation dies at the product, before down_proj runs (the peak the KV sizing counts).
        y = self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)
        return all_reduce_sum(y) if self.reduce else y


class DecoderLayer(nn.Module):
    """Llama's layer: x + attn(norm(x)), then + mlp(post_attention_layernorm(x)). Gemma's (`gemma_norms`) norms
    each sublayer's output too, with Hugging Face's names for its four norms: x + post_attention_layernorm(attn(
    input_layernorm(x))), then + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))."""

    def __init__(self, arch: ModelArch, layer: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        local = shard.local_arch(arch)
        self.self_attn = Attention(local, layer, reduce=shard.active)
        self.mlp = MLP(local, reduce=shard.active)
        gemma = arch.gemma_norms
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=gemma)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=gemma)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=True)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=True)
        self.gemma = gemma
        # Which RoPE table this layer takes: Gemma 3's sliding-window layers have a local base of their own.
        self.local_rope = self.self_attn.window is not None and arch.rope_local_theta is not None

    def _residual(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the layer once attention ran on input_layernorm(x)."""
        if self.gemma:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        # Spelled out rather than through _residual: the attention output must die at its addition, not live on
        # through the MLP as an argument would (one hidden state more at the peak the KV sizing counts on:
        # engine/activation_peak.py mirrors this order).
        if self.gemma:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    @torch.compiler.nested_compile_region
    def decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        packed: torch.Tensor,
    ) -> torch.Tensor:
        """One layer of the decode step. A nested compile region: traced and compiled once, reused by every layer
        (the cache tensors come in one by one so that the regions' inputs never alias)."""
        cache = LayerKV(k_cache, v_cache, k_scale, v_scale)
        return self._residual(x, self.self_attn.decode(self.input_layernorm(x), cos, sin, cache, packed))


class Backbone(nn.Module):
    """`shard`: under tensor parallelism the embedding holds this rank's rows of the vocabulary (engine/parallel.py)
    and each layer its heads and its part of the MLP."""

    def __init__(self, arch: ModelArch, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.shard = shard
        self.vocab_start, rows = shard.vocab_rows(arch.vocab_size)
        # Given its (uninitialized) weight, Embedding skips its random init: the checkpoint replaces it anyway, and
        # the first normal_ on a meta tensor imports torch's decompositions (~1 s) that an eager start never uses.
        self.embed_tokens = nn.Embedding(rows, arch.hidden_size, _weight=torch.empty(rows, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(arch, i, shard) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=arch.gemma_norms)
        self.rotary_emb = RotaryEmbedding(arch)
        if any(layer.local_rope for layer in self.layers):
            assert arch.rope_local_theta is not None
            self.rotary_emb_local = RotaryEmbedding(arch, arch.rope_local_theta, RopeScaling())
        # Gemma scales the embeddings by sqrt(hidden), a factor its reference first rounds to the weights' dtype
        # (a bf16 run multiplies by 25.25, not 25.298, for hidden 640): the rounded factor per dtype, as a Python
        # float so the multiply is one scalar op in eager and compiled code alike.
        self.embed_scales: dict[torch.dtype, float] = {}
        if arch.gemma_norms:
            root = torch.tensor(arch.hidden_size**0.5, dtype=torch.float32, device="cpu")
            self.embed_scales = {dt: float(root.to(dt)) for dt in (torch.float32, torch.bfloat16, torch.float16)}

    def build_rope(self, max_positions: int, device: torch.device | str) -> None:
        """Build the RoPE tables (every one the layers use) once the model is off the meta device."""
        self.rotary_emb.build(max_positions, device)
        if hasattr(self, "rotary_emb_local"):
            self.rotary_emb_local.build(max_positions, device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.active:
            # Vocab-parallel: this rank looks up the ids in its rows, zeros the others, and the sum across ranks
            # has every row exactly once (the others add zeros, so the sum is exact).
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
            x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
            x = all_reduce_sum(x)
        else:
            x = self.embed_tokens(input_ids)
        return x * self.embed_scales[x.dtype] if self.embed_scales else x

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin rows for `positions`, keyed by `DecoderLayer.local_rope`: looked up once per forward."""
        tables = {False: self.rotary_emb.tables(positions, dtype)}
        if hasattr(self, "rotary_emb_local"):
            tables[True] = self.rotary_emb_local.tables(positions, dtype)
        return tables

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        ropes = self.rope_tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, ropes[layer.local_rope], meta)  # type: ignore[index]
        return self.norm(x)


class TiedHead(nn.Module):
    """The output projection of a model whose head shares the embedding matrix. The embedding is referenced, not
    registered, so the state dict holds the matrix once (as `model.embed_tokens.weight`)."""

    _embedding: nn.Embedding

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)
        self.native_small_m: int | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The matrix this head multiplies by: the embedding's, shared."""
        return self._embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocked = self.native_blocked if "native_blocked" in self._buffers else None
        return DenseLinear.project(x, self.weight, None, self.native_small_m, blocked)  # type: ignore[arg-type]

    def enable_native(self, small_m: int, activation_dtype: torch.dtype) -> NativeSwitch:
        """kernels.modules.enable_native_decode's switch, for the shared matrix. In bf16 that is a blocked copy of
        the embedding (+57 MB for SmolLM2), because the row-major kernel streamed it slower than the blocked one in
        a side-by-side run of a step's GEMVs."""
        nbytes = enable_dense_native(self, self.weight, small_m)
        return NativeSwitch("dense", nbytes > 0, nbytes)


class DecoderLM(nn.Module):
    """input_ids [T] + positions [T] + metadata -> hidden states [T, hidden]; `compute_logits` on chosen rows."""

    def __init__(self, arch: ModelArch, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.arch = arch
        self.shard = shard
        self.model = Backbone(arch, shard)
        self.lm_head: nn.Module = (
            TiedHead(self.model.embed_tokens)
            if arch.tie_word_embeddings
            else DenseLinear(arch.hidden_size, self.head_rows, bias=False)
        )

    @property
    def head_rows(self) -> int:
        """Rows of the LM head this rank holds: the vocabulary, or its share of it under tensor parallelism."""
        return self.shard.vocab_rows(self.arch.vocab_size)[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as vLLM returns them: the sampler widens to fp32 only what its arithmetic
        needs (temperature, penalties, logprobs). A greedy row's argmax is the same either way (bf16 widens
        exactly), so a greedy batch no longer writes and re-reads an fp32 copy of its [B, vocab] logits. Under tensor
        parallelism each rank computes its vocabulary rows' logits and every rank gets them all."""
        logits = self.lm_head(hidden)
        return gather_vocab(logits, self.arch.vocab_size) if self.shard.active else logits

    def decode(self, packed: torch.Tensor, caches: list[LayerKV]) -> torch.Tensor:
        """Logits [B, vocab] (the model's dtype) for a decode-only batch given as the packed [B, DECODE_COLS + W]
        step input."""
        from glowplug.engine.attention import POSITION, TOKEN

        m = self.model
        x = m.embed(packed[:, TOKEN])
        ropes = m.rope_tables(packed[:, POSITION], x.dtype)
        for layer, c in zip(m.layers, caches):
            cos, sin = ropes[layer.local_rope]  # type: ignore[index]
            x = layer.decode(x, cos, sin, c.k, c.v, c.k_scale, c.v_scale, packed)  # type: ignore[operator]
        return self.compute_logits(m.norm(x))

    def untie_head_for_quantization(self) -> None:
        """Give a tied model a head of its own (on meta) so that the quantizer can convert it; the quantized head is
        then loaded from the quantized state dict, made from the embedding matrix."""
        if isinstance(self.lm_head, TiedHead):
            with torch.device("meta"):
                self.lm_head = DenseLinear(self.arch.hidden_size, self.head_rows, bias=False)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes a Hugging Face checkpoint of this model holds (unfused names)."""
        rows = fused_rows(self.shard.local_arch(self.arch))
        out: dict[str, tuple[int, ...]] = {}
        for name, t in self.state_dict().items():
            prefix, _, leaf = name.rpartition(".")
            fused = next((f for f in FUSED_MODULES if prefix.endswith("." + f)), None)
            if fused is None:
                out[name] = tuple(t.shape)
                continue
            base = prefix[: -len(fused)]
            for part, n in zip(FUSED_MODULES[fused], rows[fused]):
                out[f"{base}{part}.{leaf}"] = (n, *t.shape[1:])
        return out
