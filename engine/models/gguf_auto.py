"""`--quantization auto`: each projection of a GGUF runs in the format its stored blocks map onto.

In place (on the CPU, one rank): a layer whose parts are all of a type with a native kernel (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K, Q6_K, floats beside them) is computed on the stored blocks themselves (kernels/gguf.py): nothing is
de-quantized, repacked or cached, and a decode step reads the file's bytes per weight. The embedding too (its rows
de-quantized per lookup), and a tied head reads the embedding's blocks. A layer of another type (Q2_K, Q3_K), and
every layer where in place does not apply (a GPU, tensor parallelism), follows the rules below.

Per GGUF type (the bits it stores decide the kernel, so a file runs at the speed and precision it was made for):
- 4-bit blocks -> int4, groups of 32: Q4_0, Q4_1 and Q4_K repacked exactly (gguf_tensors.repack_int4: the file's
  codes and grid); Q2_K and Q3_K, for which glowplug has no 2/3-bit kernel, re-quantized to int4 g32 from their
  de-quantized weights (their 16-weight grid does not fit int4's 32-weight groups);
- 5- to 8-bit blocks -> int8, groups of 32: Q8_0 and Q5_0 repacked exactly (repack_int8); Q5_1, Q5_K and Q6_K
  re-quantized (their offsets or 16-weight scales have no exact int8 layout);
- floats (F32, F16, BF16) -> the model dtype, as they are.

A fused projection (q/k/v into qkv_proj, gate/up into gate_up_proj: models/llama.py FUSED_MODULES) is one layer
and takes one format: the widest of its parts' (int4 < int8 < float), so no part loses precision to the fusion.
Its parts are repacked exactly only when every part's type repacks into that format; otherwise all of them are
de-quantized and the fused layer is re-quantized (or, for float, kept in the model dtype) as a whole, since the
fused tensor is quantized on the fused state dict.

The output head: an untied one (output.weight) follows its own type like any projection. A tied head has no
matrix of its own: the embedding doubles as it, and with `quantize_lm_head` it runs as the embedding's blocks are
stored (`_tied_head`): SmolLM2's Q8_0 embedding gives an int8 g32 head repacked exactly from the same blocks, while
the embedding is de-quantized for the lookup. (--quantization int4 instead re-quantizes the head to int4.)

The plan depends only on the prepared folder's tensor table (and quantize_lm_head), so every stage derives the
same plan from it, including the cache probes that run before any stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from glowplug.base import ggml
from glowplug.kernels.gguf import fits

from .gguf_tensors import TensorEntry, TensorTable, hf_name

Scheme = Literal["gguf", "int4", "int8", "none"]
How = Literal["in place", "repacked", "re-quantized", "as stored", "de-quantized"]

# The group size of every quantized layer under auto: the legacy blocks and Q4_K/Q5_K's sub-blocks are 32
# weights; re-quantized layers take the same so a fused layer's parts and its kernels agree.
AUTO_GROUP = 32
_SCHEME_OF: dict[int, Scheme] = {
    ggml.Q4_0: "int4",
    ggml.Q4_1: "int4",
    ggml.Q4_K: "int4",
    ggml.Q2_K: "int4",
    ggml.Q3_K: "int4",
    ggml.Q5_0: "int8",
    ggml.Q5_1: "int8",
    ggml.Q5_K: "int8",
    ggml.Q6_K: "int8",
    ggml.Q8_0: "int8",
    ggml.F32: "none",
    ggml.F16: "none",
    ggml.BF16: "none",
}
# Types whose blocks are taken as they are into the scheme's g32 layout (gguf_tensors.repack_int4/int8).
_EXACT: dict[Scheme, frozenset[int]] = {
    "int4": frozenset({ggml.Q4_0, ggml.Q4_1, ggml.Q4_K}),
    "int8": frozenset({ggml.Q8_0, ggml.Q5_0}),
}
_WIDTH: dict[Scheme, int] = {"gguf": 0, "int4": 1, "int8": 2, "none": 3}
# The layer classes of one decoder layer: (class name in the row note, model module suffix, checkpoint parts).
_CLASSES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("attn_qkv", "self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("attn_output", "self_attn.o_proj", ("self_attn.o_proj",)),
    ("ffn_gate_up", "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ("ffn_down", "mlp.down_proj", ("mlp.down_proj",)),
)
HEAD = "lm_head"
EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class LayerFormat:
    """One layer of the model (fused names: `model.layers.3.self_attn.qkv_proj`, `lm_head`) and what it becomes.

    parts: the checkpoint tensors (Hugging Face names, `.weight`) it is made from; sources: their GGUF types, in
    the same order; size: its weights (N x K). why: what the row note adds to `how` ("" when `how` says it all)."""

    module: str
    kind: str
    scheme: Scheme
    parts: tuple[str, ...]
    sources: tuple[str, ...]
    how: How
    size: int
    why: str = ""

    @property
    def group_size(self) -> int | None:
        return None if self.scheme in ("none", "gguf") else AUTO_GROUP

    @property
    def spec(self) -> str:
        """The kernel format: `gguf Q4_K+Q6_K` (the stored types, in place), `int4-g32`, `int8-g32`, or `dense`
        (the model dtype)."""
        if self.scheme == "gguf":
            return "gguf " + "+".join(s.removesuffix(" (tied embedding)") for s in self.sources)
        return "dense" if self.scheme == "none" else f"{self.scheme}-g{AUTO_GROUP}"


@dataclass(frozen=True)
class LayerFormats:
    """The plan of one model under auto: every projection layer (and the head) with its format."""

    layers: tuple[LayerFormat, ...]
    num_layers: int
    # The embedding is looked up from its stored blocks (its type has a native kernel and the plan runs in place).
    embedding_in_place: bool = False

    def scheme_of(self, module: str) -> Scheme | None:
        """The scheme of a model module (fused name), None for a module the plan does not cover."""
        return self._by_module.get(module)

    @cached_property
    def _by_module(self) -> dict[str, Scheme]:
        # Asked once per linear layer per scheme by model_init's converter; built once.
        return {f.module: f.scheme for f in self.layers}

    @property
    def quantized(self) -> bool:
        """Whether any layer runs on a quantized kernel (else the model runs as `none` would run it)."""
        return any(f.scheme != "none" for f in self.layers)

    @property
    def head_scheme(self) -> Scheme:
        return next((f.scheme for f in self.layers if f.module == HEAD), "none")

    def schemes(self) -> list[Scheme]:
        """The schemes a converter makes (int4, int8), narrowest first: not the layers run in place, which
        model_init builds from the stored tensors."""
        return sorted({f.scheme for f in self.layers if f.scheme not in ("none", "gguf")}, key=_WIDTH.__getitem__)

    def in_place(self) -> dict[str, LayerFormat]:
        """Model modules (fused names) computed on their stored blocks -> their format."""
        return {f.module: f for f in self.layers if f.scheme == "gguf"}

    def stored_parts(self) -> frozenset[str]:
        """Checkpoint tensors (Hugging Face names) load_weights keeps as stored rows instead of loading: the parts
        of the layers run in place, and the embedding when it is looked up in place (a tied head's part is the
        embedding)."""
        parts = {p for f in self.layers if f.scheme == "gguf" for p in f.parts}
        return frozenset(parts | ({EMBEDDING} if self.embedding_in_place else set()))

    def repack(self) -> dict[str, str]:
        """Checkpoint modules (Hugging Face names) that load_weights repacks exactly -> their scheme. A tied head
        is not one of them: its blocks are the embedding's, which also stays float for the lookup (`tied_repack`)."""
        return {
            p.removesuffix(".weight"): f.scheme
            for f in self.layers
            if f.how == "repacked" and f.parts != (EMBEDDING,)
            for p in f.parts
        }

    def tied_repack(self) -> str | None:
        """The scheme a tied head is repacked into from the embedding's own blocks, else None."""
        head = next((f for f in self.layers if f.module == HEAD), None)
        return head.scheme if head is not None and head.how == "repacked" and head.parts == (EMBEDDING,) else None

    def requantize(self) -> dict[str, Scheme]:
        """Model modules (fused names) that quantize_weights quantizes from de-quantized weights -> their scheme."""
        return {f.module: f.scheme for f in self.layers if f.how == "re-quantized"}

    def fp32_tensors(self) -> frozenset[str]:
        """Checkpoint tensors to load in fp32 whatever the model dtype: the quantizer's inputs (the parts of the
        re-quantized layers, and the embedding a tied head is quantized from), so the result does not depend on
        the serving dtype's rounding."""
        return frozenset(p for f in self.layers if f.how == "re-quantized" for p in f.parts)

    def counts(self) -> dict[str, int]:
        """Layers per kernel format and per way in (the quantize_weights row's attributes)."""
        out = {"gguf": 0, "int4": 0, "int8": 0, "dense": 0, "in place": 0, "repacked": 0, "re-quantized": 0}
        for f in self.layers:
            out["dense" if f.scheme == "none" else f.scheme] += 1
            if f.how in ("in place", "repacked", "re-quantized"):
                out[f.how] += 1
        return out

    def signature(self) -> str:
        """The kernel format of every layer, compactly (a compile and KV-profile factor: the graph holds one op per
        layer format). Runs of identical decoder layers are one entry: `layers 0-29: qkv int4-g32, ...; lm_head
        int4-g32`."""
        per_layer: list[str] = []
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            per_layer.append(
                ", ".join(
                    f"{f.module.removeprefix(prefix).rsplit('.', 1)[-1]} {f.spec}"
                    for f in self.layers
                    if f.module.startswith(prefix)
                )
            )
        runs: list[str] = []
        start = 0
        for i in range(1, self.num_layers + 1):
            if i == self.num_layers or per_layer[i] != per_layer[start]:
                span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                runs.append(f"layers {span}: {per_layer[start]}")
                start = i
        head = next((f for f in self.layers if f.module == HEAD), None)
        return "; ".join(runs + ([f"lm_head {head.spec}"] if head is not None else []))

    def note(self, dtype: str) -> str:
        """The row note: per class of tensor (attn_qkv, ffn_down, lm_head, ...), what its stored types became, with
        how many layers when a class is split between formats (`ffn_down Q6_K → int8 g32 (re-quantized) (ffn_down:
        12 of 30 layers)`)."""
        groups: dict[tuple[str, str, str], dict[str, int]] = {}
        for f in self.layers:
            stored = "+".join(dict.fromkeys(f.sources))
            target = (
                dtype if f.scheme == "none" else "stored blocks" if f.scheme == "gguf" else f"{f.scheme} g{AUTO_GROUP}"
            )
            how = {"repacked": "repacked exactly"}.get(f.how, f.how) + (f"; {f.why}" if f.why else "")
            classes = groups.setdefault((stored, target, how), {})
            classes[f.kind] = classes.get(f.kind, 0) + 1
        totals: dict[str, int] = {}
        for f in self.layers:
            totals[f.kind] = totals.get(f.kind, 0) + 1
        parts = []
        for (stored, target, how), classes in groups.items():
            split = [n for n, c in classes.items() if c != totals[n]]
            names = "/".join(classes)
            where = "".join(f" ({n}: {classes[n]} of {totals[n]} layers)" for n in split)
            parts.append(f"{names} {stored} → {target} ({how}){where}")
        if self.embedding_in_place:
            parts.append("token_embd looked up from its stored blocks")
        return "auto: " + "; ".join(parts)


