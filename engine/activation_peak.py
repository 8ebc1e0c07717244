"""The KV profile's activation peak from shapes, without running the forward.

`kv_cache_profiling` sizes the KV cache from the peak of one eager forward of `max_num_batched_tokens` tokens
with logits for `max_num_seqs` rows. Measured (profiling/memory.py `LiveTensorPeak`: the live bytes of the tensors
the forward's ops create), that forward costs seconds on a CPU (7.7 s of a 16.4 s cold start on the 2-core box,
beside the compile). The peak it measures is a function of shapes only: which tensors `engine/models/llama.py`
allocates, in which order, and when each dies. `activation_peak` replays that sequence on a ledger of byte counts,
step for step with the model's code (each block below names the lines it mirrors), and returns the ledger's peak:
the number the measured forward reports, with no forward. tests/test_activation_peak.py holds it to the measured
peak within 5% over the default model (bf16, fp32, a padded token count, a large logits batch, int8) and the tiny
test models of every family.

What the ledger counts is what `LiveTensorPeak` counts: op outputs that are new storage, until their last tensor
dies; not views, not in-place writes, not a kernel's internal scratch (SDPA's flash kernel keeps its score blocks
inside, so the [heads, T, T] matrix is never a tensor). Memory that outlives the forward but is first made in it
(the quantized layers' dequantization workspace, kernels/cpu.py `Workspace`) is counted from when it is made.

Covered: the CPU, the Llama-family model (llama.py is the only model class), dense layers in any dtype, the GGUF
layers computed on their stored blocks (kernels/gguf.py), and the weight-only quantized layers on the dispatcher
paths `dequant_bf16`, `int8pack` and `aten_int4`. Anything else
(CUDA, whose allocator the measured mode reads; w8a8, whose activation quantization allocates per row; another
kernel path) is not modelled: `analytic_unsupported` / `AnalyticPeakUnsupported` say why, and the stage measures.
A change to what the model allocates must be mirrored here; the 5% test is the check that it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from glowplug.base.machine import cpu_has_native_bf16
from glowplug.kernels.gguf import GGUFEmbedding, GGUFLinear
from glowplug.kernels.modules import FP32_PROMPT_ROWS, DenseLinear, QuantLinear, padded_rows

from .config import EngineConfig
from .models.llama import Attention, DecoderLM, TiedHead

FP32 = 4
BF16 = 2
# The dispatcher paths whose allocations `_quant_linear` mirrors (kernels/cpu.py run_dequant, run_int8pack,
# run_aten_int4).
MODELLED_PATHS = frozenset({"dequant_bf16", "int8pack", "aten_int4"})


class AnalyticPeakUnsupported(ValueError):
    """The model holds a layer or takes a kernel path the ledger does not mirror; the message says which."""


def analytic_unsupported(config: EngineConfig) -> str | None:
    """Why the analytic peak does not serve `config` (then the forward is measured), or None when it does. What
    only the built model can tell (a kernel path) raises AnalyticPeakUnsupported from `activation_peak`."""
    if config.resolved_device() != "cpu":
        return "not the CPU: the device's allocator peak is measured, as vLLM does"
    if config.quant.quantization == "w8a8":
        return "w8a8's per-row activation quantization is not modelled"
    return None


@dataclass
class _Ledger:
    """Live bytes and their peak, as `LiveTensorPeak` keeps them; each `new` is one op output, each `free` the
    death of its last tensor."""

    live: int = 0
    peak: int = 0
    workspace: dict[int, int] = field(default_factory=dict)  # bytes per element -> the dequant buffer's bytes

    def new(self, nbytes: int) -> int:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return nbytes

    def free(self, *sizes: int) -> None:
        self.live -= sum(sizes)

    def grow_workspace(self, itemsize: int, nbytes: int) -> None:
        """kernels/cpu.py Workspace.get: a larger request allocates a new buffer, then the old one is dropped."""
        held = self.workspace.get(itemsize, 0)
        if nbytes > held:
            self.new(nbytes)
            self.free(held)
            self.workspace[itemsize] = nbytes


@dataclass(frozen=True)
class _Shapes:
    tokens: int
    itemsize: int  # the model dtype's bytes per element
    native_bf16: bool
    dtype: torch.dtype


def _dense_linear(led: _Ledger, s: _Shapes, m: int, k: int, n: int, bias: bool) -> int:
    """kernels/modules.py DenseLinear.project outside a graph: returns the bytes of the output's storage, which
    the caller frees (a padded GEMM's [:m] slice keeps the whole padded output alive)."""
    if s.dtype == torch.bfloat16 and m >= FP32_PROMPT_ROWS and not s.native_bf16:
        # F.linear(x.float(), weight.float(), bias.float()).to(bf16)
        x32, w32 = led.new(m * k * FP32), led.new(n * k * FP32)
        b32 = led.new(n * FP32) if bias else 0
        y32 = led.new(m * n * FP32)
        led.free(x32, w32, b32)
        y = led.new(m * n * BF16)
        led.free(y32)
        return y
    if s.itemsize != FP32:
        rows = padded_rows(m)
        if rows != m:  # F.linear(F.pad(x, ...), weight, bias)[:m]
            pad = led.new(rows * k * s.itemsize)
            y = led.new(rows * n * s.itemsize)
            led.free(pad)
            return y
    return led.new(m * n * s.itemsize)


def _quant_linear(led: _Ledger, s: _Shapes, layer: QuantLinear, m: int) -> int:
    """kernels/modules.py QuantLinear.forward outside a graph, through the path its dispatcher picks for m rows
    (kernels/cpu.py run_*), then `_finish` (cast to the model dtype, bias)."""
    weight = layer.packed()
    path = layer.dispatcher.plan(weight, m)
    if path not in MODELLED_PATHS:
        raise AnalyticPeakUnsupported(
            f"{type(layer).__name__} {layer.out_features}x{layer.in_features} takes the "
            f"{path!r} kernel path at {m} rows, which is not modelled"
        )
    n, k = layer.out_features, layer.in_features
    xb = led.new(m * k * BF16) if s.dtype != torch.bfloat16 else 0  # x.to(bf16)
    out_dtype = torch.bfloat16
    if path == "dequant_bf16":
        led.grow_workspace(BF16, n * k * BF16)  # dequantize_bf16's [N, K] weight
        if getattr(layer, "bits", 8) < 8:
            led.grow_workspace(1, n * k)  # its uint8 code planes [8 // bits, N, K * bits // 8]
        y = led.new(m * n * BF16)  # F.linear(xb, w); a per-channel scale is applied in place
        zeros = getattr(layer, "zeros", None)
        if zeros is not None:
            # torch.addmm(y.float(), xb.float().view(m, g, -1).sum(-1), zeros.t())
            xf = led.new(m * k * FP32)
            xsum = led.new(m * zeros.shape[1] * FP32)
            led.free(xf)
            yf = led.new(m * n * FP32)
            summed = led.new(m * n * FP32)
            led.free(yf, y, xsum)
            y, out_dtype = summed, torch.float32
    elif path == "int8pack":
        k_pad = -k % 16  # prepare_int8pack pads K to a multiple of 16, and run_int8pack pads x to match
        pad = led.new(m * (k + k_pad) * BF16) if k_pad else 0
        y = led.new(m * n * BF16)  # torch._weight_int8pack_mm
        led.free(pad)
    else:  # aten_int4: the kernel's rows are padded to 16; int8 weights run as two int4 halves, summed
        halves = weight.kind in ("int8_channel", "int8_group")
        rows = 2 * n if halves else n
        y = led.new(m * (rows + -rows % 16) * BF16)
        if halves:
            whole = y
            y = led.new(m * n * BF16)  # out[:, :n] + out[:, n:2n]
            led.free(whole)
    led.free(xb)
    return _cast_and_bias(led, s, y, m * n, cast=out_dtype != s.dtype, bias=layer.bias is not None)  # _finish


def _gguf_linear(led: _Ledger, s: _Shapes, layer: GGUFLinear, m: int) -> int:
    """kernels/gguf.py GGUFLinear.forward: the native op's output (its activation scratch is no tensor), in x's
    dtype (fp32 for a dtype the op does not take, then cast back), then the bias."""
    n, k = layer.out_features, layer.in_features
    takes = s.dtype in (torch.bfloat16, torch.float32)
    xf = 0 if takes else led.new(m * k * FP32)  # x2.float()
    y = led.new(m * n * (s.itemsize if takes else FP32))
    led.free(xf)
    return _cast_and_bias(led, s, y, m * n, cast=not takes, bias=layer.bias is not None)


def _cast_and_bias(led: _Ledger, s: _Shapes, y: int, numel: int, *, cast: bool, bias: bool) -> int:
    """The quantized linears' last steps: y.to(x.dtype) when the op returned another dtype, then the bias add; each
    a new tensor of `numel` elements in x's dtype that replaces y."""
    for step in (cast, bias):
        if step:
            out = led.new(numel * s.itemsize)
            led.free(y)
            y = out
    return y


def _linear(led: _Ledger, s: _Shapes, layer: nn.Module, m: int) -> int:
    if isinstance(layer, GGUFLinear):
        return _gguf_linear(led, s, layer, m)
    if isinstance(layer, QuantLinear):
        return _quant_linear(led, s, layer, m)
    if isinstance(layer, TiedHead):
        n, k = layer.weight.shape
        return _dense_linear(led, s, m, k, n, bias=False)
    if isinstance(layer, DenseLinear):
        return _dense_linear(led, s, m, layer.in_features, layer.out_features, bias=layer.bias is not None)
    raise AnalyticPeakUnsupported(f"a {type(layer).__name__} layer is not modelled")


def _rms_norm(led: _Ledger, s: _Shapes, numel: int, rows: int) -> int:
    """llama.py RMSNorm.forward on `numel` elements in `rows` rows: returns the output's bytes."""
    xf = led.new(numel * FP32) if s.dtype != torch.float32 else 0  # x.float(), a no-op on fp32
    squares = led.new(numel * FP32)  # xf.pow(2)
    mean = led.new(rows * FP32)
    led.free(squares)
    eps = led.new(rows * FP32)
    led.free(mean)
    inv = led.new(rows * FP32)  # torch.rsqrt
    led.free(eps)
    scaled = led.new(numel * FP32)  # xf * inv
    led.free(inv, xf)
    if s.dtype != torch.float32:
        cast = led.new(numel * s.itemsize)  # xf.to(dtype)
        out = led.new(numel * s.itemsize)  # weight * ...
        led.free(cast)
    else:
        out = led.new(numel * FP32)
    led.free(scaled)
    return out


def _rotary(led: _Ledger, s: _Shapes, heads: int, head_dim: int) -> int:
    """llama.py RotaryEmbedding.apply on [T, heads, D]: returns the output's bytes."""
    numel = s.tokens * heads * head_dim
    neg = led.new(numel // 2 * s.itemsize)  # -x[..., half:]
    rotated = led.new(numel * s.itemsize)  # torch.cat
    led.free(neg)
    a, b = led.new(numel * s.itemsize), led.new(numel * s.itemsize)  # x * cos, rotated * sin
    out = led.new(numel * s.itemsize)
    led.free(a, b, rotated)
    return out


def _attention(led: _Ledger, s: _Shapes, attn: Attention) -> int:
    """llama.py Attention.forward over a cache-less causal prefill (engine/attention.py paged_attention)."""
    t, d = s.tokens, attn.head_dim
    qkv = _linear(led, s, attn.qkv_proj, t)  # v stays a view of it until the end
    normed: list[int] = []
    if hasattr(attn, "q_norm"):  # q, k = self.q_norm(q), self.k_norm(k)
        normed = [
            _rms_norm(led, s, t * attn.num_heads * d, t * attn.num_heads),
            _rms_norm(led, s, t * attn.num_kv_heads * d, t * attn.num_kv_heads),
        ]
    q = _rotary(led, s, attn.num_heads, d)
    k = _rotary(led, s, attn.num_kv_heads, d)
    led.free(*normed)  # _qkv returns
    out = led.new(t * attn.num_heads * d * s.itemsize)  # torch.empty_like(q)
    # SDPA's flash kernel on the CPU: the output [1, H, T, D] and its logsumexp [1, H, T] in fp32.
    o, lse = led.new(t * attn.num_heads * d * s.itemsize), led.new(attn.num_heads * t * FP32)
    led.free(lse)  # dropped inside scaled_dot_product_attention; o lives until _prefill returns
    led.free(o)
    y = _linear(led, s, attn.o_proj, t)
    led.free(q, k, qkv, out)
    return y


def _mlp(led: _Ledger, s: _Shapes, mlp: nn.Module) -> int:
    """llama.py MLP.forward."""
    t, i = s.tokens, mlp.intermediate_size
    gate_up = _linear(led, s, mlp.gate_up_proj, t)  # type: ignore[arg-type]  # gate and up are views of it
    silu = led.new(t * i * s.itemsize)  # type: ignore[arg-type, operator]
    product = led.new(t * i * s.itemsize)  # type: ignore[arg-type, operator]
    led.free(silu)
    y = _linear(led, s, mlp.down_proj, t)  # type: ignore[arg-type]
    led.free(product, gate_up)
    return y


def activation_peak(model: DecoderLM, dtype: torch.dtype, tokens: int, rows: int) -> int:
    """The peak live tensor bytes of kv_cache_profiling's forward (`_measure`): `tokens` tokens through `model`,
    then logits for the last `rows` of them and their fp32 copy. Raises AnalyticPeakUnsupported for what it does not
    model."""
    if not isinstance(model, DecoderLM):
        raise AnalyticPeakUnsupported(f"a {type(model).__name__} model is not modelled")
    arch = model.arch
    if arch.gemma_norms or any(layer.self_attn.window is not None for layer in model.model.layers):  # type: ignore[union-attr]
        # The ledger mirrors the Llama layer: Gemma 3's four norms, GELU and windowed attention masks are not in it.
        raise AnalyticPeakUnsupported("Gemma 3's layer (four norms, GELU, sliding-window masks) is not modelled")
    s = _Shapes(
        tokens=tokens,
        itemsize=torch.empty((), dtype=dtype).element_size(),
        native_bf16=cpu_has_native_bf16(),
        dtype=dtype,
    )
    h = tokens * arch.hidden_size * s.itemsize
    led = _Ledger()
    # Backbone.forward
    if isinstance(model.model.embed_tokens, GGUFEmbedding) and dtype not in (torch.bfloat16, torch.float32):
        rows32 = led.new(tokens * arch.hidden_size * FP32)  # the op's fp32 rows, then .to(dtype)
        x = led.new(h)
        led.free(rows32)
    else:
        x = led.new(h)  # embed_tokens
    rope = []
    for _ in ("cos", "sin"):  # rotary_emb.tables: table[positions] (fp32), then .to(dtype)
        indexed = led.new(tokens * arch.head_dim * FP32)
        if dtype != torch.float32:
            rope.append(led.new(tokens * arch.head_dim * s.itemsize))
            led.free(indexed)
        else:
            rope.append(indexed)
    for layer in model.model.layers:  # DecoderLayer.forward; the Backbone holds x throughout
        normed = _rms_norm(led, s, tokens * arch.hidden_size, tokens)
        attn = _attention(led, s, layer.self_attn)  # type: ignore[arg-type]
        led.free(normed)
        x1 = led.new(h)  # x + self_attn(...)
        led.free(attn)
        normed = _rms_norm(led, s, tokens * arch.hidden_size, tokens)
        mlp = _mlp(led, s, layer.mlp)  # type: ignore[arg-type]
        led.free(normed)
        x2 = led.new(h)  # x + mlp(...)
        led.free(mlp, x1)
        led.free(x)  # the Backbone rebinds x
        x = x2
    hidden = _rms_norm(led, s, tokens * arch.hidden_size, tokens)  # self.norm(x)
    led.free(x, *rope)
    # _measure: model.compute_logits(hidden[-rows:]).float()
    logits = _linear(led, s, model.lm_head, rows)
    widened = led.new(rows * arch.vocab_size * FP32) if dtype != torch.float32 else 0
    led.free(logits, widened, hidden)
    return led.peak
