"""Registry: quantize a state dict, convert a (meta) model, load with assign=True, compare with the float model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from glowplug.kernels import reference as R
from glowplug.kernels.formats import Int4Weight
from glowplug.kernels.modules import Int4Linear, QuantLinear, W8A8Linear
from glowplug.kernels.registry import LINEAR_NAMES, SCHEMES, get_scheme, is_target_module

H, I, KV = 128, 256, 64  # noqa: E741 - the intermediate size, as the model configs name it


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Qwen2-style: biases on q/k/v, none on o.
        self.q_proj = nn.Linear(H, H, bias=True)
        self.k_proj = nn.Linear(H, KV, bias=True)
        self.v_proj = nn.Linear(H, KV, bias=True)
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not real attention; just routes through every projection so each one affects the output.
        k, v = self.k_proj(x), self.v_proj(x)
        out: torch.Tensor = self.o_proj(self.q_proj(x) + torch.cat([k, v], -1))
        return out


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(H)
        self.self_attn = Attn()
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        out: torch.Tensor = x + self.mlp(x)
        return out


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, H)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.norm = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, 100, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.lm_head(self.norm(x))
        return out


def _float_model() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model.eval()


def _dequantized_model(model_q: nn.Module) -> TinyLM:
    """The float model whose projections hold exactly the dequantized weights: the oracle for the whole model."""
    ref = TinyLM().eval()
    sd = {}
    for name, mod in model_q.named_modules():
        if isinstance(mod, QuantLinear):
            w = R.dequantize(mod.packed())
            if isinstance(mod, W8A8Linear):
                w = w / mod.smooth[None, :]
            sd[f"{name}.weight"] = w
    full = dict(model_q.state_dict())
    full.update(sd)
    ref.load_state_dict({k: v for k, v in full.items() if k in ref.state_dict()}, strict=True)
    return ref


@pytest.mark.parametrize(
    ("scheme", "group_size", "tol"),
    [
        ("none", None, 1e-6),
        ("int8", None, 0.03),
        ("int8", 64, 0.03),
        ("int4", None, 0.15),
        ("int4", 32, 0.12),
        ("int2", None, 0.9),
        ("w8a8", None, 0.05),
    ],
)
def test_quantize_convert_load_forward(scheme: str, group_size: int | None, tol: float) -> None:
    model = _float_model()
    sd = model.state_dict()
    s = get_scheme(scheme)
    qsd = s.quantize_state_dict(sd, group_size=group_size, skip=lambda name: False)

    # Untouched entries are passed through as the same tensors.
    for key in (
        "embed_tokens.weight",
        "norm.weight",
        "lm_head.weight",
        "layers.0.self_attn.q_proj.bias",
        "layers.1.input_layernorm.bias",
    ):
        assert qsd[key] is sd[key]
    if scheme != "none":
        assert "layers.0.mlp.down_proj.weight" not in qsd and "layers.0.mlp.down_proj.qweight" in qsd
        assert s.weight_bytes(qsd, only_linear=True) < s.weight_bytes(sd, only_linear=True)

    with torch.device("meta"):
        skeleton = TinyLM()
    s.convert_for_runtime(skeleton, group_size=group_size)
    skeleton.load_state_dict(qsd, assign=True, strict=True)
    skeleton.eval()
    n_quant = sum(isinstance(m, QuantLinear) for m in skeleton.modules())
    targets = sum(isinstance(m, nn.Linear) and is_target_module(n) for n, m in TinyLM().named_modules())
    assert targets == 14  # 7 Hugging Face-named projections in each of the 2 layers
    assert n_quant == (0 if scheme == "none" else targets)
    assert isinstance(skeleton.lm_head, nn.Linear) and not isinstance(skeleton.lm_head, QuantLinear)

    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        exact = model(ids)
        got = skeleton(ids)
        assert got.shape == exact.shape and got.dtype == torch.float32
        # Against the float model: quantization error, bounded per scheme.
        assert ((got - exact).norm() / exact.norm()) < tol
        if scheme != "none":
            # Against the same model with dequantized weights: only kernel arithmetic (bf16) differs.
            oracle = _dequantized_model(skeleton)(ids)
            assert ((got - oracle).norm() / oracle.norm()) < 0.02


def test_skip_keeps_layers_float_on_both_sides() -> None:
    model = _float_model()
    s = get_scheme("int4")

    def skip(name: str) -> bool:
        return name.endswith("down_proj") or name.startswith("layers.1.")

    qsd = s.quantize_state_dict(model.state_dict(), group_size=64, skip=skip)
    assert "layers.0.mlp.down_proj.weight" in qsd and "layers.1.self_attn.q_proj.weight" in qsd
    assert "layers.0.mlp.up_proj.qweight" in qsd
    with torch.device("meta"):
        skeleton = TinyLM()
    s.convert_for_runtime(skeleton, group_size=64, skip=skip)
    skeleton.load_state_dict(qsd, assign=True, strict=True)
    q0 = skeleton.get_submodule("layers.0.self_attn.q_proj")
    assert isinstance(skeleton.get_submodule("layers.0.mlp.up_proj"), Int4Linear)
    assert type(skeleton.get_submodule("layers.0.mlp.down_proj")) is nn.Linear
    assert type(skeleton.get_submodule("layers.1.self_attn.q_proj")) is nn.Linear
    assert isinstance(q0, Int4Linear) and q0.group_size == 64


def test_w8a8_with_activation_stats_folds_smoothing() -> None:
    model = _float_model()
    stats = {"layers.0.mlp.down_proj": torch.rand(I) * 10 + 0.1}
    s = get_scheme("w8a8", act_absmax=stats)
    qsd = s.quantize_state_dict(model.state_dict(), group_size=None, skip=lambda n: False)
    assert not torch.all(qsd["layers.0.mlp.down_proj.smooth"] == 1)
    assert torch.all(qsd["layers.0.mlp.up_proj.smooth"] == 1)
    with torch.device("meta"):
        skeleton = TinyLM()
    s.convert_for_runtime(skeleton)
    skeleton.load_state_dict(qsd, assign=True, strict=True)
    ids = torch.randint(0, 100, (1, 5))
    with torch.inference_mode():
        exact, got = model(ids), skeleton(ids)
    assert ((got - exact).norm() / exact.norm()) < 0.05


def test_unknown_scheme_and_bad_group_sizes() -> None:
    with pytest.raises(ValueError) as e:
        get_scheme("int3")
    for name in ("none", "int8", "int4", "int2", "w8a8"):
        assert name in str(e.value)
    assert set(SCHEMES) == {"none", "int8", "int4", "int2", "w8a8"}
    sd = _float_model().state_dict()
    with pytest.raises(ValueError, match="group_size"):
        get_scheme("int2").quantize_state_dict(sd, group_size=64, skip=lambda n: False)
    with pytest.raises(ValueError, match="group_size"):
        get_scheme("w8a8").quantize_state_dict(sd, group_size=128, skip=lambda n: False)
    with pytest.raises(ValueError, match="group_size"):
        get_scheme("int4").convert_for_runtime(TinyLM(), group_size=48)


def test_bits_per_weight_and_weight_bytes() -> None:
    assert get_scheme("int4").bits_per_weight(128) == pytest.approx(4.5)  # 4 + (fp32 scale + zero) / 128
    assert get_scheme("int4", symmetric=True).bits_per_weight(128) == pytest.approx(4.25)
    assert get_scheme("int2").bits_per_weight() == pytest.approx(2.5)
    assert get_scheme("int8").bits_per_weight() == 8 and get_scheme("int8").bits_per_weight(64) == 8.5
    assert get_scheme("none").bits_per_weight() == 16
    model = _float_model()
    sd = model.state_dict()
    s = get_scheme("int4")
    qsd = s.quantize_state_dict(sd, group_size=128, skip=lambda n: False)
    n_weights = sum(
        sd[f"{name}.weight"].numel() for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in LINEAR_NAMES
    )
    assert s.weight_bytes(qsd, only_linear=True) * 8 == pytest.approx(n_weights * 4.5)
    assert s.weight_bytes(qsd) == sum(t.numel() * t.element_size() for t in qsd.values())
    w = Int4Weight(
        qsd["layers.0.mlp.up_proj.qweight"], qsd["layers.0.mlp.up_proj.scales"], qsd["layers.0.mlp.up_proj.zeros"], 128
    )
    assert w.shape == (I, H)


class OddShapes(nn.Module):
    """K=96 is not a multiple of 128 (like SmolLM2's 576), K=256 is."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(96, 64, bias=True)
        self.down_proj = nn.Linear(256, 96, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.q_proj(self.down_proj(x))
        return out


@pytest.mark.parametrize(
    ("scheme", "expected"),
    [
        ("int4", {"q_proj": 32, "down_proj": 128}),
        ("int2", {"q_proj": 32, "down_proj": 128}),
        ("int8", {"q_proj": 32, "down_proj": 128}),
    ],
)
def test_group_size_falls_back_per_layer_when_k_is_not_a_multiple(scheme: str, expected: dict[str, int]) -> None:
    torch.manual_seed(0)
    model = OddShapes().eval()
    s = get_scheme(scheme)
    qsd = s.quantize_state_dict(model.state_dict(), group_size=128, skip=lambda n: False)
    assert qsd["q_proj.scales"].shape == (64, 96 // expected["q_proj"])
    assert qsd["down_proj.scales"].shape == (96, 256 // expected["down_proj"])
    with torch.device("meta"):
        skeleton = OddShapes()
    s.convert_for_runtime(skeleton, group_size=128)
    skeleton.load_state_dict(qsd, assign=True, strict=True)
    for name, gs in expected.items():
        mod = skeleton.get_submodule(name)
        assert isinstance(mod, QuantLinear) and getattr(mod, "group_size", None) == gs
    x = torch.randn(3, 256)
    with torch.inference_mode():
        got = skeleton(x)
        down, q = skeleton.get_submodule("down_proj"), skeleton.get_submodule("q_proj")
        assert isinstance(down, QuantLinear) and isinstance(q, QuantLinear)
        oracle = R.linear(R.linear(x, down.packed()), q.packed(), qsd["q_proj.bias"])
    assert ((got - oracle).norm() / oracle.norm()) < 0.02
