"""Turn a scheduler decision into model inputs, run the model, and sample the next tokens.

Decode-only batches run through the compiled decode step when one is installed (`install_decode`, by the compile
stages). The step's whole input is one int64 array, [batch, DECODE_COLS + table width] (token, position, cache
slot, context length, block table per row; engine/attention.py), held by a persistent DecodeBatch
(engine/decode_batch.py) that carries the rows from step to step and changes only what a step changed: a step's
host work grows with the rows that joined, left or entered a new KV block, not with every row's block table. The
step is one call with no host synchronisation until the sampler's single one. The batch runs at its own size on
the CPU, whose graph has a symbolic batch dimension; captured CUDA graphs have fixed shapes, so there a batch is
padded up to the next captured size with rows that write into the scratch block the block manager never hands out.

Prefill chunks (or everything, when there is no compiled step or the batch is too big for it) run the eager forward
over AttentionMetadata; in a mixed step the decode rows still take the compiled step.

The runner keeps its own copy of every sequence it runs (`RunnerSeq`, engine/sequence.py): `execute` applies the
scheduler's plain-data output to those copies (new sequences whole, block-table deltas, sequences to forget), runs
the step, moves its copies on by what it computed and sampled, and returns plain data (`ModelRunnerOutput`). It
never touches the scheduler's sequences; the scheduler books the same tokens from that output.
"""

from __future__ import annotations

import collections.abc
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .attention import CONTEXT, DECODE_COLS, POSITION, SLOT, TOKEN
from .cuda_graphs import CapturedDecode, GraphCaptureStat, GraphPoolUsage, capture_decode_graphs, graph_pool_usage
from .decode_batch import MIN_TABLE_WIDTH, DecodeBatch
from .graph_buckets import bucket_for, static_span
from .kv_cache import KVCache
from .models.llama import DecoderLM
from .outputs import ModelRunnerOutput, TokenLogprobs
from .sampler import SampleResult, TokenMasks, sample
from .sequence import RunnerSeq
from .step_inputs import BatchInputs, ScheduledSeq, eager_inputs

if TYPE_CHECKING:
    from .scheduler import SchedulerOutput


# packed [B, DECODE_COLS + W] -> logits [B, vocab]
DecodeFn = Callable[[torch.Tensor], torch.Tensor]
# One part of a step: the sequences it ran and, for each, what it sampled (None: a prompt chunk short of the end).
# Two parallel lists rather than a list of pairs: the engine walks them with zip, and no pair is built per row.
PartResults = tuple[list[ScheduledSeq], collections.abc.Sequence[SampleResult | None]]


@dataclass(frozen=True)
class StepTimes:
    """Nanoseconds the runner has spent, summed over its life, inside the model call (the compiled decode step, or
    the eager forward and LM head) and inside the sampler. A step's host time is its wall time minus what these
    grew by during it (profiling/bench/decode.py). On a GPU the model call only launches work; the wait for it
    lands in the sampler's host transfer."""

    model_ns: int = 0
    sample_ns: int = 0


