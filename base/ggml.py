"""ggml's tensor types as glowplug reads them from a GGUF: ids (gguf.GGMLQuantizationType), names, and the shape of
their blocks. Plain data, no torch: the start-up planner reads a file's sizes before anything heavy is imported."""

from __future__ import annotations

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
TYPE_NAMES: dict[int, str] = {
    F32: "F32",
    F16: "F16",
    BF16: "BF16",
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q5_0: "Q5_0",
    Q5_1: "Q5_1",
    Q8_0: "Q8_0",
    Q2_K: "Q2_K",
    Q3_K: "Q3_K",
    Q4_K: "Q4_K",
    Q5_K: "Q5_K",
    Q6_K: "Q6_K",
}
# (weights, bytes) per block: ggml's GGML_QUANT_SIZES for the types read here.
BLOCKS: dict[int, tuple[int, int]] = {
    F32: (1, 4),
    F16: (1, 2),
    BF16: (1, 2),
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q8_0: (32, 34),
    Q2_K: (256, 84),
    Q3_K: (256, 110),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
}
FLOATS = frozenset({F32, F16, BF16})
# The block types the native kernels compute on in place (Q2_K and Q3_K are read, de-quantized, but have no kernel).
IN_PLACE = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K})
