"""What a step produces, from the engine core's plain per-sequence updates to the caller's RequestOutputs.

The engine core (engine/core.py) decides everything that needs only token ids: the computed tokens, the sampled
token, stop tokens, EOS and the length limits. It hands out one `SeqUpdate` per sequence that advanced. The
`OutputProcessor` turns those into text: it detokenizes incrementally, applies stop strings and builds the
RequestOutputs. In one process (the offline `LLM`) the processor sits beside the core inside `LLMEngine`; served,
it runs in the API server process while the core runs in a process of its own (lifecycle/core_client.py), so
detokenizing never shares a GIL with the model step. A stop string ends a sequence the core does not know has
ended: the processor names it (`stopped`), and its owner tells the core to finish it.

Nothing here imports torch: the API server process uses it without loading the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from .detokenizer import DecodeCache, IncrementalDetokenizer
from .sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One generated token's logprob and the top-n alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


# The core's finish reason for a constrained sequence whose grammar its last token completed; the processor shows it
# as "stop" (that token is part of the text, unlike a stop token's).
GRAMMAR_DONE = "grammar"


class SeqUpdate(msgspec.Struct, array_like=True, gc=False):
    """One sequence advanced by one step: the token it sampled, and why it finished when it did."""

    request_id: str
    index: int  # which of the request's completions
    token_id: int
    logprobs: TokenLogprobs | None = None
    # "stop" (a stop token or EOS: not text), GRAMMAR_DONE (the token completed the grammar: text, then "stop"),
    # "length", or None while it goes on
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
    """What one part of a step computed, as plain data: its rows in the order they ran, each row's sampled token
    (-1: a prompt chunk short of the end, nothing sampled) and, when any row of the part asked for them, each
    row's logprobs."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    last: bool = True  # the last part of its step (a mixed step runs its prompt chunks first, then the decodes)


@dataclass(slots=True)  # made for every request every step: no per-object __dict__
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    delta: str = ""  # text that became safe to stream in this step
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