@dataclass(frozen=True)
class _ServingViews:
    """One input shape's views of the decode batch's buffer: the flat host and device spans (the same tensor on the
    CPU), and the [rows, cols] input the step runs."""

    host: torch.Tensor
    device: torch.Tensor
    packed: torch.Tensor


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        kv_cache: KVCache,
        device: str = "cpu",
        *,
        max_num_seqs: int = 1,
        max_blocks_per_seq: int = MIN_TABLE_WIDTH,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.scratch_block = kv_cache.num_blocks - 1  # reserved: see module docstring
        self.device = torch.device(device)
        self.last_prefill_s = 0.0  # wall time of the last step's eager part when it had prompt tokens
        self._decode_step: DecodeFn | None = None
        self._decode_sizes: list[int] = []  # batch sizes the compiled step was captured / warmed for
        self._graph_pool: tuple[int, int] | None = None  # the captured graphs' memory pool id (capture_graphs)
        self.pad_decode = self.device.type == "cuda"  # fixed-shape CUDA graphs
        self._max_batch = max_num_seqs
        self._max_width = max(MIN_TABLE_WIDTH, max_blocks_per_seq)
        # Flat host staging: each step views its first rows * cols elements as a contiguous [rows, cols] tensor (the
        # graph is traced for contiguous inputs); numpy views make the per-row writes cheap. A GPU gets a twin.
        size = max_num_seqs * (DECODE_COLS + self._max_width)
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._device_buf = self._host if self.device.type == "cpu" else self._host.to(self.device)
        # The persistent decode batch lays its rows out in a buffer of its own (prepare_decode's from-scratch builds
        # must not overwrite them), which the compiled step reads through views made once per shape.
        serve = torch.zeros(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._batch = DecodeBatch(
            max_num_seqs,
            self._max_width,
            self.block_size,
            self.scratch_block,
            buffer=serve.numpy(),
            fixed_width=self.pad_decode,
        )
        self._serve_host = serve
        self._serve_device = serve if self.device.type == "cpu" else serve.to(self.device)
        self._views: dict[tuple[int, int], _ServingViews] = {}
        self._model_ns = 0
        self._sample_ns = 0
        # One context object for every compiled step: the @torch.inference_mode() decorator builds a new one per call,
        # a handful of Python calls that are cold each step (the model step sweeps the caches). Not re-entrant,
        # and _run_compiled never nests.
        self._inference_mode = torch.inference_mode()
        # Tensor parallelism on rank 0: called with each eager batch before the model runs, so that the workers
        # run the same call on their shards (engine/distributed.py); None on one rank.
        self._step_hook: Callable[[BatchInputs], None] | None = None
        # The runner's copies of the sequences it runs, by seq_id (see the module docstring).
        self._seqs: dict[int, RunnerSeq] = {}
        # This step's token masks (SchedulerOutput.grammar_*): seq_id -> its row of the bitmask, and the bitmask
        # (a Future: computed while the forward runs, waited for by the sampling).
        self._grammar_rows: dict[int, int] = {}
        self._grammar_mask: Future[np.ndarray] | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences the runner holds a copy of."""
        return len(self._seqs)

    def apply(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """Bring the runner's copies up to date with the scheduler's step (forget, add, grow block tables); the
        step's rows, in its order. `execute` calls it; tests and tools that build a step's input without running it
        call it themselves."""
        seqs = self._seqs
        for sid in out.finished_seq_ids:
            seqs.pop(sid, None)
        for d in out.new_seqs:
            seqs[d.seq_id] = RunnerSeq(
                d.seq_id,
                d.request_id,
                d.prompt_token_ids,
                d.output_token_ids,
                d.params,
                d.sample_key,
                d.block_ids,
                d.num_computed_tokens,
            )
        for sid, blocks in out.new_block_ids.items():
            seqs[sid].block_table.extend(blocks)
        return [ScheduledSeq(seqs[sid], n) for sid, n in zip(out.seq_ids, out.num_new_tokens)]

    def execute(self, out: SchedulerOutput) -> Iterator[ModelRunnerOutput]:
        """Run the step `out`, yielding each part's output as soon as it has it (one part, or two for a mixed step:
        the prompt chunks, then the decode rows; see execute_parts)."""
        self._grammar_rows = dict(zip(out.grammar_seq_ids, range(len(out.grammar_seq_ids))))
        self._grammar_mask = out.grammar_bitmask
        for (scheds, samples), last in self.execute_parts(self.apply(out)):
            yield self._book(scheds, samples, last)

    @staticmethod
    def _book(
        scheds: list[ScheduledSeq], samples: collections.abc.Sequence[SampleResult | None], last: bool
    ) -> ModelRunnerOutput:
        """Move the runner's copies on by what the part computed and sampled; the part as plain data."""
        sids: list[int] = []
        tokens: list[int] = []
        lps: list[TokenLogprobs | None] | None = None
        for i, (sched, sampled) in enumerate(zip(scheds, samples)):
            seq = sched.seq
            seq.num_computed_tokens += sched.num_new_tokens
            sids.append(seq.seq_id)
            if sampled is None:
                tokens.append(-1)
                continue
            seq.output_token_ids.append(sampled.token_id)
            tokens.append(sampled.token_id)
            if sampled.logprobs is not None:
                if lps is None:
                    lps = [None] * len(scheds)
                lps[i] = sampled.logprobs
        return ModelRunnerOutput(sids, tokens, lps, last)

    def broadcast_steps(self, hook: Callable[[BatchInputs], None] | None) -> None:
        """Hand every eager batch to `hook` before running it (rank 0 of a tensor-parallel group; see
        engine/distributed.py). The compiled decode step is not used under tensor parallelism."""
        self._step_hook = hook

    @property
    def max_decode_batch(self) -> int:
        return self._max_batch

    @property
    def decode_step(self) -> DecodeFn | None:
        """The installed compiled decode step (None: every step runs eagerly)."""
        return self._decode_step

    @property
    def decode_sizes(self) -> tuple[int, ...]:
        """The batch sizes the installed step was captured or warmed for."""
        return tuple(self._decode_sizes)

    def install_decode(self, step: DecodeFn, sizes: list[int] | tuple[int, ...]) -> None:
        """Serve decode-only batches through `step` from now on, at the batch sizes `sizes` (captured CUDA graphs
        run at exactly those sizes; the CPU graph runs any size up to --max-num-seqs)."""
        self._decode_step = step
        self._decode_sizes = sorted(sizes)
        self._batch.clear()  # rows are only carried over between steps of one installed step

    def padding_batch(self, size: int) -> torch.Tensor:
        """A decode input of `size` padding rows (each reads and writes only the scratch block): what start-up
        checks, captures and warms the compiled step on."""
        return self.prepare_decode([], pad_to=size)

    @torch.inference_mode()
    def warm_up(self, step: DecodeFn, sizes: list[int]) -> list[float]:
        """Run `step` once at each batch size on padding rows against the real cache (first-call set-up, allocator
        warm-up); the seconds each call took."""
        times = []
        for size in sizes:
            packed = self.padding_batch(size)
            t0 = time.perf_counter()
            step(packed)
            times.append(round(time.perf_counter() - t0, 4))
        return times

    def step_times(self) -> StepTimes:
        """The model and sampler time so far (see StepTimes)."""
        return StepTimes(self._model_ns, self._sample_ns)

    @property
    def max_table_width(self) -> int:
        return self._max_width

    def eager_decode(self, packed: torch.Tensor) -> torch.Tensor:
        """The uncompiled decode step (same math as the compiled one): the reference the tests compare against."""
        return self.model.decode(packed, self.kv_cache.layers)

    def padded_size(self, batch: int) -> int | None:
        """The batch size to run a decode batch at through the compiled step, or None for eager."""
        if self._decode_step is None or batch > self.max_decode_batch:
            return None
        if not self.pad_decode:
            return batch
        return bucket_for(batch, self._decode_sizes)

    def capture_graphs(self, step: DecodeFn, sizes: list[int]) -> list[GraphCaptureStat]:
        """Capture `step` as one CUDA graph per batch size over the static input buffer the serving path writes
        (engine/cuda_graphs.py), then install the replaying step. Returns each size's capture time and pool growth
        (ascending sizes)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runner's is {self.device}")
        self._batch.clear()
        graphs, stats, self._graph_pool = capture_decode_graphs(
            step, sizes, lambda size: self._decode_input([], size), self.device
        )
        self.install_decode(CapturedDecode(graphs), sizes)
        return stats

    def graph_pool_usage(self) -> GraphPoolUsage | None:
        """The captured graphs' pool as the allocator holds it now (see GraphPoolUsage); None before a capture."""
        return None if self._graph_pool is None else graph_pool_usage(self._graph_pool, self.device)

    # ------------------------------------------------------------------------------------------ decode path
    def _decode_input(self, seqs: list[RunnerSeq], rows: int) -> torch.Tensor:
        """This step's input from the persistent decode batch, `rows` rows (the batch, then padding)."""
        batch = self._batch
        batch.sync(seqs)
        if rows > len(batch):
            batch.pad(rows)
        cols = batch.cols
        views = self._views.get((rows, cols))
        if views is None:
            # Made once per shape, inside inference mode as the steps run: slicing and viewing are torch calls
            # whose dispatch code is cold on every step (the model step sweeps the caches).
            _, n = static_span(rows, cols, self._serve_host.numel())
            host = self._serve_host[:n]
            device = host if self._serve_device is self._serve_host else self._serve_device[:n]
            views = self._views[(rows, cols)] = _ServingViews(host, device, device.view(rows, cols))
        if views.device is not views.host:
            views.device.copy_(views.host, non_blocking=True)
        return views.packed

    def _staged(self, rows: int, cols: int) -> torch.Tensor:
        """The staging buffer's first rows * cols elements as the [rows, cols] input, on the engine's device."""
        n = rows * cols
        if self.device.type == "cpu":
            return self._host[:n].view(rows, cols)
        self._device_buf[:n].copy_(self._host[:n], non_blocking=True)
        return self._device_buf[:n].view(rows, cols)

    def prepare_decode(self, decodes: list[ScheduledSeq], pad_to: int | None = None) -> torch.Tensor:
        """Fill the staging buffer for a decode-only batch from scratch, row by row from the sequences; returns the
        [B, DECODE_COLS + W] view to run. Serving goes through the persistent DecodeBatch instead; this builds the
        same input independently (start-up's padding batches, and the reference the tests compare against)."""
        bs = self.block_size
        rows = pad_to or len(decodes)
        width = MIN_TABLE_WIDTH
        for s in decodes:
            width = max(width, len(s.seq.block_table))
        if self.pad_decode:  # captured graphs read every column: keep the full width
            width = self.max_table_width
        if width > self.max_table_width:
            raise ValueError(f"a sequence needs {width} KV blocks, more than the {self.max_table_width} planned")
        cols = DECODE_COLS + width
        buf = self._host_np[: rows * cols].reshape(rows, cols)
        buf[:, DECODE_COLS:] = self.scratch_block
        for i, s in enumerate(decodes):
            seq = s.seq
            pos = s.start
            table = seq.block_table
            buf[i, TOKEN] = seq.last_token_id
            buf[i, POSITION] = pos
            buf[i, SLOT] = table[pos // bs] * bs + pos % bs
            buf[i, CONTEXT] = pos + 1
            buf[i, DECODE_COLS : DECODE_COLS + len(table)] = table
        for i in range(len(decodes), rows):  # padding rows write into the scratch block and see one token
            buf[i, TOKEN] = 0
            buf[i, POSITION] = 0
            buf[i, SLOT] = self.scratch_block * bs
            buf[i, CONTEXT] = 1
        return self._staged(rows, cols)

    # ------------------------------------------------------------------------------------------- eager path
    def prepare(self, scheduled: list[ScheduledSeq]) -> BatchInputs:
        """The eager forward's inputs for `scheduled` (engine/step_inputs.py `eager_inputs`)."""
        return eager_inputs(scheduled, self.block_size, self.scratch_block, self.kv_cache, self.device)

    def execute_parts(self, scheduled: list[ScheduledSeq]) -> Iterator[tuple[PartResults, bool]]:
        """Run one scheduled step, yielding each part's results (and whether it is the last part) as soon as it has
        them: one part, or two for a mixed step (the prompt chunks, then the decode rows), so that the caller can
        deliver the new prompts' first tokens before the decode rows have run."""
        decodes = [s for s in scheduled if s.is_decode]
        padded = self.padded_size(len(decodes)) if decodes else None
        self.last_prefill_s = 0.0
        if padded is None:
            # The decode batch's rows carry over only between consecutive compiled steps: this step moves its
            # decode rows (if any) on outside the batch.
            self._batch.clear()
            # Timed only when it holds prompts alone: decode rows run eagerly here (a batch past the compiled
            # sizes, or no compiled step), and their attention would be booked to the prompt tokens.
            yield self._run_eager(scheduled, timed=not decodes), True
            return
        if len(decodes) == len(scheduled):
            yield self._run_compiled(decodes, padded), True
            return
        # A mixed step (a new prompt arrived while others decode): the prompt chunks run eagerly on their own and
        # the decode rows stay on the compiled step, rather than every running sequence dropping to the eager path
        # whenever a request arrives (eager decode attention is the slow part of a mixed step; reports/serve/serve.md
        # at concurrency 32 and 64 runs mostly such steps). Disjoint sequences and KV slots, so the two calls are
        # independent.
        prefills = [s for s in scheduled if not s.is_decode]
        yield self._run_eager(prefills, timed=True), False
        yield self._run_compiled(decodes, padded), True

    def _masks(self, seqs: list[RunnerSeq]) -> TokenMasks | None:
        """The token masks of the constrained rows among `seqs` (None when there are none: nothing to pay)."""
        if not self._grammar_rows:
            return None
        where = self._grammar_rows
        rows = [i for i, s in enumerate(seqs) if s.seq_id in where]
        if not rows:
            return None
        assert self._grammar_mask is not None
        return TokenMasks(self._grammar_mask.result()[[where[seqs[i].seq_id] for i in rows]], rows)

    def _run_compiled(self, decodes: list[ScheduledSeq], padded: int) -> PartResults:
        step = self._decode_step
        assert step is not None
        with self._inference_mode:
            seqs = [s.seq for s in decodes]
            packed = self._decode_input(seqs, padded)
            t0 = time.perf_counter_ns()
            logits = step(packed)
            t1 = time.perf_counter_ns()
            samples = sample(logits if padded == len(seqs) else logits[: len(seqs)], seqs, self._masks(seqs))
            t2 = time.perf_counter_ns()
        self._model_ns += t1 - t0
        self._sample_ns += t2 - t1
        self._batch.advance([r.token_id for r in samples])
        return decodes, samples

    @torch.inference_mode()
    def _run_eager(self, scheduled: list[ScheduledSeq], *, timed: bool = False) -> PartResults:
        """`timed`: record the wall time in `last_prefill_s` (a step with prompt tokens; what the server's admission
        learns a prompt token's cost from). On a GPU it ends at the sampler's host sync, or at the launches when
        the chunk samples nothing, so it can read low there."""
        t0 = time.perf_counter() if timed else 0.0
        results = self._eager(scheduled)
        if timed:
            self.last_prefill_s = time.perf_counter() - t0
        return results

    def _eager(self, scheduled: list[ScheduledSeq]) -> PartResults:
        batch = self.prepare(scheduled)
        if self._step_hook is not None:
            self._step_hook(batch)
        t0 = time.perf_counter_ns()
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows]) if batch.sample_rows else None
        t1 = time.perf_counter_ns()
        self._model_ns += t1 - t0
        samplers = [s for s in batch.order if s.samples]
        scheds = [s for s in batch.order if not s.samples]
        results: list[SampleResult | None] = [None] * len(scheds)
        if samplers and logits is not None:
            seqs = [s.seq for s in samplers]
            t2 = time.perf_counter_ns()
            samples = sample(logits, seqs, self._masks(seqs))
            self._sample_ns += time.perf_counter_ns() - t2
            scheds += samplers
            results += samples
        return scheds, results


def dummy_decode_batch(
    batch: int, block: int, block_size: int, device: torch.device | str, width: int = MIN_TABLE_WIDTH + 1
) -> torch.Tensor:
    """A decode batch whose every row reads and writes only `block` (start-up traces and warm-ups). The default
    width differs from the minimum so that tracing never meets a dimension equal to another by accident."""
    buf = torch.zeros((batch, DECODE_COLS + width), dtype=torch.long, device=device)
    buf[:, SLOT] = block * block_size
    buf[:, CONTEXT] = 1
    buf[:, DECODE_COLS:] = block
    return buf