def _part_entries(
    entries: Mapping[str, TensorEntry], layer: str, parts: tuple[str, ...]
) -> list[tuple[str, TensorEntry]] | None:
    found = [(f"{layer}.{p}.weight", entries.get(f"{layer}.{p}.weight")) for p in parts]
    if any(e is None or len(e.shape) != 2 for _, e in found):
        return None  # not a projection this plan can place: check_state_dict names what is wrong with the file
    return [(n, e) for n, e in found if e is not None]


def _layer(module: str, kind: str, found: list[tuple[str, TensorEntry]], in_place: bool = False) -> LayerFormat:
    """The format of one (possibly fused) layer from its parts' types: in place when allowed and every part has a
    kernel there (some part quantized: an all-float layer runs dense as stored)."""
    names = tuple(n for n, _ in found)
    sources = tuple(ggml.TYPE_NAMES[e.type] for _, e in found)
    size = sum(e.shape[0] * e.shape[1] for _, e in found)
    if in_place and all(fits(e.type, e.shape[1]) for _, e in found) and any(e.type in ggml.IN_PLACE for _, e in found):
        return LayerFormat(module, kind, "gguf", names, sources, "in place", size)
    schemes = [_SCHEME_OF[e.type] for _, e in found]
    scheme = max(schemes, key=_WIDTH.__getitem__)
    mixed = len(set(schemes)) > 1
    if scheme == "none":
        quantized_parts = any(s != "none" for s in schemes)
        how: How = "de-quantized" if quantized_parts else "as stored"
        return LayerFormat(
            module, kind, scheme, names, sources, how, size, "fused with a float part" if quantized_parts else ""
        )
    if all(e.type in _EXACT[scheme] for _, e in found):
        return LayerFormat(module, kind, scheme, names, sources, "repacked", size)
    if mixed:
        why = "the widest of its fused parts"
    elif scheme == "int4" and any(e.type in (ggml.Q2_K, ggml.Q3_K) for _, e in found):
        why = "no 2/3-bit kernel"
    else:
        why = ""
    return LayerFormat(module, kind, scheme, names, sources, "re-quantized", size, why)


