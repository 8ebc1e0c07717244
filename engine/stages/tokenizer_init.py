"""Load the tokenizer (and its chat template) from the model folder."""

from __future__ import annotations

from glowplug.engine.tokenizer import load_tokenizer
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport


class TokenizerInit:
    name = "tokenizer_init"
    # Only the model folder: the tokenizer loads alongside the weights.
    needs: tuple[str, ...] = ("model_dir",)
    provides: tuple[str, ...] = ("tokenizer",)

    def run(self, ctx: EngineContext) -> StageReport:
        ctx.tokenizer = load_tokenizer(ctx.need(ctx.model_dir, "the model folder", "model_prepare"))
        # Computed here, beside the weights' load, and sent to the server with READY: its first large prompt would
        # otherwise pay for it while holding the GIL.
        ctx.tokenizer.shape  # noqa: B018
        return StageReport(
            attributes={
                Attr.VOCAB_SIZE: len(ctx.tokenizer),
                Attr.CHAT_TEMPLATE: bool(getattr(ctx.tokenizer, "chat_template", None)),
            }
        )
