"""Paged decode attention on the GPU: the launcher of attention_kernels.py and its torch custom op.

`paged_decode_attention(q, k_cache, v_cache, k_scale, v_scale, tables, ctx_lens, scale, window)` attends one new
token per row to that row's context through its block table, reading only the tokens the row sees: no gather, no
padding to the table's width (attention_kernels.py describes the grid and the split). Its oracle is
`kernels.reference.paged_decode_attention_reference`.

The op `glowplug_triton::paged_decode_attention(q, k_cache, v_cache, k_scale, v_scale, packed, scale, window)` wraps
it for the compiled decode step, reading the step's packed input (`packed[:, PACKED_CONTEXT]` the context length,
`packed[:, PACKED_TABLE:]` the block table; engine/attention.py's layout, which the native CPU op reads too). It is
registered on first use (`register_op`), never at import: Dynamo and Inductor see it as one opaque node with a fake
kernel, and a CUDA graph captures its launches (they depend on shapes only, and nothing syncs with the host).

Triton is optional: this module imports it only on the first launch, and `unavailable_reason` says, for a device,
why the kernel cannot run there (None when it can).
"""

from __future__ import annotations

import functools
import threading
from types import ModuleType

import torch
from torch import Tensor

from . import available, interpreting

# engine/attention.py's packed decode input: [B, PACKED_TABLE + W] int64, the context length (including the new
# token) in column PACKED_CONTEXT and the block table after column PACKED_TABLE. tests check the two agree.
PACKED_CONTEXT = 3
PACKED_TABLE = 4

# Tokens per partition of the flash-decoding split. The grid has cdiv(W * block_size, partition) partitions per
# (row, KV head): one per PARTITION_TOKENS of the longest context the table can hold, up to MAX_PARTITIONS (beyond
# that the partitions grow instead, which bounds the fp32 scratch, B * H * partitions * head_dim, and the combine).
PARTITION_TOKENS = 256
MAX_PARTITIONS = 64
# The dot products need every dimension >= 16: a KV head's G query heads are padded to at least this many rows.
MIN_DOT = 16
NAMESPACE = "glowplug_triton"
OP_NAME = f"{NAMESPACE}::paged_decode_attention"


def _kernels() -> ModuleType:
    if not available():
        raise RuntimeError("triton is not installed; `pip install triton` (GPU) or use the CPU paths")
    from . import attention_kernels

    return attention_kernels


