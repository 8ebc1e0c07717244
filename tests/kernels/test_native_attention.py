"""The native decode attention op against its reference, the torch path of engine/attention.decode_attention."""

from __future__ import annotations

import pytest
import torch

from glowplug.engine.attention import CONTEXT, DECODE_COLS, POSITION, SLOT, decode_attention
from glowplug.engine.kv_cache import KVCache
from glowplug.kernels.native import attention_supported

BLOCK, HEADS, KV_HEADS, HEAD_DIM, BLOCKS = 4, 9, 3, 64, 64
CONTEXTS = [1, 4, 5, 17, 40]  # one token, a whole block, crossing blocks, ten blocks


@pytest.fixture(scope="module")
def native(native_build) -> None:  # type: ignore[no-untyped-def]
    build = native_build
    if not build.available or not attention_supported(HEAD_DIM):
        pytest.skip(f"native decode attention unavailable here: {build.reason}")


def _filled_cache(dtype: torch.dtype, int8: bool, g: torch.Generator) -> KVCache:
    cache = KVCache(
        num_layers=1,
        num_blocks=BLOCKS,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        int8=int8,
    )
    slots = BLOCKS * BLOCK
    cache[0].store(
        torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
        torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
        torch.arange(slots),
    )
    return cache


def _packed(
    g: torch.Generator, width: int, contexts: list[int] = CONTEXTS, block: int = BLOCK, blocks: int = BLOCKS
) -> torch.Tensor:
    """One row per context length, each with its own shuffled blocks (block 0 left as the scratch block)."""
    table = torch.randperm(blocks - 1, generator=g) + 1
    packed = torch.zeros(len(contexts), DECODE_COLS + width, dtype=torch.long)
    for b, ctx in enumerate(contexts):
        packed[b, CONTEXT], packed[b, POSITION] = ctx, ctx - 1
        packed[b, DECODE_COLS:] = table[b * width : (b + 1) * width]
        packed[b, SLOT] = packed[b, DECODE_COLS + (ctx - 1) // block] * block + (ctx - 1) % block
    return packed


@pytest.mark.parametrize(
    ("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)]
)
def test_native_decode_attention_matches_torch_path(native: None, dtype: torch.dtype, int8: bool) -> None:
    g = torch.Generator().manual_seed(7 + int8)
    ref_cache = _filled_cache(dtype, int8, g)
    got_cache = KVCache(
        num_layers=1,
        num_blocks=BLOCKS,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        int8=int8,
    )
    for src, dst in zip(ref_cache.tensors(), got_cache.tensors()):
        dst.copy_(src)
    packed = _packed(g, width=11)
    q = torch.randn(len(CONTEXTS), HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(len(CONTEXTS), KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(len(CONTEXTS), KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    want = decode_attention(q, k, v, ref_cache[0], packed, HEAD_DIM**-0.5)
    got = decode_attention(q, k, v, got_cache[0], packed, HEAD_DIM**-0.5, native=True)
    assert got.shape == want.shape and got.dtype == dtype
    # fp32: summation order only; bf16: one rounding of the output
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    assert float((got.float() - want.float()).abs().max()) < tol
    # the new tokens were written exactly as the torch path writes them, and nothing else changed
    assert all(torch.equal(a, b) for a, b in zip(ref_cache.tensors(), got_cache.tensors()))


def test_native_decode_attention_rejects_a_bad_cache(native: None) -> None:
    q = torch.randn(1, HEADS, HEAD_DIM)
    packed = torch.tensor([[0, 0, 0, 1, 0]])
    wrong = torch.zeros(4, BLOCK, KV_HEADS, 32)
    with pytest.raises(RuntimeError, match="k_cache must be a contiguous"):
        torch.ops.glowplug_native.decode_attention(q, wrong, wrong, packed, 0.125)


# On a CPU with AMX, bf16 caches in blocks of 16 take the tile path: every batch of two or more, and one sequence
# from 256 tokens; batches of 2 split per kv head, 12 per sequence (at 2 threads). Elsewhere these run the vector
# path, against the same reference.
@pytest.mark.parametrize(
    ("contexts", "head_dim"),
    [([1, 15, 16, 17, 40, 100, 3, 33, 64, 2, 200, 90], 64), ([17, 130], 64), ([300], 64), ([5, 47, 260], 128)],
)
def test_native_decode_attention_tiles_match_torch_path(native: None, contexts: list[int], head_dim: int) -> None:
    block, blocks, width = 16, 400, 20  # every row its own blocks
    g = torch.Generator().manual_seed(len(contexts) + head_dim)
    caches = [
        KVCache(
            num_layers=1,
            num_blocks=blocks,
            block_size=block,
            num_kv_heads=KV_HEADS,
            head_dim=head_dim,
            dtype=torch.bfloat16,
        )
        for _ in range(2)
    ]
    slots = blocks * block
    kv = [torch.randn(slots, KV_HEADS, head_dim, generator=g).bfloat16() for _ in range(2)]
    for cache in caches:
        cache[0].store(kv[0], kv[1], torch.arange(slots))
    packed = _packed(g, width, contexts, block, blocks)
    q = torch.randn(len(contexts), HEADS, head_dim, generator=g).bfloat16()
    k = torch.randn(len(contexts), KV_HEADS, head_dim, generator=g).bfloat16()
    v = torch.randn(len(contexts), KV_HEADS, head_dim, generator=g).bfloat16()
    want = decode_attention(q, k, v, caches[0][0], packed, head_dim**-0.5)
    got = decode_attention(q, k, v, caches[1][0], packed, head_dim**-0.5, native=True)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert float((got.float() - want.float()).abs().max()) < 8e-3  # one rounding of the output


# The vector path shares a call's 16-token tiles evenly among its threads (one part each), cutting sequences at any
# tile, and combines the pieces' softmax states afterwards: every count of parts, contexts inside one tile and over
# many, padding rows (length 0, which attend to nothing), kv-head groups of several sizes, and every cache dtype.
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize(
    ("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)]
)
@pytest.mark.parametrize(
    ("contexts", "heads", "kv_heads"),
    [
        ([1], 9, 3),
        ([17], 9, 3),
        ([2048], 9, 3),
        ([0, 1, 300, 0, 17, 1000, 33, 16], 9, 3),
        ([777, 5], 8, 1),
        ([129, 64, 0], 4, 4),
    ],
)
def test_native_decode_attention_split_matches_torch_path(
    native: None, threads: int, dtype: torch.dtype, int8: bool, contexts: list[int], heads: int, kv_heads: int
) -> None:
    block = 16
    width = max(-(-c // block) for c in contexts) + 1
    blocks = len(contexts) * width + 1
    g = torch.Generator().manual_seed(sum(contexts) + heads + int8)
    cache = KVCache(
        num_layers=1,
        num_blocks=blocks,
        block_size=block,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        dtype=dtype,
        int8=int8,
    )
    slots = blocks * block
    # a few large scores, so the pieces' maxima differ and the combine's rescaling matters
    keys = torch.randn(slots, kv_heads, HEAD_DIM, generator=g) * (1 + 3 * torch.rand(slots, 1, 1, generator=g))
    cache[0].store(keys.to(dtype), torch.randn(slots, kv_heads, HEAD_DIM, generator=g).to(dtype), torch.arange(slots))
    packed = _packed(g, width, [max(c, 1) for c in contexts], block, blocks)
    packed[:, CONTEXT] = torch.tensor(contexts)
    q = torch.randn(len(contexts), heads, HEAD_DIM, generator=g).to(dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = (
            torch.ops.glowplug_native.decode_attention_int8(
                q, cache[0].k, cache[0].v, cache[0].k_scale, cache[0].v_scale, packed, HEAD_DIM**-0.5
            )
            if int8
            else torch.ops.glowplug_native.decode_attention(q, cache[0].k, cache[0].v, packed, HEAD_DIM**-0.5)
        )
    finally:
        torch.set_num_threads(saved)
    # the reference: the torch path's reads, without its store (the new token is already in the cache here)
    lens = packed[:, CONTEXT]
    keys_f, values_f = cache[0].read(packed[:, DECODE_COLS:], torch.float32)
    b, w = len(contexts), width * block
    keys_f = keys_f.reshape(b, w, kv_heads, 1, HEAD_DIM)
    values_f = values_f.reshape(b, w, kv_heads, 1, HEAD_DIM)
    scores = (q.float().reshape(b, 1, kv_heads, heads // kv_heads, HEAD_DIM) * keys_f).sum(-1) * HEAD_DIM**-0.5
    visible = torch.arange(w)[None, :] < lens[:, None]
    probs = scores.masked_fill(~visible[:, :, None, None], float("-inf")).softmax(dim=1)
    want = (probs[..., None] * values_f).sum(1).reshape(b, heads, HEAD_DIM)
    live = lens > 0
    assert got.shape == (b, heads, HEAD_DIM) and got.dtype == dtype
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))
    # fp32: summation order over up to 2,048 keys with scores up to ~4x the first test's (the per-(sequence, kv
    # head) kernel this split replaced measured 4.6e-6 here); bf16: one rounding of the output
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert float((got[live].float() - want[live].to(dtype).float()).abs().max()) < tol


# -- sliding windows (Gemma 3's local layers) --------------------------------------------------------------------------
# Row b attends to positions max(0, L - window) .. L - 1 only, and the op must not read the blocks before that. Each
# case: (contexts, window, block size, heads, kv heads, head_dim). Contexts shorter than, equal to and one past the
# window, far past it, rows of very different lengths in one batch, padding rows (0); windows that start mid-block
# and mid-tile, and windows of whole tiles; blocks of 16 (a tile lies in one block), 4 (a tile spans four) and 12 (a
# tile's blocks do not line up with it); head_dims of 64, 128 and 32 (the vector path's generic width); GQA groups of
# 3, 8 and 1; and for the AMX tile path on a CPU that has it (bf16, blocks of 16, head_dim 64/128): every batch of
# two or more, and one sequence whose window alone is 256 or more.
WINDOW_CASES = [
    ([1, 19, 20, 21, 100, 333, 0, 57], 20, 16, 9, 3, 64),
    ([5, 16, 17, 47, 48, 49, 260], 16, 16, 8, 1, 128),
    ([1000, 3, 300], 37, 4, 9, 3, 64),
    ([64, 65, 129, 500, 2], 64, 12, 4, 4, 32),
    ([700], 300, 16, 8, 1, 64),  # one sequence, a window long enough for the AMX tiles
    ([700], 100, 16, 8, 1, 128),  # one sequence under the AMX threshold: the vector path
    ([2048, 1], 5, 16, 9, 3, 64),
]


def _window_case(
    contexts: list[int],
    window: int,
    block: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    int8: bool,
    g: torch.Generator,
) -> tuple[KVCache, torch.Tensor]:
    """A cache with a few large keys (so the online softmax's maxima move) and one row per context, each on its own
    shuffled blocks."""
    width = max(-(-c // block) for c in contexts) + 1
    blocks = len(contexts) * width + 1
    cache = KVCache(
        num_layers=1,
        num_blocks=blocks,
        block_size=block,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        int8=int8,
    )
    slots = blocks * block
    keys = torch.randn(slots, kv_heads, head_dim, generator=g) * (1 + 3 * torch.rand(slots, 1, 1, generator=g))
    cache[0].store(keys.to(dtype), torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype), torch.arange(slots))
    packed = _packed(g, width, [max(c, 1) for c in contexts], block, blocks)
    packed[:, CONTEXT] = torch.tensor(contexts)
    return cache, packed


def _native(
    q: torch.Tensor, cache: KVCache, packed: torch.Tensor, scale: float, window: int, threads: int
) -> torch.Tensor:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        c = cache[0]
        if c.k_scale is not None and c.v_scale is not None:
            out: torch.Tensor = torch.ops.glowplug_native.decode_attention_int8(
                q, c.k, c.v, c.k_scale, c.v_scale, packed, scale, window
            )
        else:
            out = torch.ops.glowplug_native.decode_attention(q, c.k, c.v, packed, scale, window)
        return out
    finally:
        torch.set_num_threads(saved)


def _poison_before_windows(cache: KVCache, packed: torch.Tensor, window: int) -> torch.Tensor:
    """NaN in every cell before each row's window (int8: in its scales), and the table entries of blocks wholly before
    it replaced by -1 or an id past the cache: a read of any of them would make the output NaN or fail. Returns the
    poisoned packed input."""
    c = cache[0]
    block, nblk = c.k.shape[1], c.k.shape[0]
    packed = packed.clone()
    for b in range(packed.shape[0]):
        ctx = int(packed[b, CONTEXT])
        lo = ctx - window if 0 < window < ctx else 0
        for pos in range(lo):
            blk, off = int(packed[b, DECODE_COLS + pos // block]), pos % block
            for t in (c.k_scale, c.v_scale) if c.k_scale is not None else (c.k, c.v):
                assert t is not None
                t[blk, off] = float("nan")
        for i in range(lo // block):  # every block wholly before the window
            packed[b, DECODE_COLS + i] = -1 if i % 2 else nblk + 1000 * i
    return packed


@pytest.mark.parametrize("threads", [1, 3])  # one part, and parts cutting rows (2: the torch-path test below)
@pytest.mark.parametrize(
    ("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)]
)
@pytest.mark.parametrize(("contexts", "window", "block", "heads", "kv_heads", "head_dim"), WINDOW_CASES)
def test_native_window_matches_the_reference_and_reads_nothing_before_it(
    native: None,
    threads: int,
    dtype: torch.dtype,
    int8: bool,
    contexts: list[int],
    window: int,
    block: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    from glowplug.kernels.reference import paged_decode_attention_reference

    g = torch.Generator().manual_seed(sum(contexts) + window + block + int8)
    cache, packed = _window_case(contexts, window, block, kv_heads, head_dim, dtype, int8, g)
    q = torch.randn(len(contexts), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    # holes inside the windows too (a block the engine never sent reads as zeros on both sides), past the block
    # holding a window's first position
    for b, n in enumerate(contexts):
        lo = n - window if 0 < window < n else 0
        if n > 0 and (n - 1) // block > lo // block:
            packed[b, DECODE_COLS + (n - 1) // block] = -1
    poisoned = _poison_before_windows(cache, packed, window)
    got = _native(q, cache, poisoned, scale, window, threads)
    c = cache[0]
    want = paged_decode_attention_reference(q, c.k, c.v, c.k_scale, c.v_scale, poisoned, scale, window)
    assert got.shape == q.shape and got.dtype == dtype
    assert torch.isfinite(want).all()  # the reference read nothing before the windows either
    # the poison works: the same call without the window reads the NaN cells of a window's first block
    if any(0 < window < n and (n - window) % block for n in contexts):
        assert not torch.isfinite(_native(q, cache, poisoned, scale, 0, threads)).all()
    live = poisoned[:, CONTEXT] > 0
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))
    # fp32: summation order only; bf16: one rounding of the output
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert float((got.float() - want.to(dtype).float()).abs().max()) < tol


@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize(("contexts", "window", "block", "heads", "kv_heads", "head_dim"), WINDOW_CASES[:4])
def test_native_window_matches_the_torch_path(
    native: None,
    dtype: torch.dtype,
    int8: bool,
    contexts: list[int],
    window: int,
    block: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    """engine/attention.decode_attention with a window, native against its torch path (which masks instead), the new
    tokens' write included."""
    g = torch.Generator().manual_seed(window + head_dim + int8)
    contexts = [max(c, 1) for c in contexts]  # the torch path writes every row's new token
    ref_cache, packed = _window_case(contexts, window, block, kv_heads, head_dim, dtype, int8, g)
    got_cache = KVCache(
        num_layers=1,
        num_blocks=ref_cache[0].k.shape[0],
        block_size=block,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        int8=int8,
    )
    for src, dst in zip(ref_cache.tensors(), got_cache.tensors()):
        dst.copy_(src)
    q = torch.randn(len(contexts), heads, head_dim, generator=g).to(dtype)
    k = torch.randn(len(contexts), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(len(contexts), kv_heads, head_dim, generator=g).to(dtype)
    want = decode_attention(q, k, v, ref_cache[0], packed, head_dim**-0.5, window=window)
    got = decode_attention(q, k, v, got_cache[0], packed, head_dim**-0.5, native=True, window=window)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert float((got.float() - want.float()).abs().max()) < tol
    assert all(torch.equal(a, b) for a, b in zip(ref_cache.tensors(), got_cache.tensors()))
    # and the window changes the answer wherever a row is longer than it (the test would not see a window ignored)
    full = decode_attention(q, k, v, got_cache[0], packed, head_dim**-0.5, native=True)
    longer = torch.tensor(contexts) > window
    assert (full[longer].float() - got[longer].float()).abs().amax(dim=(1, 2)).min() > 1e-3
    assert float((full[~longer].float() - got[~longer].float()).abs().max()) < tol  # and nothing where it is not


def test_a_window_of_zero_or_less_is_the_whole_context(native: None) -> None:
    g = torch.Generator().manual_seed(3)
    cache, packed = _window_case([40, 7, 300], 0, 16, 3, 64, torch.float32, False, g)
    q = torch.randn(3, 9, 64, generator=g)
    whole = _native(q, cache, packed, 0.125, 0, 2)
    for window in (-1, -100):
        assert torch.equal(_native(q, cache, packed, 0.125, window, 2), whole)
    # the schema's default is no window (at the same thread count: the split over threads sets the sum's order)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        default = torch.ops.glowplug_native.decode_attention(q, cache[0].k, cache[0].v, packed, 0.125)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(default, whole)