def plan_layers(table: TensorTable, quantize_head: bool, in_place: bool = False) -> LayerFormats:
    """The auto plan of a prepared GGUF's tensor table (see the module docstring for the rules); `in_place`: the
    run can compute on the stored blocks (the CPU, one rank)."""
    entries = {name: e for e in table.tensors if (name := hf_name(e.name)) is not None}
    indices = sorted({int(n.split(".")[2]) for n in entries if n.startswith("model.layers.")})
    layers: list[LayerFormat] = []
    for i in indices:
        layer = f"model.layers.{i}"
        for kind, suffix, parts in _CLASSES:
            found = _part_entries(entries, layer, parts)
            if found is not None:
                layers.append(_layer(f"{layer}.{suffix}", kind, found, in_place))
    head = entries.get(f"{HEAD}.weight")
    embedding = entries.get(EMBEDDING)
    if head is not None and len(head.shape) == 2:
        fmt = _layer(HEAD, "lm_head", [(f"{HEAD}.weight", head)], in_place and quantize_head)
        if not quantize_head and fmt.scheme != "none":
            fmt = LayerFormat(
                HEAD, "lm_head", "none", fmt.parts, fmt.sources, "de-quantized", fmt.size, "--no-quantize-lm-head"
            )
        layers.append(fmt)
    elif embedding is not None:
        layers.append(_tied_head(embedding, quantize_head, in_place))
    embedding_in_place = (
        in_place
        and embedding is not None
        and len(embedding.shape) == 2
        and embedding.type in ggml.IN_PLACE
        and fits(embedding.type, embedding.shape[1])
    )
    return LayerFormats(tuple(layers), len(indices), embedding_in_place)


