"""scripts/synthetic_checkpoint.py: published shapes as transformers builds them, and small ones that load, generate
and give transformers' logits (the oracle) through glowplug's public API."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("synthetic_checkpoint", ROOT / "scripts" / "synthetic_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through the module's entry
    spec.loader.exec_module(module)
    return module


syn = _script()
PUBLISHED = ("qwen-4b", "llama2-13b", "llama3-8b")


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_dir: Path) -> Path:
    return smollm2_dir


@pytest.mark.parametrize("shape", PUBLISHED)
def test_published_shapes_are_what_transformers_builds_from_their_config(
    shape: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The config round-trips through AutoConfig, and the tensors the writer lays out are, name for name and shape
    for shape, the state dict transformers builds from it (on the meta device: no memory), less a tied head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from glowplug.engine.models.arch import parse_hf_config

    config = syn.checkpoint_config(shape, tokenizer_dir)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    published = syn.SHAPES[shape]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rms_norm_eps",
    ):
        assert getattr(hf, key) == published[key], key
    assert hf.model_type == published["model_type"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if hf.tie_word_embeddings:
        want.pop("lm_head.weight")
    plan = syn.tensor_plan(config)
    assert {t.name: t.shape for t in plan} == want
    assert len(plan) == len(want)
    # glowplug reads the same architecture: its parameter count (its own formula) is the plan's.
    arch = parse_hf_config(config, tmp_path / "config.json")
    assert arch.num_params == sum(t.nbytes for t in plan) // 2
    assert arch.qk_norm == (shape == "qwen-4b") and arch.tie_word_embeddings == published["tie_word_embeddings"]


@pytest.fixture(scope="module")
def tiny(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both small shapes, in shards of a few MB (the index path), with weights wide enough (std 0.2) that greedy
    tokens are not near-ties."""
    out = {}
    for shape in ("tiny-qwen3", "tiny-llama"):
        folder = tmp_path_factory.mktemp(shape) / "model"
        syn.write_checkpoint(folder, shape, tokenizer=tokenizer_dir, device="cpu", max_shard_bytes=3_000_000, std=0.2)
        out[shape] = folder
    return out


def test_the_files_are_safetensors_as_the_library_reads_them(tiny: dict[str, Path]) -> None:
    from safetensors import safe_open

    folder = tiny["tiny-qwen3"]
    index = json.loads((folder / syn.INDEX).read_text())
    plan = syn.tensor_plan(json.loads((folder / "config.json").read_text()))
    assert set(index["weight_map"]) == {t.name for t in plan}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in plan)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    seen = {}
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                seen[name] = f.get_tensor(name)
    for spec in plan:
        t = seen[spec.name]
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == spec.shape
        if spec.norm:
            assert bool((t == 1).all()), spec.name
        else:
            assert 0.15 < float(t.float().std()) < 0.25, spec.name
    for name in syn.TOKENIZER_FILES:
        if (syn.default_tokenizer_dir() / name).is_file():
            assert (folder / name).read_bytes() == (syn.default_tokenizer_dir() / name).read_bytes()


@pytest.mark.parametrize("shape", ["tiny-qwen3", "tiny-llama"])
def test_a_small_shape_loads_generates_and_gives_transformers_logits(shape: str, tiny: dict[str, Path]) -> None:
    """`LLM` (model_prepare, load_weights, ... as any start) generates greedily with logprobs; transformers, fed the
    same prompt and glowplug's tokens, puts the same log-probability on each token and picks it too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from glowplug.engine.llm import LLM
    from glowplug.engine.sampling_params import SamplingParams

    folder = tiny[shape]
    llm = LLM(str(folder), dtype="float32", compile="off")
    assert llm.startup.arch.vocab_size == syn.SHAPES[shape]["vocab_size"]
    out = llm.generate(
        ["The scheduler mixes prefill chunks"],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1),
    )[0]
    prompt, tokens = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    assert len(tokens) == 10
    assert prompt == AutoTokenizer.from_pretrained(folder)("The scheduler mixes prefill chunks")["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(ref(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    for i, (token, lp) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        row = logp[len(prompt) - 1 + i]
        assert int(row.argmax()) == token, i
        assert abs(float(row[token]) - lp.logprob) < 1e-4, i


def test_a_tokenizer_larger_than_the_vocabulary_is_cut_to_fit(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama-2-13b's vocabulary is smaller than SmolLM2's tokenizer: the tokenizer is cut to the model's ids and still
    encodes any text (byte-level BPE), which the model then generates from."""
    from tokenizers import Tokenizer

    from glowplug.engine.llm import LLM
    from glowplug.engine.sampling_params import SamplingParams

    monkeypatch.setitem(syn.SHAPES, "small-vocab", {**syn.SHAPES["tiny-llama"], "vocab_size": 1000})
    folder = tmp_path / "m"
    syn.write_checkpoint(folder, "small-vocab", tokenizer=tokenizer_dir, device="cpu", std=0.2)
    cut, full = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (folder, tokenizer_dir))
    assert cut.get_vocab_size(with_added_tokens=True) == 1000
    text = "Ünïcödé text, emoji 🚀 and 你好世界: the scheduler mixes prefill chunks <|im_end|>"
    ids = cut.encode(text).ids
    assert max(ids) < 1000 and len(ids) > len(full.encode(text).ids)
    assert cut.decode(ids, skip_special_tokens=False) == full.decode(full.encode(text).ids, skip_special_tokens=False)
    out = LLM(str(folder), dtype="float32", compile="off").generate(
        [text], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 4 and max(out.outputs[0].token_ids) < 1000
