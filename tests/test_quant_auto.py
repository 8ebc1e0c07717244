"""--quantization auto: a GGUF runs as stored, per layer. A mixed file (int4, int8 and float layers in one model),
written here from the tiny llama checkpoint with gguf's own writer and quantizer, loads with the expected per-layer
formats, compiles and decodes as its eager run does; `none` still de-quantizes everything; the default model runs
exactly as --quantization int4 (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from glowplug.engine.attention import AttentionMetadata
from glowplug.engine.config import EngineConfig
from glowplug.engine.models import gguf_tensors as gt
from glowplug.engine.models.gguf_auto import plan_layers
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.startup import build_engine
from glowplug.kernels.modules import DenseLinear, Int4Linear, Int8Linear, QuantLinear
from glowplug.profiling.names import Attr
from glowplug.profiling.tracing import setup_tracing

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# GGUF name (per layer) -> Hugging Face name, for the tensors the tiny llama holds.
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # fmt: skip
# The mixed file: layer 0 int4 attention, int8 MLP in, float MLP out; layer 1 a q/k/v fused across Q4_0 and Q8_0
# (int8, the wider), gate/up fused across F16 and Q4_0 (float), int4 down; an untied Q8_0 head.
MIXED = {
    "blk.0.attn_q": Q.Q4_0, "blk.0.attn_k": Q.Q4_0, "blk.0.attn_v": Q.Q4_0, "blk.0.attn_output": Q.Q4_0,
    "blk.0.ffn_gate": Q.Q8_0, "blk.0.ffn_up": Q.Q8_0, "blk.0.ffn_down": Q.F16,
    "blk.1.attn_q": Q.Q4_0, "blk.1.attn_k": Q.Q4_0, "blk.1.attn_v": Q.Q8_0, "blk.1.attn_output": Q.Q8_0,
    "blk.1.ffn_gate": Q.F16, "blk.1.ffn_up": Q.Q4_0, "blk.1.ffn_down": Q.Q4_0,
    "output": Q.Q8_0, "token_embd": Q.F16,
}  # fmt: skip
EXPECTED = {
    "model.layers.0.self_attn.qkv_proj": Int4Linear, "model.layers.0.self_attn.o_proj": Int4Linear,
    "model.layers.0.mlp.gate_up_proj": Int8Linear, "model.layers.0.mlp.down_proj": DenseLinear,
    "model.layers.1.self_attn.qkv_proj": Int8Linear, "model.layers.1.self_attn.o_proj": Int8Linear,
    "model.layers.1.mlp.gate_up_proj": DenseLinear, "model.layers.1.mlp.down_proj": Int4Linear,
    "lm_head": Int8Linear,
}  # fmt: skip
PROMPTS = ["The scheduler", "glowplug starts", "Numbers 0 1 2", "The quick"]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf's permute), which the loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, path: Path, types: dict[str, Any]) -> Path:
    """A llama GGUF of the tiny checkpoint in `hf_dir`: each tensor (GGUF name without `.weight`) in its type from
    `types` (F32 when absent: the norms), quantized by gguf itself; the tokenizer as a byte-level BPE."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    tensors: dict[str, np.ndarray] = {"token_embd": sd["model.embed_tokens.weight"],
                                      "output_norm": sd["model.norm.weight"], "output": sd["lm_head.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        for name, hf in _LAYER.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if name in ("attn_q", "attn_k"):
                t = _permute(t, heads if name == "attn_q" else kv_heads)
            tensors[f"blk.{i}.{name}"] = t
    for name, t in tensors.items():
        kind = types.get(name, Q.F32)
        t = np.ascontiguousarray(t, dtype=np.float32)
        if kind in (Q.F32, Q.F16):
            w.add_tensor(f"{name}.weight", t.astype(np.float16 if kind == Q.F16 else np.float32))
        else:
            w.add_tensor(f"{name}.weight", gguf.quants.quantize(t, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tiny_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_dir("llama"), tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf", MIXED)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("auto-cache")


def _start(model: Path, cache: Path, **fields: object) -> tuple[Any, Any]:
    tracing = setup_tracing()
    cfg = EngineConfig.from_flat(model=str(model), dtype="bfloat16", max_num_seqs=4, **fields)
    return build_engine(cfg, tracing=tracing, cache_dir=cache), tracing


def _attrs(tracing: Any, stage: str) -> dict[str, Any]:
    return dict(next(s for s in tracing.finished_spans() if s.name == f"glowplug.startup.{stage}").attributes)


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), AttentionMetadata.causal([len(ids)]))
        return model.compute_logits(h).float()


def _formats(model: Any) -> dict[str, type]:
    mods = dict(model.named_modules())
    return {name: type(mods[name]) for name in EXPECTED}


def test_the_plan_per_type_and_per_fused_layer() -> None:
    """A Q4_K_M-like layer (q/k Q4_K, v Q6_K, o Q4_K, gate/up Q4_K, down Q6_K) and one of every other rule: the
    fused q/k/v takes the wider int8 (re-quantized: Q4_K has no exact int8 layout), Q2_K/Q3_K re-quantize to int4,
    Q5_0 and Q8_0 repack into int8, a float part keeps its fused layer float; a tied head runs as the embedding is
    stored (Q6_K: int8, re-quantized; Q8_0: int8 repacked from the same blocks, the embedding staying float). The
    row note says it per class of tensor."""
    def entry(name: str, kind: int) -> gt.TensorEntry:
        return gt.TensorEntry(name=name, type=kind, shape=(256, 512), offset=0, nbytes=0)

    kinds = {
        "blk.0.attn_q": gt.Q4_K, "blk.0.attn_k": gt.Q4_K, "blk.0.attn_v": gt.Q6_K, "blk.0.attn_output": gt.Q4_K,
        "blk.0.ffn_gate": gt.Q4_K, "blk.0.ffn_up": gt.Q4_K, "blk.0.ffn_down": gt.Q6_K,
        "blk.1.attn_q": gt.Q5_0, "blk.1.attn_k": gt.Q8_0, "blk.1.attn_v": gt.Q8_0, "blk.1.attn_output": gt.Q2_K,
        "blk.1.ffn_gate": gt.BF16, "blk.1.ffn_up": gt.Q3_K, "blk.1.ffn_down": gt.Q5_K, "token_embd": gt.Q6_K,
    }  # fmt: skip
    table = gt.TensorTable(file_size=0, tensors=tuple(entry(f"{n}.weight", k) for n, k in kinds.items()))
    plan = plan_layers(table, quantize_head=True)
    got = {f.module: (f.scheme, f.how) for f in plan.layers}
    assert got == {
        "model.layers.0.self_attn.qkv_proj": ("int8", "re-quantized"),
        "model.layers.0.self_attn.o_proj": ("int4", "repacked"),
        "model.layers.0.mlp.gate_up_proj": ("int4", "repacked"),
        "model.layers.0.mlp.down_proj": ("int8", "re-quantized"),
        "model.layers.1.self_attn.qkv_proj": ("int8", "repacked"),
        "model.layers.1.self_attn.o_proj": ("int4", "re-quantized"),
        "model.layers.1.mlp.gate_up_proj": ("none", "de-quantized"),
        "model.layers.1.mlp.down_proj": ("int8", "re-quantized"),
        "lm_head": ("int8", "re-quantized"),  # the embedding's Q6_K: 6 bits run on int8
    }  # fmt: skip
    note = plan.note("bfloat16")
    assert ("attn_qkv Q4_K+Q6_K → int8 g32 (re-quantized; the widest of its fused parts) (attn_qkv: 1 of 2 "
            "layers)") in note
    assert "attn_output Q2_K → int4 g32 (re-quantized; no 2/3-bit kernel)" in note
    assert "ffn_gate_up BF16+Q3_K → bfloat16 (de-quantized; fused with a float part)" in note
    assert "lm_head Q6_K (tied embedding) → int8 g32 (re-quantized)" in note
    assert plan.repack() == {"model.layers.0.self_attn.o_proj": "int4", "model.layers.0.mlp.gate_proj": "int4",
                             "model.layers.0.mlp.up_proj": "int4", "model.layers.1.self_attn.q_proj": "int8",
                             "model.layers.1.self_attn.k_proj": "int8", "model.layers.1.self_attn.v_proj": "int8"}
    assert "model.embed_tokens.weight" in plan.fp32_tensors() and plan.tied_repack() is None
    assert plan_layers(table, quantize_head=False).head_scheme == "none"
    # A Q8_0 embedding: the head is its own blocks as int8 g32, and the embedding is not repacked (the lookup).
    q8 = gt.TensorTable(file_size=0, tensors=tuple(
        entry(f"{n}.weight", gt.Q8_0 if n == "token_embd" else k) for n, k in kinds.items()))  # fmt: skip
    plan8 = plan_layers(q8, quantize_head=True)
    assert plan8.tied_repack() == "int8" and "model.embed_tokens" not in plan8.repack()
    assert "model.embed_tokens.weight" not in plan8.fp32_tensors()
    assert "lm_head Q8_0 (tied embedding) → int8 g32 (repacked exactly; the embedding's blocks)" in plan8.note("bf16")


def test_group_size_with_auto_is_refused() -> None:
    from pydantic import ValidationError

    assert EngineConfig().quant.quantization == "auto"
    with pytest.raises(ValidationError, match="--group-size does not apply to quantization='auto'.*drop --group-size"):
        EngineConfig.from_flat(group_size=64)


def test_mixed_file_runs_mixed_and_none_dequantizes(mixed_gguf: Path, tiny_dir, cache: Path) -> None:
    """Eager starts: auto gives each layer its stored format (and says so on the quantize_weights row), `none` a
    dense model in the run dtype whose logits auto's follow (the exact repacks are the same weights); a safetensors
    folder under auto runs as none."""
    auto, tr = _start(mixed_gguf, cache, compile="off")
    assert _formats(auto.engine.model) == EXPECTED
    groups = {name: m.group_size for name, m in auto.engine.model.named_modules() if isinstance(m, QuantLinear)}
    assert set(groups.values()) == {32}
    attrs = _attrs(tr, "quantize_weights")
    assert attrs[Attr.QUANTIZATION] == "auto"
    assert (attrs["glowplug.auto.int4_layers"], attrs["glowplug.auto.int8_layers"],
            attrs["glowplug.auto.dense_layers"]) == (3, 4, 2)  # fmt: skip
    assert (attrs["glowplug.auto.repacked_layers"], attrs["glowplug.auto.requantized_layers"]) == (6, 1)
    note = attrs[Attr.ROW_NOTE]
    assert note.startswith("auto: ") and "attn_qkv Q4_0+Q8_0 → int8 g32 (re-quantized; the widest" in note
    assert "lm_head Q8_0 → int8 g32 (repacked exactly)" in note and "ffn_down F16 → bfloat16 (as stored)" in note

    none, tr = _start(mixed_gguf, cache, compile="off", quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in none.engine.model.modules())
    assert all(p.dtype == torch.bfloat16 for p in none.engine.model.parameters())
    assert _attrs(tr, "quantize_weights")["glowplug.skipped_reason"] == "quantization none"
    ids = list(range(3, 40))
    got, want = _logits(auto.engine.model, ids), _logits(none.engine.model, ids)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9

    # The compile entry keys on the formats the file's layers compile to (the configured "auto" does not say).
    from glowplug.engine.stages.context import EngineContext
    from glowplug.engine.stages.dynamo_transform import layer_formats

    ctx = EngineContext(config=EngineConfig.from_flat(model=str(mixed_gguf)), model_dir=auto.model_dir)
    assert layer_formats(ctx) == ("layers 0: qkv_proj int4-g32, o_proj int4-g32, gate_up_proj int8-g32, down_proj "
                                  "dense; layers 1: qkv_proj int8-g32, o_proj int8-g32, gate_up_proj dense, down_proj "
                                  "int4-g32; lm_head int8-g32")  # fmt: skip
    ctx = EngineContext(config=EngineConfig.from_flat(model=str(mixed_gguf), quantization="int4"),
                        model_dir=auto.model_dir)  # fmt: skip
    assert layer_formats(ctx) is None

    folder, tr = _start(tiny_dir("llama"), cache, compile="off")
    assert not any(isinstance(m, QuantLinear) for m in folder.engine.model.modules())
    assert _attrs(tr, "quantize_weights")["glowplug.skipped_reason"] == (
        "quantization none (auto: the checkpoint's weights are floats, run as stored)")


@pytest.mark.slow
def test_mixed_file_compiles_and_matches_eager(mixed_gguf: Path, cache: Path) -> None:
    """One compiled decode step over int4, int8 and bf16 layers (each layer format its own native op), against the
    same step eager at every step of a real generation: the same greedy tokens, logits within the int4 kernels'
    tolerance (tests/test_compile.py says where it comes from)."""
    from glowplug.kernels.native import load_native

    if not load_native(cache / "native-probe").available:
        pytest.skip("the native kernels are unavailable here (no prebuilt variant and no C++ compiler)")
    compiled, tr = _start(mixed_gguf, cache, compile="on")
    assert _formats(compiled.engine.model) == EXPECTED
    assert compiled.phase_table.seconds("graph_compile_general_shape") is not None
    runner = compiled.engine.runner
    inner = runner.decode_step
    assert inner is not None
    errors: list[float] = []
    agree: list[bool] = []

    def checked(packed: torch.Tensor) -> torch.Tensor:
        want = runner.eager_decode(packed)  # writes this step's k/v; the compiled step rewrites the same slots
        got = inner(packed)
        errors.append(float((got.float() - want.float()).abs().max() / want.float().abs().max()))
        agree.extend((got.argmax(-1) == want.argmax(-1)).tolist())
        return got

    runner.install_decode(checked, runner.decode_sizes)
    eng = compiled.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for p in PROMPTS:
        eng.add_request(p, params)
    while eng.has_unfinished():
        eng.step()
    assert len(errors) >= 11
    assert max(errors) < 0.07, errors
    assert sum(agree) / len(agree) >= 0.9, agree


@pytest.mark.slow
def test_smollm2_auto_runs_the_file_as_stored(tmp_path: Path) -> None:
    """The default model (Q4_1 projections, a Q8_0 tied embedding) under auto: the projections are exactly what
    --quantization int4 gives (the file's own Q4_1 codes), and the head is the embedding's own Q8_0 blocks as int8
    g32, whose weights equal gguf's de-quantizer's token_embd bit for bit."""
    import gguf
    import numpy as np

    from glowplug.engine.models.store import default_gguf_path

    auto, tr = _start(Path("smollm2"), tmp_path, compile="off")
    int4, _ = _start(Path("smollm2"), tmp_path, compile="off", quantization="int4")
    a, b = auto.engine.model.state_dict(), int4.engine.model.state_dict()
    projections = [k for k in b if not k.startswith("lm_head.")]
    assert all(torch.equal(a[k], b[k]) for k in projections)
    assert _attrs(tr, "quantize_weights")[Attr.ROW_NOTE] == (
        "auto: attn_qkv/attn_output/ffn_gate_up/ffn_down Q4_1 → int4 g32 (repacked exactly); lm_head Q8_0 (tied "
        "embedding) → int8 g32 (repacked exactly; the embedding's blocks)")  # fmt: skip
    reader = gguf.GGUFReader(default_gguf_path())
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    got = a["lm_head.qweight"].float() * a["lm_head.scales"].float().repeat_interleave(32, dim=1)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(embd.data, embd.tensor_type), dtype=np.float32))
    assert torch.equal(got, want.reshape(got.shape))
