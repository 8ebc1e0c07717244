"""The persistent decode batch against a plain-Python oracle that rebuilds every row from the sequences.

Random lives of sequences (hypothesis): they arrive, decode in compiled steps (joining, leaving and reordering
between steps, crossing block boundaries), take eager steps (where the runner empties the batch), get preempted and
re-prefilled, finish; a step's results sometimes never reach the batch (or never reach the sequences). Before every
compiled step the batch's input must equal the rows rebuilt from scratch.

Then the runner: an engine whose decode steps run through the persistent batch (the eager decode math installed
as the "compiled" step, so no compile is needed) must feed the step exactly what `prepare_decode` builds from
scratch, and produce the greedy tokens of a plain eager engine.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glowplug.engine.attention import DECODE_COLS
from glowplug.engine.decode_batch import MIN_TABLE_WIDTH, DecodeBatch
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.sequence import RunnerSeq as Sequence

SCRATCH = 999


def oracle_rows(seqs: list[Sequence], block_size: int, rows: int, width: int) -> list[list[int]]:
    """The decode input rebuilt from scratch: one row per sequence, then padding rows."""
    out = []
    for s in seqs:
        pos = s.num_computed_tokens
        table = s.block_table
        slot = table[pos // block_size] * block_size + pos % block_size
        out.append([s.last_token_id, pos, slot, pos + 1] + table + [SCRATCH] * (width - len(table)))
    pad = [0, 0, SCRATCH * block_size, 1] + [SCRATCH] * width
    return out + [pad] * (rows - len(seqs))


class World:
    """Sequences with block tables, moved on the way the scheduler and the engine move them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = itertools.count()
        self.ids = itertools.count()
        self.live: list[Sequence] = []  # arrival order, as the scheduler's running list

    def allocate(self, seq: Sequence, tokens: int) -> None:
        need = -(-tokens // self.block_size)
        while len(seq.block_table) < need:
            seq.block_table.append(next(self.blocks))

    def arrive(self, prompt_len: int, first_token: int) -> Sequence:
        """A new sequence whose prompt was prefilled (eagerly) and sampled its first token."""
        prompt = [(7 * i) % 50 for i in range(prompt_len)]
        seq = Sequence(next(self.ids), "r", prompt, [], SamplingParams(), None, [], 0)
        self.allocate(seq, prompt_len)
        seq.num_computed_tokens = prompt_len
        seq.output_token_ids.append(first_token)
        self.live.append(seq)
        return seq

    def schedule_decode(self, seq: Sequence) -> None:
        self.allocate(seq, seq.num_computed_tokens + 1)  # the block the next position needs

    def book(self, seq: Sequence, token: int) -> None:
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(token)

    def preempt_and_reprefill(self, seq: Sequence, token: int) -> None:
        """Freed (a new, empty table), then recomputed eagerly: every known token, plus a sampled one."""
        seq.block_table = []
        self.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        seq.output_token_ids.append(token)


def check(batch: DecodeBatch, seqs: list[Sequence], block_size: int, pad: int, fixed_width: int = 0) -> None:
    """`fixed_width`: the batch keeps that many table columns (CUDA graphs), else its longest table's."""
    width = fixed_width or max([MIN_TABLE_WIDTH] + [len(s.block_table) for s in seqs])
    assert batch.width == width and batch.cols == DECODE_COLS + width
    rows = len(seqs) + pad
    assert batch.rows(rows).tolist() == oracle_rows(seqs, block_size, rows, width)
    assert batch.seqs == tuple(seqs)


@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), fixed=st.booleans())
def test_deltas_match_rebuilding_from_scratch(data: st.DataObject, block_size: int, fixed: bool) -> None:
    max_rows, max_width = 6, 64
    world = World(block_size)
    batch = DecodeBatch(max_rows, max_width, block_size, SCRATCH, fixed_width=fixed)
    fixed_width = max_width if fixed else 0
    token = st.integers(0, 49)

    def compiled_step(seqs: list[Sequence]) -> None:
        for s in seqs:
            world.schedule_decode(s)
        batch.sync(seqs)
        padding = data.draw(st.integers(0, min(2, max_rows - len(seqs))), label="padding")
        check(batch, seqs, block_size, padding, fixed_width)
        sampled = [data.draw(token) for _ in seqs]
        # A step's results sometimes reach only the batch or only the sequences (an exception between the two).
        fate = data.draw(st.sampled_from(["both", "both", "both", "batch only", "seqs only"]), label="fate")
        if fate != "seqs only":
            batch.advance(sampled)
        if fate != "batch only":
            for s, t in zip(seqs, sampled):
                world.book(s, t)

    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(["arrive", "compiled", "compiled", "compiled", "eager", "preempt", "finish"]))
        if op == "arrive" and len(world.live) < max_rows:
            world.arrive(data.draw(st.integers(1, 3 * block_size + 1)), data.draw(token))
        elif op == "compiled" and world.live:
            # Usually every live sequence in arrival order; sometimes some sit out (a spent token budget, or still
            # prefilling) or come in another order (a chunked prompt finishing after a later arrival's).
            seqs = list(world.live)
            if data.draw(st.booleans(), label="subset"):
                seqs = data.draw(st.lists(st.sampled_from(world.live), unique=True, min_size=1), label="chosen")
            compiled_step(seqs)
        elif op == "eager" and world.live:
            batch.clear()  # what the runner does on a step without the compiled decode
            for s in world.live:
                world.schedule_decode(s)
                world.book(s, data.draw(token))
        elif op == "preempt" and world.live:
            # Preempted, then recomputed in a later step's eager part; that step's decode rows (the others) run
            # compiled, or, with no others, the step is eager alone and the runner empties the batch.
            victim = data.draw(st.sampled_from(world.live))
            world.preempt_and_reprefill(victim, data.draw(token))
            others = [s for s in world.live if s is not victim]
            if others:
                compiled_step(others)
            else:
                batch.clear()
        elif op == "finish" and world.live:
            world.live.remove(data.draw(st.sampled_from(world.live)))
    # Whatever happened, one more compiled step over everyone still sees the rows rebuilt from scratch.
    if world.live:
        for s in world.live:
            world.schedule_decode(s)
        batch.sync(world.live)
        check(batch, world.live, block_size, 0, fixed_width)