@functools.cache
def _reason(device_type: str, index: int | None) -> str | None:
    if not available():
        return "triton is not installed"
    try:
        import triton  # noqa: F401 - importing is the check (a half-installed triton fails here, not mid-step)
    except Exception as exc:  # noqa: BLE001 - any import failure means the same thing: take the torch path
        return f"triton does not import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 0):
            # bf16 tl.dot and the tile shapes here are tuned for Ampere and newer.
            return f"compute capability {major}.{minor} is below 8.0 (the kernel needs Ampere or newer)"
        return None
    if device_type == "cpu":
        return None if interpreting() else "Triton runs CPU tensors only under TRITON_INTERPRET=1 (tests)"
    return f"no Triton attention kernel for {device_type} devices"


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the kernel cannot run on `device`, or None when it can (CUDA with compute capability >= 8.0 and an
    importable triton; CPU tensors under TRITON_INTERPRET=1)."""
    dev = torch.device(device)
    return _reason(dev.type, dev.index)


def partitions(width: int, partition: int = PARTITION_TOKENS, block_n: int = 64) -> tuple[int, int]:
    """(tokens per partition, partitions) for a table holding `width` tokens: a function of shapes only, so the
    grid a CUDA graph captures fits every context length the table can hold. `partition` must be a multiple of
    `block_n` (a partition is whole tiles)."""
    if partition <= 0 or partition % block_n:
        raise ValueError(f"partition ({partition}) must be a positive multiple of block_n ({block_n})")
    capped = -(-max(width, 1) // MAX_PARTITIONS)
    length = max(partition, -(-capped // block_n) * block_n)
    return length, max(1, -(-width // length))


def default_block_n(block_d: int, fp32_tiles: bool) -> int:
    """Tokens per loop step: the largest tile that ptxas (Triton 3.9, sm_80 and sm_90, 4 warps) fits in registers
    without spilling, from its resource usage at G_PAD 16: 32 tokens for 16-bit tiles up to head_dim 128, 16 above;
    tiles that pass through fp32 (an fp32 model, an int8 cache's dequantized values) half that from head_dim 128,
    and an fp32 model's tiles from head_dim 128 take 8 warps (with 4 they spilled)."""
    if fp32_tiles:
        return 16 if block_d >= 128 else 32
    return 32 if block_d <= 128 else 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    tables: Tensor,
    ctx_lens: Tensor,
    scale: float,
    window: int | None = None,
    *,
    partition: int = PARTITION_TOKENS,
    block_n: int | None = None,
) -> Tensor:
    """[B, H, D] attention of q [B, H, D] (one token per row) over the paged cache, in q's dtype.

    k_cache/v_cache [blocks, block_size, Hkv, D] in q's dtype, or int8 with fp32 k_scale/v_scale [blocks,
    block_size, Hkv]; tables [B, W] block ids (any strides, e.g. a view into the packed step input); ctx_lens [B]:
    row b sees tokens 0 .. ctx_lens[b] - 1 of its table, or with `window` only the last `window` of them.
    `partition`, `block_n`: tokens per split and per loop step (tests shrink them to cover several of each)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q [B, H, D] and caches [blocks, block_size, Hkv, D] expected, got q {tuple(q.shape)}, "
            f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    b, heads, d = q.shape
    _, block_size, kv_heads, dk = k_cache.shape
    if dk != d or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {kv_heads} KV heads of dim {dk}")
    int8 = k_cache.dtype == torch.int8
    if int8 != (k_scale is not None and v_scale is not None):
        raise ValueError("an int8 cache needs k_scale and v_scale, and only an int8 cache takes them")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    group = heads // kv_heads
    block_d = max(MIN_DOT, _next_pow2(d))
    # The interpreter computes bf16/fp16 tl.dot wrongly; fp32 operands there, and for an fp32 model on the GPU too
    # (exact fp32 products: the reference's, with no TF32 rounding).
    dot_f32 = q.device.type != "cuda" or q.dtype == torch.float32
    bn = block_n if block_n is not None else default_block_n(block_d, int8 or dot_f32)
    part_len, num_parts = partitions(tables.shape[1] * block_size, partition, bn)
    out = torch.empty((b, heads, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    kern = _kernels()
    split = num_parts > 1
    if split:
        m = torch.empty((b, heads, num_parts), dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty((b, heads, num_parts, d), dtype=torch.float32, device=q.device)
    else:  # single pass: never touched (the kernel's SPLIT branch is compiled out)
        m = l_ = acc = out
    ks = k_scale if k_scale is not None else k_cache  # never read without INT8
    vs = v_scale if v_scale is not None else v_cache
    win = int(window) if window is not None else 0
    kern.paged_decode_kernel[(b, kv_heads, num_parts)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        tables,
        ctx_lens,
        out,
        m,
        l_,
        acc,
        float(scale),
        win,
        block_size,
        part_len,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        ks.stride(0) if int8 else 0,
        ks.stride(1) if int8 else 0,
        ks.stride(2) if int8 else 0,
        tables.stride(0),
        ctx_lens.stride(0),
        out.stride(0),
        out.stride(1),
        m.stride(0),
        m.stride(1),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2) if split else 0,
        G=group,
        G_PAD=max(MIN_DOT, _next_pow2(group)),
        D=d,
        BLOCK_D=block_d,
        BLOCK_N=bn,
        INT8=int8,
        SPLIT=split,
        DOT_F32=dot_f32,
        num_warps=8 if dot_f32 and block_d >= 128 else 4,
    )
    if split:
        kern.paged_decode_combine_kernel[(b, heads)](
            ctx_lens,
            m,
            l_,
            acc,
            out,
            win,
            part_len,
            ctx_lens.stride(0),
            m.stride(0),
            m.stride(1),
            acc.stride(0),
            acc.stride(1),
            acc.stride(2),
            out.stride(0),
            out.stride(1),
            D=d,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def _from_packed(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    packed: Tensor,
    scale: float,
    window: int | None,
) -> Tensor:
    """The op's body (its schema is read from these hints): the launcher on the step's packed input."""
    return paged_decode_attention(
        q, k_cache, v_cache, k_scale, v_scale, packed[:, PACKED_TABLE:], packed[:, PACKED_CONTEXT], scale, window
    )


def _fake(q: Tensor, *_operands: object, **_named: object) -> Tensor:
    """The op's fake kernel: the output has q's shape and dtype, whatever the other operands."""
    return q.new_empty(q.shape)


_REGISTER = threading.Lock()


def register_op() -> object:
    """Define `torch.ops.glowplug_triton.paged_decode_attention` (once per process) and return it. Called by the
    code that turns the Triton path on, so a compiled artifact that calls the op finds it defined. Start-up stages
    run on threads of their own: the lock keeps two first calls from defining it twice (an error in torch)."""
    with _REGISTER:
        return _register_op()


@functools.cache
def _register_op() -> object:
    op = torch.library.custom_op(OP_NAME, mutates_args=())(_from_packed)
    op.register_fake(_fake)
    return getattr(torch.ops, NAMESPACE).paged_decode_attention
