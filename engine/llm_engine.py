"""The engine loop: add requests, step (schedule -> run model -> sample -> detokenize -> finish), abort."""

from __future__ import annotations

import collections.abc
import itertools
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from .detokenizer import DecodeCache, IncrementalDetokenizer
from .model_runner import ModelRunner
from .models.llama import DecoderLM
from .sampler import SampleResult, key_for_seed
from .sampling_params import SamplingParams
from .scheduler import ScheduledSeq, Scheduler, SchedulerStats
from .sequence import Sequence, SeqStatus, TokenLogprobs


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


@dataclass(frozen=True)
class StepShape:
    """What one step computed: prompt tokens (rows of more than one new token), single-token decode rows, and the
    seconds the part with the prompt tokens took (the runner's eager call). The server's admission control learns
    the cost of a prompt token from these."""

    prefill_tokens: int = 0
    decode_rows: int = 0
    prefill_s: float = 0.0


@dataclass(frozen=True)
class EngineStats(SchedulerStats):
    """A snapshot of the engine's state for readers outside it (the server's loop, benchmarks, tests): the
    scheduler's queues and KV cache, plus the engine's requests and token counters. Taken between steps; nothing in
    it changes afterwards."""

    num_requests: int  # requests added and not yet finished or aborted
    num_prompt_tokens: int  # summed over every request added
    num_generated_tokens: int

    @property
    def kv_used_blocks(self) -> int:
        return self.kv_blocks - self.kv_free_blocks