def check_request(prompt_token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int) -> None:
    """Everything that can be wrong with a request before it is queued (ValueError naming the problem). The engine
    core and the API server both call it, so a refusal reads the same wherever it happens."""
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    check_logit_bias(params, vocab_size)
    check_length(len(prompt_token_ids), params, max_model_len)


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the first logit_bias key that is not a token of the vocabulary (the sampler indexes the
    logits with them)."""
    bad = next((t for t in params.logit_bias or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def check_length(prompt_len: int, params: SamplingParams, max_model_len: int) -> None:
    if prompt_len == 0:
        raise ValueError("the prompt is empty; send at least one token")
    if prompt_len + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt tokens ({prompt_len}) + max_tokens ({params.max_tokens}) = "
            f"{prompt_len + params.max_tokens} exceeds max-model-len ({max_model_len}); "
            f"shorten the prompt or lower max_tokens"
        )


@dataclass(slots=True, eq=False)
class _Completion:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # as the core last reported it (a resumed sequence may find more in the cache)


@dataclass(slots=True, eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    open: int = 0  # completions not finished yet
    single: bool = True  # one completion (n=1): its output is made as its update is read
    want_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return self.open == 0


class OutputProcessor:
    """Per-request text state on the caller's side of the core: `add` when a request is submitted, `process` each
    step's updates, `abort` when the caller gives up on one. Single-threaded."""

    def __init__(self, tokenizer: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self._clock = clock
        self._requests: dict[str, _RequestState] = {}
        # Tokens the core generated after their request was aborted, or their completion ended on a stop string
        # here, before it heard so: work nobody receives (counted, as the server's metrics must add up).
        self.discarded = 0
        # Single-token decodes, one cache per skip_special_tokens setting, shared by every detokenizer.
        self._decode_caches = {skip: DecodeCache(skip) for skip in (True, False)}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        cache = self._decode_caches[params.skip_special_tokens]
        skip = params.skip_special_tokens
        completions = [
            _Completion(
                i,
                IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, skip_special_tokens=skip, stop=params.stop, cache=cache
                ),
                [],
                [],
            )
            for i in range(params.n)
        ]
        self._requests[request_id] = _RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            completions,
            self._clock() if arrival_time is None else arrival_time,
            open=params.n,
            single=params.n == 1,
            want_logprobs=params.logprobs is not None,
        )

    def abort(self, request_id: str) -> int | None:
        """Forget a request; the tokens it had generated (None when it was not here)."""
        state = self._requests.pop(request_id, None)
        return None if state is None else sum(len(c.token_ids) for c in state.completions)

    def generated_tokens(self, request_id: str) -> int:
        state = self._requests.get(request_id)
        return 0 if state is None else sum(len(c.token_ids) for c in state.completions)

    def scheduled(self, request_ids: Iterable[str], when: float) -> None:
        """These requests left the core's waiting queue for the first time at `when`."""
        for rid in request_ids:
            state = self._requests.get(rid)
            if state is not None and state.first_scheduled_time is None:
                state.first_scheduled_time = when

    def process(self, updates: list[SeqUpdate], stopped: list[tuple[str, int]] | None = None) -> list[RequestOutput]:
        """One step's updates -> one RequestOutput per request they advanced; finished requests are forgotten.
        `stopped` collects (request_id, index) of the completions a stop string ended, for the core to finish. This
        runs once per sequence per step, so what it reads repeatedly is bound to locals first, and a request of
        one completion (the usual one) gets its output at once."""
        now = self._clock()
        requests = self._requests
        outputs: list[RequestOutput] = []
        several: dict[str, _RequestState] = {}  # requests of n > 1 completions, output once all their updates are in
        for u in updates:
            rid = u.request_id
            state = requests.get(rid)
            if state is None:
                self.discarded += 1  # aborted meanwhile
                continue
            comp = state.completions[u.index]
            if comp.finish_reason is not None:
                self.discarded += 1  # a stop string ended it; the core's later tokens are nobody's
                continue
            token = u.token_id
            comp.token_ids.append(token)
            if u.logprobs is not None:
                comp.logprobs.append(u.logprobs)
            comp.num_cached_tokens = u.num_cached_tokens
            if state.first_token_time is None:
                state.first_token_time = now
            reason = u.finish_reason
            # A stop token (or EOS) ends the sequence before the detokenizer sees it; then a stop string in the
            # text ends it; at the length limit, whatever is pending is flushed.
            if reason == "stop":
                pass
            elif reason == GRAMMAR_DONE:
                comp.detok.append(token)
                comp.detok.flush()
                reason = "stop"
            elif comp.detok.append(token):
                reason = "stop"
                if u.finish_reason is None and stopped is not None:
                    stopped.append((rid, u.index))
            elif reason == "length":
                comp.detok.flush()
            if reason is not None:
                comp.finish_reason = reason
                state.open -= 1
            if state.single:
                done = reason is not None
                if done:
                    state.finished_time = now
                    del requests[rid]
                detok = comp.detok
                outputs.append(
                    RequestOutput(
                        rid,
                        state.prompt,
                        state.prompt_token_ids,
                        [
                            CompletionOutput(
                                comp.index,
                                detok.output_text,
                                comp.token_ids.copy(),
                                reason,
                                detok.take_stream_delta(done),
                                comp.logprobs.copy() if state.want_logprobs else None,
                            )
                        ],
                        done,
                        comp.num_cached_tokens,
                        RequestMetrics(
                            state.arrival_time, state.first_scheduled_time, state.first_token_time, state.finished_time
                        ),
                    )
                )
            else:
                several[rid] = state
        for rid, state in several.items():
            done = state.open == 0
            if done:
                state.finished_time = now
                del requests[rid]
            outputs.append(self._output(state, done))
        return outputs

    @staticmethod
    def _output(state: _RequestState, done: bool) -> RequestOutput:
        want_lp = state.want_logprobs
        comps = [
            CompletionOutput(
                c.index,
                c.detok.output_text,
                c.token_ids.copy(),
                c.finish_reason,
                c.detok.take_stream_delta(c.finish_reason is not None),
                c.logprobs.copy() if want_lp else None,
            )
            for c in state.completions
        ]
        metrics = RequestMetrics(
            state.arrival_time, state.first_scheduled_time, state.first_token_time, state.finished_time
        )
        cached = max(c.num_cached_tokens for c in state.completions)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, comps, done, cached, metrics)
