"""--quantization auto: a GGUF runs as stored, per layer. A mixed file (Q4_0, Q8_0 and float layers in one model),
written here from the tiny llama checkpoint with gguf's own writer and quantizer, loads with the expected per-layer
formats: on the CPU its quantized layers compute on the stored blocks in place (kernels/gguf.py), and with the native
kernels switched off (GLOWPLUG_NATIVE=0) they are repacked or re-quantized into int4/int8; it compiles and decodes as
its eager run does; `none` still de-quantizes everything; the default model's layers read the file's own bytes
(slow)."""

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
from glowplug.kernels.gguf import GGUFEmbedding, GGUFLinear
from glowplug.kernels.modules import DenseLinear, Int4Linear, Int8Linear, QuantLinear
from glowplug.profiling.names import Attr
from glowplug.profiling.tracing import setup_tracing

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# GGUF name (per layer) -> Hugging Face name, for the tensors the tiny llama holds.
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The mixed file: layer 0 int4 attention, int8 MLP in, float MLP out; layer 1 a q/k/v fused across Q4_0 and Q8_0
# (int8, the wider), gate/up fused across F16 and Q4_0 (float), int4 down; an untied Q8_0 head.
MIXED = {
    "blk.0.attn_q": Q.Q4_0,
    "blk.0.attn_k": Q.Q4_0,
    "blk.0.attn_v": Q.Q4_0,
    "blk.0.attn_output": Q.Q4_0,
    "blk.0.ffn_gate": Q.Q8_0,
    "blk.0.ffn_up": Q.Q8_0,
    "blk.0.ffn_down": Q.F16,
    "blk.1.attn_q": Q.Q4_0,
    "blk.1.attn_k": Q.Q4_0,
    "blk.1.attn_v": Q.Q8_0,
    "blk.1.attn_output": Q.Q8_0,
    "blk.1.ffn_gate": Q.F16,
    "blk.1.ffn_up": Q.Q4_0,
    "blk.1.ffn_down": Q.Q4_0,
    "output": Q.Q8_0,
    "token_embd": Q.F16,
}
EXPECTED = {
    "model.layers.0.self_attn.qkv_proj": Int4Linear,
    "model.layers.0.self_attn.o_proj": Int4Linear,
    "model.layers.0.mlp.gate_up_proj": Int8Linear,
    "model.layers.0.mlp.down_proj": DenseLinear,
    "model.layers.1.self_attn.qkv_proj": Int8Linear,
    "model.layers.1.self_attn.o_proj": Int8Linear,
    "model.layers.1.mlp.gate_up_proj": DenseLinear,
    "model.layers.1.mlp.down_proj": Int4Linear,
    "lm_head": Int8Linear,
}
# The same file in place: every layer with a quantized part computes on its stored blocks (a float part included);
# only the all-F16 down projection is dense.
IN_PLACE = {
    name: (DenseLinear if cls is DenseLinear and name != "model.layers.1.mlp.gate_up_proj" else GGUFLinear)
    for name, cls in EXPECTED.items()
}
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
    tensors: dict[str, np.ndarray] = {
        "token_embd": sd["model.embed_tokens.weight"],
        "output_norm": sd["model.norm.weight"],
        "output": sd["lm_head.weight"],
    }
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


