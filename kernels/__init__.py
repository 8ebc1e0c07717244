"""glowplug's quantization kernels: formats, reference oracles, CPU/Triton paths, dispatcher, modules, registry.

Typical engine use (gpt-fast's split: quantize a state dict once, convert modules at load time):

    scheme = get_scheme(config.quant.quantization)          # "none" | "int8" | "int4" | "int2" | "w8a8"
    qsd = scheme.quantize_state_dict(sd, group_size=config.quant.group_size, skip=lambda name: False)
    scheme.convert_for_runtime(model_on_meta, group_size=config.quant.group_size)
    model_on_meta.load_state_dict(qsd, assign=True, strict=True)

Importing this package imports torch but not triton, and changes no global torch state.
"""

from .dispatch import Dispatcher, DispatchTable, calibrate, default_dispatcher
from .formats import dequantize_kv, quantize, quantize_kv
from .modules import QuantLinear, prepare_modules
from .registry import LINEAR_NAMES, SCHEMES, QuantScheme, get_scheme

__all__ = [
    "LINEAR_NAMES",
    "SCHEMES",
    "DispatchTable",
    "Dispatcher",
    "QuantLinear",
    "QuantScheme",
    "calibrate",
    "default_dispatcher",
    "dequantize_kv",
    "get_scheme",
    "prepare_modules",
    "quantize",
    "quantize_kv",
]
