"""The engine in one process: an engine core (schedule -> run -> book, token ids only) and an output processor
(text, stop strings, RequestOutputs) side by side. The offline `LLM`, the start-up's warm-up and the benchmarks
drive it; the server splits the same two across processes instead (engine/core_proc.py, lifecycle/core_client.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .core import EngineCore, EngineStats, RequestStatus, StepShape
from .layer_kernels import LayerKernel, layer_kernels
from .model_runner import ModelRunner, StepTimes
from .models.llama import DecoderLM
from .outputs import CompletionOutput, OutputProcessor, RequestMetrics, RequestOutput, SeqUpdate
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .structured import GrammarBackend

__all__ = [
    "CompletionOutput",
    "EngineStats",
    "LLMEngine",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "StepShape",
]


@dataclass(slots=True)
class Request:
    """An added request: its id and the scheduler's sequences (read-only here; benchmarks watch their tokens)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        *,
        tokenizer: Any,
        runner: ModelRunner,
        scheduler: Scheduler,
        seed: int = 0,
        grammar: GrammarBackend | None = None,
    ) -> None:
        """`grammar`: constrained decoding's backend (the grammar_init stage builds it); None refuses constrained
        requests."""
        self.tokenizer = tokenizer
        self.core = EngineCore(runner, scheduler, vocab_size=len(tokenizer), seed=seed, grammar=grammar)
        self.output = OutputProcessor(tokenizer)
        self._req_ids = 0

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def model(self) -> DecoderLM:
        """The served model, for tools that evaluate it directly (the accuracy and decode benches)."""
        return self.core.runner.model

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def last_step(self) -> StepShape:
        return self.core.last_step

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step_times(self) -> StepTimes:
        """Nanoseconds spent so far inside the model call and inside the sampler, summed over the engine's life.
        Read before and after a `step()`: the step's wall time minus what both grew by is its host time (scheduling,
        the step's inputs, booking the results, the text), the part of a step that is the engine's own work."""
        return self.core.runner.step_times()

    @property
    def compiled(self) -> bool:
        """Whether decode steps run the compiled decode step (False: every step is eager)."""
        return self.core.runner.decode_step is not None

    def layer_kernels(self, batch: int = 1) -> list[LayerKernel]:
        """Each weight-reading layer, the kernel a decode step of `batch` rows runs in it (a quantized eager layer:
        its dispatcher's choice at that batch) and the weight bytes it reads (engine/layer_kernels.py)."""
        return layer_kernels(self.core.runner.model, self.compiled, batch)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def request_status(self, request_id: str) -> RequestStatus | None:
        return self.core.request_status(request_id)

    def request_ids(self) -> list[str]:
        return self.core.request_ids()

    def commit_kv_cache(self) -> bool:
        return self.core.commit_kv_cache()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Everything that can be wrong with a request before it is queued (ValueError naming the problem).

        A request that passes always fits the KV cache: start-up guarantees room for one max-model-len sequence.
        """
        self.core.check(prompt_token_ids, params)

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> Request:
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = list(self.tokenizer(prompt)["input_ids"])
        prompt_token_ids = list(prompt_token_ids)
        if request_id is None:
            request_id = f"req-{self._req_ids}"
            self._req_ids += 1
        self.core.check(prompt_token_ids, params)
        if request_id in self.output:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = self.core.add(request_id, prompt_token_ids, params)
        self.output.add(request_id, prompt, prompt_token_ids, params, seqs[0].arrival_time)
        return Request(request_id, prompt, prompt_token_ids, params, seqs)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks are free when this returns."""
        self.output.abort(request_id)
        return self.core.abort(request_id)

    def step(self, on_partial: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """One step of the core (EngineCore.step: schedule, run, book), then the text of what it advanced.

        `on_partial`: a mixed step (new prompts beside decode rows) runs in two parts, and the outputs of the prompt
        part are handed to it before the decode part runs, so a server streams the new requests' first tokens a
        decode pass earlier. Those requests are then not in the returned list, unless the decode part advanced
        them too. Without it, one output per request, as always.
        """
        partial = None if on_partial is None else (lambda updates: on_partial(self._process(updates)))
        return self._process(self.core.step(on_partial=partial))

    def _process(self, updates: list[SeqUpdate]) -> list[RequestOutput]:
        core = self.core
        if core.last_first_scheduled:
            self.output.scheduled(core.last_first_scheduled, core.last_schedule_time)
        stopped: list[tuple[str, int]] = []
        outputs = self.output.process(updates, stopped)
        for request_id, index in stopped:  # a stop string ended it: the core frees its blocks before the next step
            self.core.finish(request_id, index, "stop")
        return outputs