def test_add_remove_advance_directly() -> None:
    world = World(block_size=2)
    batch = DecodeBatch(4, 8, 2, SCRATCH)
    a, b, c = (world.arrive(n, 10 + n) for n in (1, 2, 3))
    for s in (a, b, c):
        world.schedule_decode(s)
        batch.add(s)
    batch.sync([a, b, c])
    check(batch, [a, b, c], 2, 1)
    batch.remove(1)  # b leaves: c moves up into its row
    batch.sync([a, c])
    check(batch, [a, c], 2, 0)
    batch.advance([21, 23])
    for s, t in ((a, 21), (c, 23)):
        world.book(s, t)
        world.schedule_decode(s)
    batch.sync([a, c])
    check(batch, [a, c], 2, 0)
    assert a.num_computed_tokens == 2 and len(a.block_table) == 2  # crossed into its second block


def test_full_batch_and_too_wide_tables_are_refused() -> None:
    world = World(block_size=1)
    batch = DecodeBatch(1, 4, 1, SCRATCH)
    s = world.arrive(2, 5)
    world.schedule_decode(s)
    batch.add(s)
    with pytest.raises(ValueError, match="full"):
        batch.add(world.arrive(1, 5))
    wide = world.arrive(4, 5)
    world.schedule_decode(wide)  # 5 blocks of 1 token, 4 planned
    with pytest.raises(ValueError, match="more than the 4 planned"):
        batch.sync([wide])


# ------------------------------------------------------------------------------------------------ the runner

PROMPTS = ["The scheduler", "A", "glowplug starts", "emoji 🚀", "x y z", "Numbers 0 1 2", "The quick", "B"]


def _checked_engine(make_llm: Any, model: Any, **kw: Any) -> tuple[Any, list[int]]:
    """An eager engine whose decode-only steps run the eager decode math through the persistent batch; every
    step's input is compared with the rows `prepare_decode` rebuilds from scratch."""
    llm = make_llm(model, compile="off", **kw)
    eng = llm.engine
    runner = eng.runner
    scheduled: list[Any] = []
    apply = runner.apply

    def recording(out: Any) -> Any:
        rows = apply(out)
        scheduled[:] = [s for s in rows if s.is_decode]  # a one-token prompt runs the prompt path
        return rows

    runner.apply = recording
    calls = [0]

    def step(packed: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        got = packed.clone()
        want = runner.prepare_decode(scheduled).clone()  # rewrites the staging buffer: compare first, then run
        assert torch.equal(got, want)
        return runner.eager_decode(got)

    runner.install_decode(step, list(range(1, runner.max_decode_batch + 1)))
    return llm, calls


def test_runner_feeds_the_rebuilt_rows_and_keeps_eager_tokens(tiny_dir, make_llm) -> None:
    model = tiny_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=20, ignore_eos=True, n=2)
    plain = make_llm(model, compile="off", block_size=4)
    want = [o.outputs for o in plain.generate(PROMPTS, params)] + [
        o.outputs for o in plain.generate(PROMPTS[:2], sampled)
    ]
    llm, calls = _checked_engine(make_llm, model, block_size=4)
    eng = llm.engine
    # Arrivals while others decode (mixed steps), an abort mid-way, sampled rows beside greedy ones.
    outs: dict[str, Any] = {}
    pending = [(p, params) for p in PROMPTS] + [(p, sampled) for p in PROMPTS[:2]]
    ids = []
    doomed = eng.add_request("to be aborted", params).request_id
    while pending or eng.has_unfinished():
        if pending:
            p, sp = pending.pop(0)
            ids.append(eng.add_request(p, sp).request_id)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs
        if calls[0] == 3:
            eng.abort(doomed)
    assert calls[0] > 20
    got = [outs[i] for i in ids]
    assert [[c.token_ids for c in o] for o in got] == [[c.token_ids for c in o] for o in want]


def test_runner_batch_survives_preemption(tiny_dir, make_llm) -> None:
    """20 blocks of 4 tokens for eight sequences: the scheduler preempts and recomputes; the batch's rows of
    preempted sequences leave and come back, and the tokens are those of a roomy eager engine."""
    model = tiny_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = make_llm(model, compile="off", num_gpu_blocks_override=512, max_model_len=80)
    want = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params)]
    llm, calls = _checked_engine(make_llm, model, num_gpu_blocks_override=20, cache={"block_size": 4}, max_model_len=80)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert llm.engine.stats().num_preemptions > 0 and calls[0] > 0
    assert got == want
