"""The compiled decode step's input rows, kept from one step to the next and updated by deltas.

The decode step reads one int64 row per sequence: token, position, cache slot, context length, then the block table
(engine/attention.py's packed layout), as one contiguous [rows, DECODE_COLS + width] array whose width is the
longest block table. Rebuilding every row each step costs Python and numpy work per row and per block-table entry;
like vLLM v1's persistent input batch, this keeps the rows laid out in that array from step to step and changes
only what a step changed:

- `add`: a sequence joins decoding; its row is written whole, block table included.
- `remove`: a sequence left (finished, aborted, preempted, or not scheduled this step); the rows after it move up
  one, so the rows keep the scheduler's order (the results go back in that order).
- `advance`: after a step, every row moves on by one token (the sampled one).
- `sync`: before the next step, the rows are matched with that step's sequences and written: token, position,
  slot and context per row, and a new block-table entry only for a row whose position entered a new block (the
  scheduler allocates that block when it schedules the step).

A step's host work is one Python pass over the rows plus numpy work for the rows that joined, left or entered a
block. The pass writes through a memoryview, not numpy: right after the model step numpy's per-call machinery is
cold (the step sweeps the CPU caches), and each numpy call then costs about as much as the whole pass.

A row is trusted only while its sequence is where the batch expects it: `sync` compares every row's position with
its sequence's computed tokens and rewrites the rows that moved on outside the batch (a step whose results never
reached it). Its caller (engine/model_runner.py) also empties the batch on any step that does not run the compiled
decode, so rows only ever carry over between consecutive compiled steps.
"""

from __future__ import annotations

import numpy as np

from .attention import CONTEXT, DECODE_COLS, POSITION, SLOT, TOKEN
from .sequence import RunnerSeq

# Block tables are at least this wide: a width of 1 is a size-1 dimension the traced graph would specialise on.
MIN_TABLE_WIDTH = 2


