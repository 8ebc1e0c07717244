"""Sampler masks (property tests), detokenizer UTF-8 handling and stop strings, paged attention vs contiguous."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from glowplug.engine.attention import DECODE_COLS, AttentionMetadata, decode_attention, paged_attention
from glowplug.engine.detokenizer import IncrementalDetokenizer
from glowplug.engine.kv_cache import KVCache
from glowplug.engine.sampler import apply_min_p, apply_top_k, apply_top_p
from glowplug.engine.sampling_params import SamplingParams

logit_rows = arrays("float32", st.integers(2, 64), elements=st.floats(-20, 20, width=32))


@given(logit_rows, st.floats(0.01, 1.0))
def test_top_p_keeps_smallest_prefix_reaching_p(row, p: float) -> None:
    logits = torch.from_numpy(row)
    kept = torch.isfinite(apply_top_p(logits, p))
    probs = logits.softmax(-1)
    assert kept.any()
    # Every kept token is at least as likely as every dropped one.
    if (~kept).any():
        assert probs[kept].min() >= probs[~kept].max()
    # The kept mass reaches p (up to float error), and dropping the least likely kept token would fall below p.
    mass = probs[kept].sum()
    assert mass >= min(p, 1.0) - 1e-5 or kept.all()
    if kept.sum() > 1:
        assert mass - probs[kept].min() < p + 1e-5


@given(logit_rows, st.integers(1, 70))
def test_top_k_keeps_k_largest(row, k: int) -> None:
    logits = torch.from_numpy(row)
    kept = torch.isfinite(apply_top_k(logits, k))
    n = logits.numel()
    kth = torch.sort(logits, descending=True).values[min(k, n) - 1]
    assert kept.sum() >= min(k, n)
    assert torch.equal(kept, logits >= kth) or k >= n


@given(logit_rows, st.floats(0.0, 1.0))
def test_min_p_relative_threshold(row, min_p: float) -> None:
    logits = torch.from_numpy(row)
    kept = torch.isfinite(apply_min_p(logits, min_p))
    probs = logits.softmax(-1)
    assert kept[probs.argmax()]
    assert torch.equal(kept, probs >= probs.max() * min_p) or min_p == 0.0


def _detok_all(tok, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[str, list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, [], stop=stop)
    stream = []
    for t in ids:
        if d.append(t):
            break
        stream.append(d.take_stream_delta(False))
    d.flush()
    stream.append(d.take_stream_delta(True))
    return d.output_text, stream, d


@pytest.mark.parametrize("text", ["emoji like 🚀🔥 and", "你好世界", "Ünïcödé", "🚀"])
def test_incremental_decode_never_splits_utf8(tiny_dir, text: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir("llama")))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.encode()) // 4  # the byte-level tokenizer really splits characters
    full, stream, _ = _detok_all(tok, ids)
    assert full == tok.decode(ids) == text
    assert "".join(stream) == text
    assert all("\ufffd" not in piece for piece in stream)


def test_stop_string_cuts_exactly_and_is_not_streamed(tiny_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir("llama")))
    text = "The scheduler mixes prefill chunks and decode steps"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    full, stream, d = _detok_all(tok, ids, stop=("chunks and",))
    assert full == "The scheduler mixes prefill "
    assert "".join(stream) == full and d.stopped_by == "chunks and"
    # A stop string inside one multi-byte run still cuts on the character boundary.
    ids = tok("go 🚀🔥 now", add_special_tokens=False)["input_ids"]
    full, stream, _ = _detok_all(tok, ids, stop=("🔥",))
    assert full == "go 🚀" and "".join(stream) == full


def test_sampling_params_validation_names_the_field() -> None:
    from pydantic import ValidationError

    for bad, field in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"top_k": -2}, "top_k"),
    ]:
        with pytest.raises(ValidationError) as e:
            SamplingParams(**bad)
        assert field in str(e.value)


def test_paged_attention_matches_contiguous() -> None:
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, bs = 4, 2, 8, 4
    cache = KVCache(num_layers=1, num_blocks=16, block_size=bs, num_kv_heads=Hkv, head_dim=D, dtype=torch.float32)
    # Sequence A: 10 tokens cached earlier in scattered blocks, now a 3-token chunk; sequence B: decoding its 7th token.
    tables = {"a": [5, 2, 9, 11], "b": [7, 3]}
    ka, va = torch.randn(13, Hkv, D, generator=g), torch.randn(13, Hkv, D, generator=g)
    kb, vb = torch.randn(7, Hkv, D, generator=g), torch.randn(7, Hkv, D, generator=g)

    def slots(table: list[int], positions: range) -> torch.Tensor:
        return torch.tensor([table[p // bs] * bs + p % bs for p in positions])

    cache[0].store(ka[:10], va[:10], slots(tables["a"], range(10)))
    cache[0].store(kb[:6], vb[:6], slots(tables["b"], range(6)))
    q = torch.randn(4, H, D, generator=g)
    meta = AttentionMetadata(
        prefill_info=torch.tensor([[0, 3, 13]]),
        prefill_block_tables=torch.tensor([tables["a"]]),
        kv_cache=cache,
        slot_mapping=torch.cat([slots(tables["a"], range(10, 13)), slots(tables["b"], range(6, 7))]),
        decode_block_tables=torch.tensor([tables["b"]]),
        decode_ctx_lens=torch.tensor([7]),
    )
    k_new = torch.cat([ka[10:], kb[6:]])
    v_new = torch.cat([va[10:], vb[6:]])
    out = paged_attention(q, k_new, v_new, 0, meta, D**-0.5)

    def ref(qs, k, v, offset):
        k = k.repeat_interleave(H // Hkv, 1)
        v = v.repeat_interleave(H // Hkv, 1)
        s = torch.einsum("qhd,khd->hqk", qs, k) * D**-0.5
        mask = torch.arange(k.shape[0])[None, :] <= torch.arange(qs.shape[0])[:, None] + offset
        return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)

    torch.testing.assert_close(out[:3], ref(q[:3], ka, va, 10), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[3:], ref(q[3:], kb, vb, 6), atol=1e-5, rtol=1e-5)

    # The compiled decode step's attention (plain ops over the packed step input) on sequence B's last token, in a
    # fresh cache holding its first 6 tokens: same output, and the new token's k/v written at its slot.
    fresh = KVCache(num_layers=1, num_blocks=16, block_size=bs, num_kv_heads=Hkv, head_dim=D, dtype=torch.float32)
    fresh[0].store(kb[:6], vb[:6], slots(tables["b"], range(6)))
    slot = int(slots(tables["b"], range(6, 7))[0])
    width = 3  # padded past the sequence's 2 blocks with a block it must not see
    packed = torch.tensor([[0, 6, slot, 7, *tables["b"], 0][: DECODE_COLS + width]])
    got = decode_attention(q[3:], kb[6:], vb[6:], fresh[0], packed, D**-0.5)
    torch.testing.assert_close(got, ref(q[3:], kb, vb, 6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fresh[0].k.view(-1, Hkv, D)[slot], kb[6])
    torch.testing.assert_close(fresh[0].v.view(-1, Hkv, D)[slot], vb[6])
