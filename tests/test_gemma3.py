"""Gemma 3 (gemma3 GGUF / gemma3_text): config, tokenizer, sliding-window attention and logits against transformers.

The tiny tests run a random gemma3_text checkpoint whose window is 8 keys, so every path that applies a window
(cache-less prefill, chunked prefill over the cache, eager and compiled decode) is crossed within a few tokens. The
slow tests run gemma-3-270m Q4_K_M (the `gemma3_gguf` fixture: `glowplug models fetch gemma3-270m`) against
transformers reading the same GGUF, with a prompt longer than its 512-key window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from glowplug.engine.attention import AttentionMetadata, decode_attention
from glowplug.engine.kv_cache import LayerKV
from glowplug.engine.models.arch import ModelArch, load_arch, parse_hf_config
from glowplug.engine.models.gguf_meta import build_config, sentencepiece_merges
from glowplug.engine.models.loader import load_model
from glowplug.engine.sampling_params import SamplingParams

# Long enough (about 700 tokens) that the 270m model's sliding-window layers (512 keys) drop the prompt's start.
LONG_PROMPT = (
    " ".join(
        f"Step {i}: the scheduler mixes prefill chunks and decode steps, and block {i} of the cache holds sixteen "
        "tokens."
        for i in range(30)
    )
    + " In summary, the scheduler"
)


class _Field:
    def __init__(self, value: Any) -> None:
        self._value = value

    def contents(self) -> Any:
        return self._value


class _Reader:
    """The `fields` mapping build_config reads, from plain values."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.fields = {k: _Field(v) for k, v in values.items()}


def _gemma3_header(**extra: Any) -> dict[str, Any]:
    return {
        "general.architecture": "gemma3",
        "gemma3.context_length": 32768,
        "gemma3.embedding_length": 640,
        "gemma3.block_count": 18,
        "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.attention.sliding_window": 512,
        "tokenizer.ggml.tokens": ["<pad>"] * 262144,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        **extra,
    }