class DecodeBatch:
    """Rows of decoding sequences in `buffer` (flat int64, at least max_rows * (DECODE_COLS + max_width) long),
    laid out as [len(self), self.cols]. `fixed_width`: the layout keeps all max_width table columns (fixed-shape
    CUDA graphs); otherwise its width follows the longest table, at least MIN_TABLE_WIDTH."""

    def __init__(
        self,
        max_rows: int,
        max_width: int,
        block_size: int,
        scratch_block: int,
        *,
        buffer: np.ndarray | None = None,
        fixed_width: bool = False,
    ) -> None:
        self.max_rows = max_rows
        self.max_width = max_width
        self.block_size = block_size
        self.scratch_block = scratch_block
        size = max_rows * (DECODE_COLS + max_width)
        self.buffer = np.zeros(size, dtype=np.int64) if buffer is None else buffer
        if self.buffer.dtype != np.int64 or self.buffer.ndim != 1 or len(self.buffer) < size:
            raise ValueError(f"the decode batch needs a flat int64 buffer of at least {size} elements")
        self._mv = memoryview(self.buffer)  # type: ignore[arg-type]
        self._fixed = fixed_width
        self._width = max_width if fixed_width else MIN_TABLE_WIDTH
        # Per row, in Python (the pass in `sync` reads them without numpy): the sequence, the block-table entries
        # written, the slot where the row's current block starts, the next token, and the position the row holds,
        # kept as an offset from a step count that `advance` bumps, so a step moves every row on at once.
        self._seqs: list[RunnerSeq] = []
        self._nblocks: list[int] = []
        self._block_start: list[int] = []
        self._tokens: list[int] = []
        self._base: list[int] = []
        self._steps = 0
        # The row padding writes (fixed-shape CUDA graphs): it reads and writes only the scratch block.
        self._pad_row = np.full(DECODE_COLS + max_width, scratch_block, dtype=np.int64)
        self._pad_row[[TOKEN, POSITION, SLOT, CONTEXT]] = (0, 0, scratch_block * block_size, 1)

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def seqs(self) -> tuple[RunnerSeq, ...]:
        """The sequences, in row order."""
        return tuple(self._seqs)

    @property
    def width(self) -> int:
        """Block-table columns of the layout."""
        return self._width

    @property
    def cols(self) -> int:
        return DECODE_COLS + self._width

    def pad(self, count: int) -> None:
        """Write padding rows after the batch's, up to `count` rows in all."""
        if count > self.max_rows:
            raise ValueError(f"{count} rows asked of a decode batch of {self.max_rows}")
        n, cols = len(self._seqs), self.cols
        if count > n:
            self.buffer[n * cols : count * cols].reshape(count - n, cols)[:] = self._pad_row[:cols]

    def rows(self, count: int) -> np.ndarray:
        """The first `count` rows, padded (see `pad`), as a [count, cols] view of the buffer."""
        self.pad(count)
        return self.buffer[: count * self.cols].reshape(count, self.cols)

    # ------------------------------------------------------------------------------------------------ deltas
    def add(self, seq: RunnerSeq) -> None:
        """Append a row for `seq`, which decodes its next token at position `seq.num_computed_tokens`."""
        row = len(self._seqs)
        if row == self.max_rows:
            raise ValueError(f"the decode batch is full ({self.max_rows} rows)")
        self._seqs.append(seq)
        self._nblocks.append(0)
        self._block_start.append(0)
        self._tokens.append(0)
        self._base.append(0)
        self._write(row, seq)

    def remove(self, row: int) -> None:
        """Drop a row; the rows after it move up one (numpy copies overlapping slices as if through a buffer). The
        layout keeps its width until the next `sync`."""
        n, cols = len(self._seqs), self.cols
        self.buffer[row * cols : (n - 1) * cols] = self.buffer[(row + 1) * cols : n * cols]
        del self._seqs[row], self._nblocks[row], self._block_start[row], self._tokens[row], self._base[row]

    def clear(self) -> None:
        for rows in (self._seqs, self._nblocks, self._block_start, self._tokens, self._base):
            rows.clear()
        if not self._fixed:
            self._width = MIN_TABLE_WIDTH

    def advance(self, tokens: list[int]) -> None:
        """Every row has run one step and sampled `tokens` (one per row, in row order): each moves on by one
        token, to feed that one next. Written into the rows by the next `sync`, once the scheduler has allocated
        the blocks the new positions enter."""
        if len(tokens) != len(self._seqs):
            raise ValueError(f"{len(tokens)} tokens for {len(self._seqs)} rows")
        self._tokens = list(tokens)
        self._steps += 1

    def sync(self, seqs: list[RunnerSeq]) -> None:
        """Make the rows those of `seqs`, this step's decoding sequences in the scheduler's order, and write them:
        rows of sequences that are gone are removed, newcomers added, the order matched."""
        if seqs != self._seqs:  # list equality checks identity first: the steady state costs one pass in C
            self._rearrange(seqs)
        mv, cols, bs, steps = self._mv, self.cols, self.block_size, self._steps
        base, start, tokens = self._base, self._block_start, self._tokens
        moved: list[int] = []
        entered: list[int] = []
        for row, seq in enumerate(seqs):
            pos = seq.num_computed_tokens
            if pos != base[row] + steps:
                moved.append(row)
                continue
            at = row * cols
            mv[at + TOKEN] = tokens[row]
            mv[at + POSITION] = pos
            mv[at + CONTEXT] = pos + 1
            offset = pos % bs
            if offset:
                mv[at + SLOT] = start[row] + offset
            else:
                entered.append(row)
        for row in moved:  # moved on outside the batch (a step's results never reached it): written whole
            self._write(row, seqs[row])
        for row in entered:
            self._enter_block(row, seqs[row])
        if not self._fixed:
            self._relayout(max(MIN_TABLE_WIDTH, max(self._nblocks, default=0)))

    # --------------------------------------------------------------------------------------------- internals
    def _write(self, row: int, seq: RunnerSeq) -> None:
        table = seq.block_table
        self._fit(len(table))
        bs, cols = self.block_size, self.cols
        pos = seq.num_computed_tokens
        start = table[pos // bs] * bs
        r = self.buffer[row * cols : (row + 1) * cols]
        r[:DECODE_COLS] = (seq.last_token_id, pos, start + pos % bs, pos + 1)
        r[DECODE_COLS : DECODE_COLS + len(table)] = table
        r[DECODE_COLS + len(table) :] = self.scratch_block
        self._nblocks[row] = len(table)
        self._block_start[row] = start
        self._tokens[row] = seq.last_token_id
        self._base[row] = pos - self._steps

    def _enter_block(self, row: int, seq: RunnerSeq) -> None:
        """The row's position is the first of a block: copy the table entries the row does not have yet (the
        scheduler has just allocated that block) and point the slot at the block's start."""
        table = seq.block_table
        pos = seq.num_computed_tokens
        block = pos // self.block_size
        if len(table) <= block:
            raise RuntimeError(f"sequence {seq.seq_id} has no KV block for position {pos}")
        have = self._nblocks[row]
        if len(table) > have:
            self._fit(len(table))
            at = row * self.cols + DECODE_COLS
            self.buffer[at + have : at + len(table)] = table[have:]
            self._nblocks[row] = len(table)
        self._block_start[row] = start = table[block] * self.block_size
        self._mv[row * self.cols + SLOT] = start

    def _fit(self, blocks: int) -> None:
        """Make room for a table of `blocks` entries."""
        if blocks > self.max_width:
            raise ValueError(f"a sequence needs {blocks} KV blocks, more than the {self.max_width} planned")
        if blocks > self._width:
            self._relayout(blocks)

    def _relayout(self, width: int) -> None:
        """Lay the rows out at `width` table columns (new columns hold the scratch block)."""
        if width == self._width:
            return
        n, old = len(self._seqs), self.cols
        new = DECODE_COLS + width
        rows = self.buffer[: n * old].reshape(n, old).copy()
        out = self.buffer[: n * new].reshape(n, new)
        keep = min(old, new)
        out[:, :keep] = rows[:, :keep]
        out[:, keep:] = self.scratch_block
        self._width = width

    def _rearrange(self, seqs: list[RunnerSeq]) -> None:
        wanted = set(seqs)
        for row in range(len(self._seqs) - 1, -1, -1):
            if self._seqs[row] not in wanted:
                self.remove(row)
        present = set(self._seqs)
        for seq in seqs:
            if seq not in present:
                self.add(seq)
        if self._seqs != seqs:  # the same sequences in another order (one joined decoding ahead of others)
            where = {s: i for i, s in enumerate(self._seqs)}
            order = [where[s] for s in seqs]
            n, cols = len(seqs), self.cols
            rows = self.buffer[: n * cols].reshape(n, cols)
            rows[:] = rows[order]
            for name in ("_nblocks", "_block_start", "_tokens", "_base"):
                values = getattr(self, name)
                setattr(self, name, [values[i] for i in order])
            self._seqs = list(seqs)
