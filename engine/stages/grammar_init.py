"""The grammar backend of constrained decoding, its tokenizer view built from READY on in the background (the
`prepare_grammar` hook at READY), so that neither the start nor the first constrained request waits for all of it."""

from __future__ import annotations

from glowplug.engine.structured import GrammarBackend, tokenizer_json
from glowplug.engine.tokenizer import eos_token_ids
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

# Why the row has no cache: the view is a Rust object llguidance cannot write out or read back.
NOT_CACHED = (
    "not cached: llguidance's tokenizer view cannot be serialized, so every start builds it, in the background from "
    "READY on"
)


class GrammarInit:
    """The grammar backend (engine/structured.py). Its tokenizer view (a walk over every token's bytes, 0.5 s at a
    49k vocabulary and ~1.8 s at 151k, with the GIL held all along) is built by the `prepare_grammar` hook right
    after READY on a thread of its own: built beside the other stages it held up their Python by as long, which
    made a warm start seconds slower; a constrained request that comes before it is done waits for the rest.
    `--no-structured-outputs` skips it, and the engine then refuses constrained requests."""

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
        ctx.grammar = backend
        return StageReport(attributes={Attr.VOCAB_SIZE: arch.vocab_size, Attr.ROW_NOTE: NOT_CACHED})
