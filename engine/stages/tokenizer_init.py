"""Load the tokenizer (and its chat template) from the model folder."""

from __future__ import annotations

from ..tokenizer import load_tokenizer
from .protocol import StageReport
from .context import EngineContext


class TokenizerInit:
    name = "tokenizer_init"
    # Only the model folder: the tokenizer loads alongside the weights.
    needs: tuple[str, ...] = ("model_dir",)
    provides: tuple[str, ...] = ("tokenizer",)

    def run(self, ctx: EngineContext) -> StageReport:
        ctx.tokenizer = load_tokenizer(ctx.need(ctx.model_dir, "the model folder", "model_prepare"))
        return StageReport(
            attributes={
                "glowplug.vocab_size": len(ctx.tokenizer),
                "glowplug.chat_template": bool(getattr(ctx.tokenizer, "chat_template", None)),
            }
        )