def test_the_plan_in_place() -> None:
    """On the CPU (one rank) a layer whose parts all have a native kernel runs on its stored blocks, whatever mix of
    types it fuses (Q4_K+Q4_K+Q6_K, a float part beside quantized ones); a layer with a Q2_K/Q3_K part follows the
    repack/re-quantize rules; a tied head reads the embedding's blocks, which are looked up in place too."""

    def entry(name: str, kind: int) -> gt.TensorEntry:
        return gt.TensorEntry(name=name, type=kind, shape=(256, 512), offset=0, nbytes=0)

    kinds = {
        "blk.0.attn_q": gt.Q4_K,
        "blk.0.attn_k": gt.Q4_K,
        "blk.0.attn_v": gt.Q6_K,
        "blk.0.attn_output": gt.Q2_K,
        "blk.0.ffn_gate": gt.BF16,
        "blk.0.ffn_up": gt.Q5_0,
        "blk.0.ffn_down": gt.Q5_K,
        "blk.1.attn_q": gt.Q4_0,
        "blk.1.attn_k": gt.Q4_1,
        "blk.1.attn_v": gt.Q8_0,
        "blk.1.attn_output": gt.Q5_1,
        "blk.1.ffn_gate": gt.F16,
        "blk.1.ffn_up": gt.Q3_K,
        "blk.1.ffn_down": gt.F16,
        "token_embd": gt.Q6_K,
    }
    table = gt.TensorTable(file_size=0, tensors=tuple(entry(f"{n}.weight", k) for n, k in kinds.items()))
    plan = plan_layers(table, quantize_head=True, in_place=True)
    got = {f.module: (f.scheme, f.how) for f in plan.layers}
    assert got == {
        "model.layers.0.self_attn.qkv_proj": ("gguf", "in place"),
        "model.layers.0.self_attn.o_proj": ("int4", "re-quantized"),  # Q2_K: no kernel
        "model.layers.0.mlp.gate_up_proj": ("gguf", "in place"),  # BF16 + Q5_0
        "model.layers.0.mlp.down_proj": ("gguf", "in place"),
        "model.layers.1.self_attn.qkv_proj": ("gguf", "in place"),
        "model.layers.1.self_attn.o_proj": ("gguf", "in place"),
        "model.layers.1.mlp.gate_up_proj": ("none", "de-quantized"),  # F16 + Q3_K
        "model.layers.1.mlp.down_proj": ("none", "as stored"),
        "lm_head": ("gguf", "in place"),
    }
    assert plan.embedding_in_place
    assert "model.embed_tokens.weight" in plan.stored_parts()
    assert "model.layers.0.self_attn.v_proj.weight" in plan.stored_parts()
    assert "model.layers.0.self_attn.o_proj.weight" not in plan.stored_parts()
    assert plan.schemes() == ["int4"] and plan.repack() == {} and plan.tied_repack() is None
    assert "layers 0: qkv_proj gguf Q4_K+Q4_K+Q6_K, o_proj int4-g32" in plan.signature()
    note = plan.note("bfloat16")
    assert "attn_qkv Q4_K+Q6_K → stored blocks (in place) (attn_qkv: 1 of 2 layers)" in note
    assert "lm_head Q6_K (tied embedding) → stored blocks (in place; the embedding's blocks)" in note
    assert note.endswith("token_embd looked up from its stored blocks")
    # Without in place (a GPU, tensor parallelism, GLOWPLUG_NATIVE=0) the same file takes the repack rules.
    assert all(f.scheme != "gguf" for f in plan_layers(table, quantize_head=True).layers)