@dataclass(frozen=True)
class RequestStatus:
    """Where one unfinished request stands."""

    scheduled: bool  # some sequence of it has left the waiting queue at least once
    generated_tokens: int  # summed over its sequences


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(
        self,
        *,
        tokenizer: Any,
        runner: ModelRunner,
        scheduler: Scheduler,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        seed: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.runner = runner
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        # Unseeded requests draw their seeds from here, so a whole run is reproducible from the engine seed.
        self._rng = torch.Generator().manual_seed(seed)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        # Single-token decodes, one cache per skip_special_tokens setting, shared by every sequence's detokenizer.
        self._decode_caches = {True: DecodeCache(), False: DecodeCache()}
        self.last_step = StepShape()

    @property
    def model(self) -> DecoderLM:
        """The served model, for tools that evaluate it directly (the accuracy and decode benches)."""
        return self.runner.model

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> EngineStats:
        return EngineStats(**asdict(self.scheduler.stats()), num_requests=len(self._requests),
                           num_prompt_tokens=self.num_prompt_tokens,
                           num_generated_tokens=self.num_generated_tokens)  # fmt: skip

    def request_status(self, request_id: str) -> RequestStatus | None:
        """None once the request has finished (its last output was returned by `step`) or was aborted."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        return RequestStatus(
            scheduled=any(s.first_scheduled_time is not None for s in req.seqs),
            generated_tokens=sum(len(s.output_token_ids) for s in req.seqs),
        )

    def request_ids(self) -> list[str]:
        """The unfinished requests, oldest first."""
        return list(self._requests)

    def commit_kv_cache(self) -> bool:
        """Make the KV pool resident now (engine/host_memory.py); False where the host cannot."""
        return self.runner.kv_cache.commit()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Everything that can be wrong with a request before it is queued (ValueError naming the problem).

        A request that passes always fits the KV cache: start-up guarantees room for one max-model-len sequence.
        """
        vocab = len(self.tokenizer)
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        self.validate_length(len(prompt_token_ids), params)

    def validate_length(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty; send at least one token")
        if prompt_len + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt tokens ({prompt_len}) + max_tokens ({params.max_tokens}) = "
                f"{prompt_len + params.max_tokens} exceeds max-model-len ({self.max_model_len}); "
                f"shorten the prompt or lower max_tokens"
            )

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
        self.validate_request(prompt_token_ids, params)
        rid = request_id or f"req-{next(self._req_ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, list(prompt_token_ids), params)
        for i in range(params.n):
            # A seeded request's completions take seed, seed + 1, ...; an unseeded one's a number from the engine's
            # generator (so a whole run is reproducible from the engine seed). The sampler's stream is keyed by it.
            seed = params.seed + i if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=rid,
                index=i,
                prompt_token_ids=req.prompt_token_ids,
                params=params,
                detok=IncrementalDetokenizer(
                    self.tokenizer,
                    req.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    cache=self._decode_caches[params.skip_special_tokens],
                ),
                sample_key=key_for_seed(seed),
                arrival_time=req.arrival_time,
            )
            req.seqs.append(seq)
        for seq in req.seqs:
            self.scheduler.add(seq)
        self._requests[rid] = req
        self.num_prompt_tokens += len(prompt_token_ids)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks are free when this returns."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq)
        return True

    def step(self, on_partial: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Schedule and run one step; the outputs of the requests it advanced.

        `on_partial`: a mixed step (new prompts beside decode rows) runs in two parts, and the outputs of the prompt
        part are handed to it before the decode part runs, so a server streams the new requests' first tokens a
        decode pass earlier. Those requests are then not in the returned list, unless the decode part advanced
        them too. Without it, one output per request, as always.
        """
        out = self.scheduler.schedule()
        if out.empty:
            self.last_step = StepShape()
            return []
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for (scheds, samples), last in self.runner.execute_parts(out.scheduled):
            now = time.monotonic()
            self._advance(scheds, samples, touched, now)
            if on_partial is not None and touched and not last:
                on_partial(self._outputs(touched, now))
                touched = {}
        self.last_step = StepShape(out.num_prefill_tokens, out.num_decode_rows, self.runner.last_prefill_s)
        return self._outputs(touched, now)

    def _advance(
        self,
        scheds: list[ScheduledSeq],
        samples: collections.abc.Sequence[SampleResult | None],
        touched: dict[str, Request],
        now: float,
    ) -> None:
        """Book one part's results: computed tokens, the sampled token, detokenization, finishing. This runs once per
        row per step, so what it reads repeatedly is bound to locals first."""
        scheduler, eos, requests, max_len = self.scheduler, self.eos_token_ids, self._requests, self.max_model_len
        block_size = scheduler.block_size
        generated = 0
        for sched, sample in zip(scheds, samples):
            seq = sched.seq
            computed = seq.num_computed_tokens = seq.num_computed_tokens + sched.num_new_tokens
            if computed >= (seq.num_committed_blocks + 1) * block_size:  # a block filled up (Scheduler.commit)
                scheduler.commit(seq)
            if sample is None:
                continue
            token = sample.token_id
            output = seq.output_token_ids
            output.append(token)
            if sample.logprobs is not None:
                seq.logprobs.append(sample.logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
            generated += 1
            p = seq.params
            # A stop token (or EOS, unless ignored) ends the sequence before the detokenizer sees it; then a stop
            # string in the text; then the length limits (seq.num_tokens, spelled out).
            if token in p.stop_token_ids or (token in eos and not p.ignore_eos) or seq.detok.append(token):
                scheduler.finish(seq, "stop")
            elif len(output) >= p.max_tokens or len(seq.prompt_token_ids) + len(output) >= max_len:
                seq.detok.flush()
                scheduler.finish(seq, "length")
            rid = seq.request_id
            req = requests.get(rid)
            if req is not None:
                touched[rid] = req
        self.num_generated_tokens += generated

    def _outputs(self, touched: dict[str, Request], now: float) -> list[RequestOutput]:
        outputs = []
        for rid, req in touched.items():
            if len(req.seqs) == 1:  # n=1, the usual request (every row of every step): _single_output
                seq = req.seqs[0]
                done = seq.status is SeqStatus.FINISHED
                if done:
                    req.finished_time = now
                    del self._requests[rid]
                outputs.append(self._single_output(req, seq, done))
                continue
            if req.finished:
                req.finished_time = now
                del self._requests[rid]
            outputs.append(self.make_output(req))
        return outputs

    @staticmethod
    def _single_output(req: Request, s: Sequence, done: bool) -> RequestOutput:
        """make_output of a request with one sequence `s` (finished: `done`), without the per-request lists."""
        logprobs = s.logprobs.copy() if s.params.logprobs is not None else None
        comp = CompletionOutput(s.index, s.detok.output_text, s.output_token_ids.copy(), s.finish_reason,
                                s.detok.take_stream_delta(done), logprobs)  # fmt: skip
        metrics = RequestMetrics(req.arrival_time, s.first_scheduled_time, s.first_token_time, req.finished_time)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], done, s.num_cached_tokens,
                             metrics)  # fmt: skip

    def make_output(self, req: Request) -> RequestOutput:
        if len(req.seqs) == 1:
            return self._single_output(req, req.seqs[0], req.seqs[0].status is SeqStatus.FINISHED)
        comps = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.output_token_ids),
                finish_reason=s.finish_reason,
                delta=s.detok.take_stream_delta(s.is_finished),
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            )
            for s in req.seqs
        ]
        first = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        sched = [s.first_scheduled_time for s in req.seqs if s.first_scheduled_time is not None]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=comps,
            finished=req.finished,
            num_cached_tokens=max((s.num_cached_tokens for s in req.seqs), default=0),
            metrics=RequestMetrics(req.arrival_time, min(sched, default=None), min(first, default=None), req.finished_time),
        )
