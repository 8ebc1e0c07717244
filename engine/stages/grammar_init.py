"""Build the tokenizer's grammar view (llguidance's), so that the first constrained request does not pay for it."""

from __future__ import annotations

from glowplug.engine.structured import GrammarBackend, tokenizer_json
from glowplug.engine.tokenizer import eos_token_ids
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

# Why the row has no cache: the view is a Rust object llguidance cannot write out or read back.
NOT_CACHED = "not cached: llguidance's tokenizer view cannot be serialized, so every start builds it"


class GrammarInit:
    """The grammar backend (engine/structured.py) with its tokenizer view built: a walk over every token's bytes,
    0.5 s at a 49k vocabulary and ~1.8 s at 151k. It needs only the tokenizer and the architecture, so it runs on
    its own thread beside the weight and compile stages (llguidance holds the GIL while it builds the view, so it
    delays those stages' Python by about as long; their native work goes on). `--no-structured-outputs` skips it,
    and the engine then refuses constrained requests."""

    name = "grammar_init"
    needs: tuple[str, ...] = ("tokenizer", "arch", "model_dir")
    # Written only when structured outputs are on; skipped, the slot stays None (no constrained decoding).
    provides: tuple[str, ...] = ("grammar",)

    def run(self, ctx: EngineContext) -> StageReport:
        if not ctx.config.structured_outputs:
            return StageReport.skipped("skipped: --no-structured-outputs (constrained requests are refused)")
        tokenizer = ctx.need(ctx.tokenizer, "the tokenizer", "tokenizer_init")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        model_dir = ctx.need(ctx.model_dir, "the model folder", "model_prepare")
        backend = GrammarBackend(
            tokenizer_json(tokenizer), arch.vocab_size, sorted(eos_token_ids(tokenizer, arch, model_dir))
        )
        backend.prepare()
        ctx.grammar = backend
        return StageReport(attributes={Attr.VOCAB_SIZE: arch.vocab_size, Attr.ROW_NOTE: NOT_CACHED})