def test_the_plan_per_type_and_per_fused_layer() -> None:
    """A Q4_K_M-like layer (q/k Q4_K, v Q6_K, o Q4_K, gate/up Q4_K, down Q6_K) and one of every other rule: the
    fused q/k/v takes the wider int8 (re-quantized: Q4_K has no exact int8 layout), Q2_K/Q3_K re-quantize to int4,
    Q5_0 and Q8_0 repack into int8, a float part keeps its fused layer float; a tied head runs as the embedding is
    stored (Q6_K: int8, re-quantized; Q8_0: int8 repacked from the same blocks, the embedding staying float). The
    row note says it per class of tensor."""

    def entry(name: str, kind: int) -> gt.TensorEntry:
        return gt.TensorEntry(name=name, type=kind, shape=(256, 512), offset=0, nbytes=0)

    kinds = {
        "blk.0.attn_q": gt.Q4_K,
        "blk.0.attn_k": gt.Q4_K,
        "blk.0.attn_v": gt.Q6_K,
        "blk.0.attn_output": gt.Q4_K,
        "blk.0.ffn_gate": gt.Q4_K,
        "blk.0.ffn_up": gt.Q4_K,
        "blk.0.ffn_down": gt.Q6_K,
        "blk.1.attn_q": gt.Q5_0,
        "blk.1.attn_k": gt.Q8_0,
        "blk.1.attn_v": gt.Q8_0,
        "blk.1.attn_output": gt.Q2_K,
        "blk.1.ffn_gate": gt.BF16,
        "blk.1.ffn_up": gt.Q3_K,
        "blk.1.ffn_down": gt.Q5_K,
        "token_embd": gt.Q6_K,
    }
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
    }
    note = plan.note("bfloat16")
    assert (
        "attn_qkv Q4_K+Q6_K → int8 g32 (re-quantized; the widest of its fused parts) (attn_qkv: 1 of 2 layers)"
    ) in note
    assert "attn_output Q2_K → int4 g32 (re-quantized; no 2/3-bit kernel)" in note
    assert "ffn_gate_up BF16+Q3_K → bfloat16 (de-quantized; fused with a float part)" in note
    assert "lm_head Q6_K (tied embedding) → int8 g32 (re-quantized)" in note
    assert plan.repack() == {
        "model.layers.0.self_attn.o_proj": "int4",
        "model.layers.0.mlp.gate_proj": "int4",
        "model.layers.0.mlp.up_proj": "int4",
        "model.layers.1.self_attn.q_proj": "int8",
        "model.layers.1.self_attn.k_proj": "int8",
        "model.layers.1.self_attn.v_proj": "int8",
    }
    assert "model.embed_tokens.weight" in plan.fp32_tensors() and plan.tied_repack() is None
    assert plan_layers(table, quantize_head=False).head_scheme == "none"
    # A Q8_0 embedding: the head is its own blocks as int8 g32, and the embedding is not repacked (the lookup).
    q8 = gt.TensorTable(
        file_size=0, tensors=tuple(entry(f"{n}.weight", gt.Q8_0 if n == "token_embd" else k) for n, k in kinds.items())
    )
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
    """Eager starts: auto gives each layer its stored format (and says so on the quantize_weights row): in place by
    default, repacked with the native kernels off; `none` a dense model in the run dtype whose logits both follow;
    a safetensors folder under auto runs as none."""
    stored, tr = _start(mixed_gguf, cache, compile="off")
    assert _formats(stored.engine.model) == IN_PLACE
    assert not isinstance(stored.engine.model.model.embed_tokens, GGUFEmbedding)  # F16: looked up dense
    assert "ffn_gate_up F16+Q4_0 → stored blocks (in place)" in _attrs(tr, "quantize_weights")[Attr.ROW_NOTE]
    # every part of the in-place layers (the F16 gate beside its Q4_0 up included) and the head; not the F16 down
    assert _attrs(tr, "load_weights")[Attr.GGUF_STORED_TENSORS] == 14

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLOWPLUG_NATIVE", "0")
        auto, tr = _start(mixed_gguf, cache, compile="off")
    assert _formats(auto.engine.model) == EXPECTED
    groups = {name: m.group_size for name, m in auto.engine.model.named_modules() if isinstance(m, QuantLinear)}
    assert set(groups.values()) == {32}
    attrs = _attrs(tr, "quantize_weights")
    assert attrs[Attr.QUANTIZATION] == "auto"
    assert (
        attrs["glowplug.auto.int4_layers"],
        attrs["glowplug.auto.int8_layers"],
        attrs["glowplug.auto.dense_layers"],
    ) == (3, 4, 2)
    assert (attrs["glowplug.auto.repacked_layers"], attrs["glowplug.auto.requantized_layers"]) == (6, 1)
    note = attrs[Attr.ROW_NOTE]
    assert note.startswith("auto: ") and "attn_qkv Q4_0+Q8_0 → int8 g32 (re-quantized; the widest" in note
    assert "lm_head Q8_0 → int8 g32 (repacked exactly)" in note and "ffn_down F16 → bfloat16 (as stored)" in note

    none, tr = _start(mixed_gguf, cache, compile="off", quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in none.engine.model.modules())
    assert all(p.dtype == torch.bfloat16 for p in none.engine.model.parameters())
    assert _attrs(tr, "quantize_weights")["glowplug.skipped_reason"] == "quantization none"
    ids = list(range(3, 40))
    want = _logits(none.engine.model, ids)
    for model in (auto.engine.model, stored.engine.model):
        got = _logits(model, ids)
        assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99
        # The tiny random model's logits are nearly flat: where the argmax differs, `none`'s own top two were a near
        # tie (the in-place kernels' int8 activations move a logit by ~1% of its row's spread).
        top2 = want.topk(2, dim=-1).values
        spread = want.amax(-1) - want.amin(-1)
        differ = got.argmax(-1) != want.argmax(-1)
        assert differ.float().mean() <= 0.2
        assert bool(((top2[:, 0] - top2[:, 1])[differ] <= 0.05 * spread[differ]).all())

    # The compile entry keys on the formats the file's layers compile to (the configured "auto" does not say).
    from glowplug.engine.stages.context import EngineContext
    from glowplug.engine.stages.dynamo_transform import layer_formats

    ctx = EngineContext(config=EngineConfig.from_flat(model=str(mixed_gguf)), model_dir=auto.model_dir)
    assert layer_formats(ctx) == (
        "layers 0: qkv_proj gguf Q4_0+Q4_0+Q4_0, o_proj gguf Q4_0, gate_up_proj gguf "
        "Q8_0+Q8_0, down_proj dense; layers 1: qkv_proj gguf Q4_0+Q4_0+Q8_0, o_proj gguf "
        "Q8_0, gate_up_proj gguf F16+Q4_0, down_proj gguf Q4_0; lm_head gguf Q8_0"
    )
    ctx = EngineContext(
        config=EngineConfig.from_flat(model=str(mixed_gguf), tensor_parallel_size=2), model_dir=auto.model_dir
    )
    assert layer_formats(ctx) == (
        "layers 0: qkv_proj int4-g32, o_proj int4-g32, gate_up_proj int8-g32, down_proj "
        "dense; layers 1: qkv_proj int8-g32, o_proj int8-g32, gate_up_proj dense, down_proj "
        "int4-g32; lm_head int8-g32"
    )
    ctx = EngineContext(
        config=EngineConfig.from_flat(model=str(mixed_gguf), quantization="int4"), model_dir=auto.model_dir
    )
    assert layer_formats(ctx) is None

    folder, tr = _start(tiny_dir("llama"), cache, compile="off")
    assert not any(isinstance(m, QuantLinear) for m in folder.engine.model.modules())
    assert _attrs(tr, "quantize_weights")["glowplug.skipped_reason"] == (
        "quantization none (auto: the checkpoint's weights are floats, run as stored)"
    )


