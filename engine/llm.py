"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, and a streaming iterator."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .config import EngineConfig
from .layer_kernels import WeightTraffic
from .llm_engine import LLMEngine, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import encode_chat, encode_prompt

if TYPE_CHECKING:
    from glowplug.profiling.tracing import Tracing


class LLM:
    """Builds an engine through the start-up pipeline, then generates for batches of prompts.

    Keyword arguments are EngineConfig fields (e.g. `max_model_len=2048`, `dtype="bfloat16"`), or a ready
    `config=EngineConfig(...)`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        tracing: Tracing | None = None,
        **kwargs: Any,
    ) -> None:
        """tracing: the start-up's tracer provider (the CLI adds its progress display to it); default: a private
        in-memory one."""
        from .startup import build_engine

        if config is None:
            config = EngineConfig.from_flat(**({"model": model} if model else {}), **kwargs)
        elif model is not None or kwargs:
            raise ValueError("pass either config=EngineConfig(...) or keyword fields, not both")
        self.config = config
        self.startup = build_engine(config, tracing=tracing)
        self.engine: LLMEngine = self.startup.engine
        self.tokenizer = self.engine.tokenizer

    def add(
        self, prompts: Sequence[str] | str, params: SamplingParams | None = None, *, chat: bool = False
    ) -> list[str]:
        """Queue the prompts without stepping (all or none: the whole batch is validated first) and return their
        request ids in prompt order; `engine.step()` then advances them. `generate` is this plus the loop to the
        end; a benchmark that clocks each step runs the same loop itself."""
        if isinstance(prompts, str):
            prompts = [prompts]
        encoded = [encode_prompt(self.tokenizer, p, chat=chat) for p in prompts]
        # Validate the whole batch first, so a bad prompt leaves no half-added batch behind.
        for tokens in encoded:
            self.engine.validate_request(tokens, params or SamplingParams())
        return [
            self.engine.add_request(p, params, prompt_token_ids=tokens).request_id
            for p, tokens in zip(prompts, encoded)
        ]

    def weight_traffic(self) -> WeightTraffic:
        """The weight bytes one batch-1 decode step reads: the native_kernels stage's own count when the start
        made one, else the sum over `engine.layer_kernels(1)` (engine/layer_kernels.py)."""
        from glowplug.profiling.names import Attr, Row

        try:
            counted = self.startup.phase_table[Row.NATIVE_KERNELS].attributes.get(Attr.BYTES_PER_TOKEN)
        except KeyError:  # a start without that row
            counted = None
        if counted:
            return WeightTraffic(int(counted), from_start=True)
        return WeightTraffic(sum(k.weight_bytes for k in self.engine.layer_kernels(1)), from_start=False)

    def use_native_kernels(self) -> str | None:
        """Switch this engine's quantized layers to the native CPU kernels that the compiled decode step runs, as
        the native_kernels stage does (so that an eager forward inside `kernels.modules.native_kernels_in_eager()`
        computes through them; the switch is not undone). Returns the kernels' ISA level, or None where the
        kernels do not load or no quantized layer has one."""
        from glowplug.base.artifacts.cachedir import cache_dir_from_env
        from glowplug.kernels.modules import enable_native_decode
        from glowplug.kernels.native import load_native, loaded_level

        from .stages.native_kernels import DENSE_SMALL_M

        if not load_native(cache_dir_from_env()).available:
            return None
        if enable_native_decode(self.engine.model, DENSE_SMALL_M, self.startup.dtype)["quantized"] == 0:
            return None
        return loaded_level()

    def generate(
        self, prompts: Sequence[str] | str, params: SamplingParams | None = None, *, chat: bool = False
    ) -> list[RequestOutput]:
        """Run all prompts to completion in one continuous batch; results come back in prompt order."""
        order = self.add(prompts, params, chat=chat)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in order]

    def stream(
        self, prompts: Sequence[str] | str, params: SamplingParams | None = None, *, chat: bool = False
    ) -> Iterator[RequestOutput]:
        """Yield partial outputs as tokens arrive; each output's `delta` is the newly streamable text."""
        self.add(prompts, params, chat=chat)
        while self.engine.has_unfinished():
            yield from self.engine.step()

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> RequestOutput:
        tokens = encode_chat(self.tokenizer, messages)
        rid = self.engine.add_request(None, params, prompt_token_ids=tokens).request_id
        while True:
            for out in self.engine.step():
                if out.request_id == rid and out.finished:
                    return out