def test_gguf_header_maps_to_the_gemma3_architecture() -> None:
    path = Path("gemma.gguf")
    cfg = build_config(_Reader(_gemma3_header()), path, tied=True)
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    arch = parse_hf_config(cfg, path)
    assert arch.model_type == "gemma3" and arch.gemma_norms and arch.qk_norm and arch.tie_word_embeddings
    assert (arch.hidden_act, arch.query_pre_attn_scalar, arch.rope_theta, arch.rope_local_theta) == (
        "gelu_pytorch_tanh",
        256.0,
        1e6,
        1e4,
    )
    # Every 6th layer full, the others a 512-key window.
    assert [arch.layer_window(i) for i in range(12)] == [512] * 5 + [None] + [512] * 5 + [None]
    # The window is applied per layer, so it does not cap the context as Mistral's uniform one does.
    from glowplug.engine.kv_sizing import model_len_limit

    assert model_len_limit(arch) == 32768
    # llama.cpp's 27B rule: queries scaled by (hidden / heads) ** -0.5 there.
    big = build_config(
        _Reader(
            _gemma3_header(
                **{"gemma3.block_count": 62, "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32}
            )
        ),
        path,
        tied=True,
    )
    assert big["query_pre_attn_scalar"] == 168


def test_gemma3_config_refuses_what_it_does_not_run() -> None:
    path = Path("config.json")
    cfg = build_config(_Reader(_gemma3_header()), path, tied=True)
    for bad in (
        {"final_logit_softcapping": 30.0},
        {"use_bidirectional_attention": True},
        {"hidden_activation": "silu"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            parse_hf_config({**cfg, **bad}, path)


def test_sentencepiece_merges_match_transformers() -> None:
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "\u2581ab", "ca", "cab", "b"]
    want = generate_merges({t: i for i, t in enumerate(tokens)}, {t: -i for i, t in enumerate(tokens)})
    assert sentencepiece_merges(tokens) == want


def _tiny_arch(tiny_dir: Any) -> tuple[Path, ModelArch]:
    d = tiny_dir("gemma3")
    return d, load_arch(d)


def test_decode_window_hides_only_the_keys_before_it() -> None:
    """The compiled step's tensor path with a window equals attention over the last `window` keys alone."""
    torch.manual_seed(0)
    b, h, kvh, d, bs, width_blocks, window = 2, 4, 2, 16, 4, 5, 6
    k_cache = torch.randn(width_blocks * b + 1, bs, kvh, d)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([17, 5])  # one longer than the window, one shorter
    tables = torch.arange(width_blocks * b).reshape(b, width_blocks)
    slots = torch.stack([tables[i, (n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens.tolist())])
    packed = torch.cat(
        [torch.zeros(b, 1, dtype=torch.long), (lens - 1)[:, None], slots[:, None], lens[:, None], tables], dim=1
    )
    q, k, v = torch.randn(b, h, d), torch.randn(b, kvh, d), torch.randn(b, kvh, d)
    got = decode_attention(q, k, v, LayerKV(k_cache, v_cache, None, None), packed, 0.25, window=window)
    for i, n in enumerate(lens.tolist()):
        keys = k_cache[tables[i]].flatten(0, 1)[max(0, n - window) : n]
        values = v_cache[tables[i]].flatten(0, 1)[max(0, n - window) : n]
        qs = q[i].reshape(kvh, h // kvh, d)
        probs = (torch.einsum("kgd,tkd->kgt", qs, keys) * 0.25).softmax(-1)
        want = torch.einsum("kgt,tkd->kgd", probs, values).reshape(h, d)
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_sliding_layers_switch_to_native_attention_too(tiny_dir: Any) -> None:
    """The native decode attention op takes the window (tests/kernels/test_native_attention.py checks it), so the
    sliding layer switches like the full one and reports no fallback."""
    d, arch = _tiny_arch(tiny_dir)
    model, _ = load_model(d, arch, torch.float32, "cpu", 64)
    switches = [layer.self_attn.enable_native(16, torch.float32) for layer in model.model.layers]
    assert [(s.kind, s.switched, s.fallback) for s in switches] == [("attention", True, "")] * 2
    assert [(layer.self_attn.window, layer.self_attn.native_attention) for layer in model.model.layers] == [
        (8, True),
        (None, True),
    ]


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _hf_greedy(where: str, prompt_ids: list[int], n: int, **kw: str) -> list[int]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    with torch.inference_mode():
        out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def test_tiny_greedy_across_the_window_matches_transformers(tiny_dir: Any, make_llm: Any) -> None:
    """Prompt and output both longer than the 8-key window, blocks of 4: the eager prefill (whole and chunked over
    the cache) and the eager decode against transformers' generate."""
    d, _ = _tiny_arch(tiny_dir)
    prompt = "The scheduler mixes prefill chunks and decode steps in one batch"
    whole = make_llm(d, compile="off", dtype="float32", cache={"block_size": 4}, num_gpu_blocks_override=64)
    ids = whole.tokenizer(prompt)["input_ids"]
    assert len(ids) > 8
    got = whole.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert got == _hf_greedy(str(d), ids, GREEDY.max_tokens)
    chunked = make_llm(
        d,
        compile="off",
        dtype="float32",
        cache={"block_size": 4},
        num_gpu_blocks_override=64,
        scheduler={"max_num_batched_tokens": 16},
    )
    assert chunked.generate([prompt * 2, "A"], GREEDY)[0].outputs[0].token_ids == (
        whole.generate([prompt * 2], GREEDY)[0].outputs[0].token_ids
    )


@pytest.mark.slow  # Inductor compiles the tiny model's step (two layer variants)
def test_tiny_compiled_decode_equals_eager(tiny_dir: Any, make_llm: Any, tmp_path: Path) -> None:
    """The compiled step with both layers on the native decode attention (the sliding one given its 8-key window),
    batch 4 with rows of different lengths, then batch 1, 20 tokens each, far past the window: eager's greedy tokens.
    Blocks of 4, so windows start mid-block and a 16-token tile of the op spans four blocks."""
    from glowplug.kernels.native import load_native
    from glowplug.profiling.names import Attr

    d, _ = _tiny_arch(tiny_dir)
    prompts = [
        "The scheduler mixes prefill chunks and decode steps in one batch",
        "A",
        "emoji 🚀 and more text",
        "One two three four five six seven eight nine ten eleven twelve thirteen fourteen",
    ]
    common: dict[str, Any] = dict(dtype="float32", cache={"block_size": 4}, num_gpu_blocks_override=64)
    eager_llm = make_llm(d, compile="off", **common)
    eager = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, GREEDY)]
    alone = eager_llm.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids
    compiled = make_llm(d, compile="on", **common)
    if load_native(tmp_path / "native").available:
        row = next(r for r in compiled.startup.phase_table.rows if r.name == "native_kernels")
        assert row.attributes["glowplug.native_attention_layers"] == 2, row.attributes
        assert Attr.NATIVE_FALLBACK not in row.attributes, row.attributes[Attr.NATIVE_FALLBACK]
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, GREEDY)] == eager
    assert compiled.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids == alone