@pytest.mark.slow
def test_mixed_file_compiles_and_matches_eager(mixed_gguf: Path, cache: Path) -> None:
    """One compiled decode step over layers of mixed stored types and bf16 ones, against the same step eager at every
    step of a real generation: the same native op runs both ways; what differs is the bf16 rounding of the other ops
    (Inductor's fused norms against eager's), which the kernels' int8 activations can carry one code step further
    (the bound tests/test_compile.py derives for the int4 kernels' int8 activations)."""
    from glowplug.kernels.native import load_native

    if not load_native(cache / "native-probe").available:
        pytest.skip("the native kernels are unavailable here (no prebuilt variant and no C++ compiler)")
    compiled, tr = _start(mixed_gguf, cache, compile="on")
    assert _formats(compiled.engine.model) == IN_PLACE
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
    """The default model (Q4_1 projections, a Q8_0 tied embedding) under auto: every projection computes on the
    file's own bytes (the layer's rows are the GGUF's tensor, byte for byte, in a read-only-shared mapping of the file),
    the tied head on the embedding's very rows, and the lookup gives gguf's de-quantized rows."""
    import gguf
    import numpy as np

    from glowplug.engine.models.store import default_gguf_path

    auto, tr = _start(Path("smollm2"), tmp_path, compile="off")
    model = auto.engine.model
    reader = gguf.GGUFReader(default_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    qkv = model.model.layers[3].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear)
    for part, name in zip(qkv.parts(), ("attn_q", "attn_k", "attn_v")):
        stored = tensors[f"blk.3.{name}.weight"]
        assert part.ggml_type == int(stored.tensor_type)
        assert torch.equal(part.data.reshape(-1), torch.from_numpy(np.asarray(stored.data).reshape(-1).view(np.uint8)))
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head, GGUFLinear) and isinstance(embedding, GGUFEmbedding)
    assert head.parts()[0].data.data_ptr() == embedding.rows.data_ptr()  # one mapping, read by both
    assert _attrs(tr, "quantize_weights")[Attr.ROW_NOTE] == (
        "auto: attn_qkv/attn_output/ffn_gate_up/ffn_down Q4_1 → stored blocks (in place); lm_head Q8_0 (tied "
        "embedding) → stored blocks (in place; the embedding's blocks); token_embd looked up from its stored blocks"
    )
    embd = tensors["token_embd.weight"]
    ids = torch.tensor([0, 17, 4242, 49151])
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(embd.data, embd.tensor_type), dtype=np.float32))
    with torch.inference_mode():
        got = embedding(ids).float()
    assert torch.equal(got, want.reshape(-1, 576)[ids].to(torch.bfloat16).float())
