"""Our decoder against Hugging Face transformers on the same weights (the oracle)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glowplug.engine.attention import AttentionMetadata
from glowplug.engine.models.arch import load_arch
from glowplug.engine.models.loader import DTYPES, load_model
from glowplug.engine.models.tiny import TINY_VARIANTS


def _ours(model_dir: Path, dtype: torch.dtype = torch.float32):
    arch = load_arch(model_dir)
    model, _ = load_model(model_dir, arch, dtype, "cpu", arch.max_position_embeddings)
    return model


def _hf(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    from glowplug.engine.models.store import transformers_args

    where, kw = transformers_args(model_dir)  # a folder prepared from a GGUF: transformers reads the GGUF itself
    return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw).eval()


@torch.inference_mode()
def _our_logits(model, ids: list[list[int]]) -> list[torch.Tensor]:
    flat = torch.tensor([t for seq in ids for t in seq])
    pos = torch.cat([torch.arange(len(seq)) for seq in ids])
    hidden = model(flat, pos, AttentionMetadata.causal([len(s) for s in ids]))
    logits = model.compute_logits(hidden)
    return list(logits.split([len(s) for s in ids]))


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_prefill_logits_match_transformers_fp32(tiny_dir, variant: str) -> None:
    d = tiny_dir(variant)
    ours, ref = _ours(d), _hf(d)
    g = torch.Generator().manual_seed(1)
    vocab = ours.arch.vocab_size
    # Two sequences in one flattened batch; lengths past the llama3 original context exercise the scaling.
    ids = [torch.randint(0, vocab, (90,), generator=g).tolist(), torch.randint(0, vocab, (17,), generator=g).tolist()]
    got = _our_logits(ours, ids)
    with torch.inference_mode():
        for seq, logits in zip(ids, got):
            want = ref(torch.tensor([seq])).logits[0].float()
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_reference(tiny_dir, dtype: str) -> None:
    d = tiny_dir("qwen3")
    ours, ref = _ours(d, DTYPES[dtype]), _hf(d, DTYPES[dtype])
    ids = [list(range(3, 40))]
    got = _our_logits(ours, ids)[0]
    # logits come in the model's dtype (the sampler widens what it computes on)
    assert got.dtype == DTYPES[dtype] and torch.isfinite(got).all()
    got = got.float()
    with torch.inference_mode():
        want = ref(torch.tensor(ids)).logits[0].float()
    # Same dtype, same op order up to kernel choice: tight relative to the logit scale.
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < 0.03
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_sharded_checkpoint_loads(tiny_dir, tmp_path: Path) -> None:
    src = tiny_dir("llama")
    ref = _hf(src)
    ref.save_pretrained(str(tmp_path), max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = _ours(tmp_path)
    ids = [list(range(5, 30))]
    with torch.inference_mode():
        torch.testing.assert_close(_our_logits(ours, ids)[0], ref(torch.tensor(ids)).logits[0], atol=1e-4, rtol=1e-4)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path.resolve())):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def test_weights_are_not_copied_when_dtype_matches(tiny_dir) -> None:
    """fp32 checkpoint into an fp32 model: every parameter points into the mmap of the safetensors file, except the
    fused projections (q/k/v and gate/up concatenated at load), which are one copy each."""
    d = tiny_dir("llama")
    model = _ours(d)
    ranges = _mapped_ranges(d / "model.safetensors")
    assert ranges, "the safetensors file is not memory-mapped"
    fused = ("qkv_proj", "gate_up_proj")
    for name, p in model.named_parameters():
        mapped = any(lo <= p.data_ptr() < hi for lo, hi in ranges)
        if any(f in name for f in fused):
            assert not mapped, f"{name} should be a fused copy"
        else:
            assert mapped, f"{name} was copied out of the mmap"


@pytest.mark.slow
def test_smollm2_prefill_logits_match_transformers(smollm2_dir: Path) -> None:
    ours, ref = _ours(smollm2_dir), _hf(smollm2_dir)
    from transformers import AutoTokenizer

    from glowplug.engine.models.store import transformers_args

    where, kw = transformers_args(smollm2_dir)
    tok = AutoTokenizer.from_pretrained(where, **kw)
    ids = [
        tok("The capital of France is")["input_ids"],
        tok("glowplug accounts for every second of start-up.")["input_ids"],
    ]
    got = _our_logits(ours, ids)
    with torch.inference_mode():
        for seq, logits in zip(ids, got):
            torch.testing.assert_close(logits, ref(torch.tensor([seq])).logits[0].float(), atol=1e-4, rtol=1e-4)