# -- the real model -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_dir(gemma3_gguf: Path) -> Path:
    from glowplug.engine.models.store import resolve_model

    return resolve_model(str(gemma3_gguf), quiet=True)


@pytest.fixture(scope="module")
def hf_gemma(gemma3_gguf: Path) -> Any:
    from transformers import AutoModelForCausalLM

    path = gemma3_gguf
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_tokenizer_matches_transformers(gemma_dir: Path, gemma3_gguf: Path) -> None:
    from transformers import AutoTokenizer

    from glowplug.engine.tokenizer import load_tokenizer

    path = gemma3_gguf
    ours, ref = load_tokenizer(gemma_dir), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ours.backend.to_str() == ref.backend_tokenizer.to_str()
    for text in (
        "The capital of France is",
        "  hello   world\n\nfoo\tbar",
        "Ünïcödé 🚀 你好世界",
        "<start_of_turn>user\nhi<end_of_turn>",
        LONG_PROMPT,
    ):
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_fp32_logits_match_transformers_past_the_window(gemma_dir: Path, hf_gemma: Any) -> None:
    from glowplug.engine.tokenizer import load_tokenizer

    ids = load_tokenizer(gemma_dir)(LONG_PROMPT)["input_ids"]
    assert len(ids) > 600  # past the 512-key window of the sliding layers
    arch = load_arch(gemma_dir)
    model, _ = load_model(gemma_dir, arch, torch.float32, "cpu", 2048)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), AttentionMetadata.causal([len(ids)]))
        ours = model.compute_logits(hidden)
        want = hf_gemma(torch.tensor([ids])).logits[0]
    diff = float((ours - want).abs().max())
    print(f"max |logit diff| over {len(ids)} positions: {diff:.3g}")
    torch.testing.assert_close(ours, want, atol=2e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_greedy_tokens_match_transformers(gemma3_gguf: Path, hf_gemma: Any, make_llm: Any, compile_mode: str) -> None:
    """32 greedy tokens after a prompt longer than the window: the engine (eager, then the compiled step with the
    native kernels on every layer, the sliding ones' windows in the native attention op) against transformers'
    generate."""
    path = gemma3_gguf
    # The file's weights de-quantized, as transformers runs them: --quantization auto would run its Q4_K and Q5_0
    # tensors in glowplug's integer kernels, whose other rounding is the accuracy report's subject, not this test's.
    llm = make_llm(str(path), compile=compile_mode, dtype="float32", max_model_len=2048, quantization="none")
    if compile_mode == "on":  # every layer's decode attention on the native op where it loaded, none left out
        row = next(r for r in llm.startup.phase_table.rows if r.name == "native_kernels")
        if "glowplug.native_attention_layers" in row.attributes:
            assert row.attributes["glowplug.native_attention_layers"] == 18, row.attributes
            assert "glowplug.native_fallback" not in row.attributes, row.attributes
    ids = llm.tokenizer(LONG_PROMPT)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = llm.generate([LONG_PROMPT], params)[0].outputs[0].token_ids
    with torch.inference_mode():
        out = hf_gemma.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert got == out[0, len(ids) :].tolist()
