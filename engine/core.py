"""The engine core: the scheduler and the model runner, requests in, per-sequence token updates out.

`EngineCore.step()` is the step's three calls, `Scheduler.schedule()` -> `ModelRunner.execute()` ->
`Scheduler.update_from_output()`, each handing the next plain data (engine/scheduler.py says who owns what). It
produces token ids only: text (detokenizing, stop strings) is the caller's, through an `OutputProcessor`
(engine/outputs.py). The offline `LLMEngine` holds a core and a processor in one process; the server runs the core
in a process of its own (engine/core_proc.py) and the processor in the API server.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .model_runner import ModelRunner
from .outputs import SeqUpdate, check_request
from .sampler import key_for_seed
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerStats
from .sequence import Sequence
from .structured import GrammarBackend


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
    """A snapshot of the engine's state for readers outside it (the server, benchmarks, tests): the scheduler's
    queues and KV cache, plus the engine's requests and token counters. Taken between steps; nothing in it changes
    afterwards."""

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


class EngineCore:
    """Not thread-safe: one thread adds, aborts and steps."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        vocab_size: int,
        seed: int = 0,
        grammar: GrammarBackend | None = None,
    ) -> None:
        """`grammar`: what constrained requests (SamplingParams.grammar) are matched with; None refuses them."""
        self.runner = runner
        self.scheduler = scheduler
        self.grammar = grammar
        if grammar is not None:
            scheduler.use_grammars(grammar)
        self.vocab_size = vocab_size
        self._requests: dict[str, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        # Unseeded requests draw their seeds from here, so a whole run is reproducible from the engine seed.
        self._rng = torch.Generator().manual_seed(seed)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.last_step = StepShape()
        self.last_first_scheduled: list[str] = []  # requests the last step scheduled for the first time
        self.last_schedule_time = 0.0  # time.monotonic() when the last step was scheduled

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming what is wrong with the request (outputs.check_request)."""
        check_request(prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def add(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None = None
    ) -> list[Sequence]:
        """Queue a request (ValueError when it cannot run or its id is in use); its sequences, one per completion."""
        self.check(prompt_token_ids, params)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            # A seeded request's completions take seed, seed + 1, ...; an unseeded one's a number from the engine's
            # generator (so a whole run is reproducible from the engine seed). The sampler's stream is keyed by it.
            seed = (
                params.seed + i if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
            )
            seqs.append(
                Sequence(
                    seq_id=next(self._seq_ids),
                    request_id=request_id,
                    index=i,
                    prompt_token_ids=prompt_token_ids,
                    params=params,
                    sample_key=key_for_seed(seed),
                    arrival_time=arrival,
                    grammar=self._matcher(params),
                )
            )
        for seq in seqs:
            self.scheduler.add(seq)
        self._requests[request_id] = seqs
        self.num_prompt_tokens += len(prompt_token_ids)
        return seqs

    def _matcher(self, params: SamplingParams) -> object | None:
        """A grammar matcher of its own for each sequence of a constrained request (ValueError: none possible)."""
        if params.grammar is None:
            return None
        if self.grammar is None:
            raise ValueError(
                "grammar: structured outputs are off on this server (--no-structured-outputs); start it "
                "without that flag to send response_format, guided_* or tool_choice"
            )
        return self.grammar.matcher(params.grammar)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks are free when this returns. False when it is not here."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            self.scheduler.abort(seq)
        return True

    def finish(self, request_id: str, index: int, reason: str = "stop") -> None:
        """End one completion the caller has seen end (a stop string in its text); its blocks are free at once."""
        seqs = self._requests.get(request_id)
        if seqs is None or not 0 <= index < len(seqs):
            return
        self.scheduler.finish(seqs[index], reason)
        if all(s.is_finished for s in seqs):
            del self._requests[request_id]

    def step(self, on_partial: Callable[[list[SeqUpdate]], None] | None = None) -> list[SeqUpdate]:
        """Schedule, run and book one step; the updates of the sequences that sampled a token.

        `on_partial`: a mixed step (new prompts beside decode rows) runs in two parts; the prompt part's updates are
        handed to it before the decode part runs (and are then not in the returned list), so a server streams the
        new requests' first tokens a decode pass earlier.
        """
        self.last_schedule_time = time.monotonic()
        out = self.scheduler.schedule()
        self.last_first_scheduled = out.first_scheduled
        if out.empty:
            self.last_step = StepShape()
            return []
        updates: list[SeqUpdate] = []
        for part in self.runner.execute(out):
            got = self.scheduler.update_from_output(out, part)
            self._settle(got)
            if on_partial is not None and got and not part.last:
                on_partial(got)
            else:
                updates += got
        self.last_step = StepShape(out.num_prefill_tokens, out.num_decode_rows, self.runner.last_prefill_s)
        return updates

    def _settle(self, updates: list[SeqUpdate]) -> None:
        self.num_generated_tokens += len(updates)
        for u in updates:
            if u.finish_reason is not None:
                seqs = self._requests.get(u.request_id)
                if seqs is not None and all(s.is_finished for s in seqs):
                    del self._requests[u.request_id]

    def stats(self) -> EngineStats:
        return EngineStats(
            **asdict(self.scheduler.stats()),
            num_requests=len(self._requests),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
        )

    def request_status(self, request_id: str) -> RequestStatus | None:
        """None once the request has finished or was aborted."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return None
        return RequestStatus(
            scheduled=any(s.first_scheduled_time is not None for s in seqs),
            generated_tokens=sum(len(s.output_token_ids) for s in seqs),
        )

    def request_ids(self) -> list[str]:
        """The unfinished requests, oldest first."""
        return list(self._requests)

    def sequences(self, request_id: str) -> list[Sequence]:
        """The sequences of an unfinished request (read-only: the scheduler owns them)."""
        return list(self._requests.get(request_id, ()))

    def commit_kv_cache(self) -> bool:
        """Make the KV pool resident now (engine/host_memory.py); False where the host cannot."""
        return self.runner.kv_cache.commit()
