"""The default GGUF read natively, against transformers' GGUF path (the oracle): config, logits, tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glowplug.engine.attention import AttentionMetadata
from glowplug.engine.config import EngineConfig
from glowplug.engine.models.arch import load_arch, parse_hf_config
from glowplug.engine.models.store import default_gguf_path
from glowplug.engine.stages.context import EngineContext
from glowplug.engine.stages.load_weights import LoadWeights
from glowplug.engine.stages.model_init import ModelInit
from glowplug.engine.stages.model_prepare import ModelPrepare
from glowplug.engine.stages.quantize_weights import QuantizeWeights
from glowplug.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    src = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    src = default_gguf_path()
    return AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)


@pytest.fixture(scope="module")
def ours_tok(smollm2_dir: Path):
    return load_tokenizer(smollm2_dir)


def _model(tmp_path: Path, **flags: object):
    # De-quantized unless a test asks for a scheme: transformers, the oracle, de-quantizes the GGUF too.
    flags = {"quantization": "none", **flags}
    ctx = EngineContext(config=EngineConfig.from_flat(model="smollm2", dtype="float32", **flags), cache_root=tmp_path)
    for stage in (ModelPrepare(), LoadWeights(), QuantizeWeights(), ModelInit()):
        stage.run(ctx)
    return ctx.model


@torch.inference_mode()
def _logits(model, ids: list[int]) -> torch.Tensor:
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), AttentionMetadata.causal([len(ids)]))
    return model.compute_logits(hidden).float()


def test_config_matches_transformers(smollm2_dir: Path, hf_model) -> None:
    want = parse_hf_config(hf_model.config.to_dict(), Path("hf"))
    # The oracle records the dtype it was loaded in; a block-quantized source has none of its own.
    assert load_arch(smollm2_dir) == want.model_copy(update={"torch_dtype": None})


def test_fp32_logits_match_transformers(tmp_path_factory, hf_model, hf_tok) -> None:
    ids = hf_tok(PROMPT)["input_ids"]
    got = _logits(_model(tmp_path_factory.mktemp("c")), ids)
    with torch.inference_mode():
        want = hf_model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


def test_int4_repacked_logits_follow_transformers(tmp_path_factory, hf_model, hf_tok) -> None:
    from glowplug.kernels.formats import unpack_bits

    ids = hf_tok(PROMPT)["input_ids"]
    model = _model(tmp_path_factory.mktemp("c"), quantization="int4")
    # The repacked layers hold exactly the GGUF's weights (as transformers de-quantizes them), q/k un-permuted and
    # fused: the layout's own de-quantization gives them back bit for bit.
    bufs = dict(model.named_buffers())
    hf = hf_model.state_dict()
    for layer in (0, 17):
        name = f"model.layers.{layer}.self_attn.qkv_proj"
        q = unpack_bits(bufs[f"{name}.qweight"], 4, 32).float()
        n, k = q.shape
        w = (q.reshape(n, k // 32, 32) - 8) * bufs[f"{name}.scales"][..., None] + bufs[f"{name}.zeros"][..., None]
        parts = [hf[f"model.layers.{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
        torch.testing.assert_close(w.reshape(n, k), torch.cat(parts), atol=1e-6, rtol=0)
    got = _logits(model, ids)
    with torch.inference_mode():
        want = hf_model(torch.tensor([ids])).logits[0].float()
    # Same weights; the int4 kernels run the activations in bf16, which is all that separates the logits.
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.97, cos


TEXTS = [
    "Hello 123 world",
    "  leading spaces\tand tabs\n\nnewlines",
    "Ünïcödé 🚀🔥 你好世界",
    "<|im_start|>user\nhi<|im_end|>",
    "don't 'quote' \"me\"",
    "x" * 300,
    "",
    "1234567890 3.14159 -42",
    "<|endoftext|>tail",
]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_match_transformers(ours_tok, hf_tok, text: str) -> None:
    ids = ours_tok(text)["input_ids"]
    assert ids == hf_tok(text)["input_ids"]
    for skip in (False, True):
        assert ours_tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=80)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
def test_random_text_ids_match_transformers(ours_tok, hf_tok, text: str) -> None:
    ids = ours_tok(text)["input_ids"]
    assert ids == hf_tok(text)["input_ids"]
    assert ours_tok.decode(ids) == hf_tok.decode(ids)


def test_special_tokens_match_transformers(ours_tok, hf_tok) -> None:
    assert len(ours_tok) == len(hf_tok)
    assert (ours_tok.eos_token_id, ours_tok.bos_token_id) == (hf_tok.eos_token_id, hf_tok.bos_token_id)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Ünïcödé 🚀?"},
    ],
    [{"role": "user", "content": "a\n\n  b"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours_tok, hf_tok, messages, gen: bool) -> None:
    want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == want


def test_serving_start_never_imports_transformers(smollm2_dir: Path) -> None:
    code = (
        "import sys\n"
        "from glowplug.engine.config import EngineConfig\n"
        "from glowplug.engine.startup import build_engine\n"
        "r = build_engine(EngineConfig.from_flat(model='smollm2', compile='off', max_model_len=256))\n"
        "from glowplug.engine.tokenizer import encode_chat\n"
        "encode_chat(r.engine.tokenizer, [{'role': 'user', 'content': 'hi'}])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "assert not bad, bad[:5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