def _tied_head(embedding: TensorEntry, quantize_head: bool, in_place: bool = False) -> LayerFormat:
    """A tied head runs as its blocks are stored, like every other tensor: the embedding's type decides (Q8_0 ->
    int8 repacked exactly from the embedding's own blocks, Q6_K -> int8 re-quantized, a float embedding -> the
    model dtype), and the embedding itself stays float for the lookup. Re-quantizing it into the projections'
    narrower format would round what the file did not (SmolLM2: +3% perplexity from an int4 head made from its
    Q8_0 embedding) and would have to be stored (a 21 MB cache entry for SmolLM2, the whole of a bundle's
    margin); the exact int8 head costs no store and reads about as fast (the int8 GEMV runs nearer the memory
    bound than the int4 one: reports/decode-batches.md)."""
    source = (f"{ggml.TYPE_NAMES[embedding.type]} (tied embedding)",)
    size = embedding.shape[0] * embedding.shape[1]
    if in_place and quantize_head and embedding.type in ggml.IN_PLACE and fits(embedding.type, embedding.shape[1]):
        return LayerFormat(HEAD, "lm_head", "gguf", (EMBEDDING,), source, "in place", size, "the embedding's blocks")
    scheme = _SCHEME_OF[embedding.type] if quantize_head else "none"
    if scheme == "none":
        stored = _SCHEME_OF[embedding.type] == "none"
        return LayerFormat(
            HEAD,
            "lm_head",
            "none",
            (EMBEDDING,),
            source,
            "as stored" if stored else "de-quantized",
            size,
            "" if quantize_head else "--no-quantize-lm-head",
        )
    if embedding.type in _EXACT[scheme]:
        return LayerFormat(HEAD, "lm_head", scheme, (EMBEDDING,), source, "repacked", size, "the embedding's blocks")
    why = "no 2/3-bit kernel" if embedding.type in (ggml.Q2_K, ggml.Q3_K) else ""
    return LayerFormat(HEAD, "lm_head", scheme, (EMBEDDING,), source, "re-quantized", size, why)
