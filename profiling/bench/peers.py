"""The decode report's peers: other engines timed on the same prompts, back to back with each glowplug run.

A peer ratio is paired: for each repeat i the glowplug cell runs, then every peer runs on the same prompt token ids
(same streaming-read probe, a few seconds apart), and ratio_i = glowplug tok/s_i / peer tok/s_i. The report shows
the median ratio and the worst pair (the smallest), so a bandwidth drift between runs cannot pass for a speed-up.
The prefill is paired the same way: peer prefill ms_i / glowplug prefill ms_i (above 1: glowplug is faster).

Peers and their decode-time definitions (prefill excluded for every engine, as glowplug's decode tok/s is):
- transformers (`generate`, greedy): generate(N new tokens) minus generate(1 new token) on the same inputs, so the
  prompt's forward pass and the first token cancel out; tok/s = batch x (N - 1) / that difference. Its prefill:
  generate(1 new token).
- llama.cpp (llama-cpp-python's `Llama.generate`, greedy: temp 0, no repeat penalty): the prompt is evaluated and
  its first token sampled (the prefill), then the clock runs over the next N - 1 single-token evals + samples;
  tok/s = (N - 1) / that time. Batch 1 only: the generator decodes one sequence.
- llama.cpp batched (the library's C API through llama-cpp-python's bindings, as llama.cpp's batched-bench runs
  it): one context with n_seq_max = the batch (a KV stream per sequence, `kv_unified` off: the sequences share no
  prefix), n_batch = n_ubatch = 512 (llama-bench's pp512 setting), the same threads. The prompts of every sequence
  go through llama_decode in batches of n_batch tokens, each sequence's last position asking for logits, and each
  sequence's first token is the argmax of those (the prefill); then each step is ONE llama_decode of a batch
  holding every sequence's last token (its own seq id and position), and a greedy argmax per sequence.
  tok/s = batch x (N - 1) / the steps' time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

Clock = Callable[[], float]


@dataclass(frozen=True)
class PeerTiming:
    """One peer run: decode tok/s (every sequence, prefill excluded), ms per decode step, and the prefill (every
    prompt evaluated and every first token chosen) in ms."""

    tokens_per_s: float
    step_ms: float
    prefill_ms: float


@dataclass
class PeerRuns:
    """One peer's runs inside one glowplug cell, in the cell's repeat order (or why it has none)."""

    label: str
    tokens_per_s: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    skipped: str = ""
    prefill_ms: list[float] = field(default_factory=list)

    def ratios(self, glowplug_tps: Sequence[float]) -> list[float]:
        """glowplug tok/s over this peer's, run i against run i (both measured back to back)."""
        return [g / p for g, p in zip(glowplug_tps, self.tokens_per_s)]

    def prefill_ratios(self, glowplug_prefill_ms: Sequence[float]) -> list[float]:
        """This peer's prefill time over glowplug's, run i against run i: glowplug's prefill speed-up."""
        return [p / g for g, p in zip(glowplug_prefill_ms, self.prefill_ms) if g > 0]

    def append(self, timing: PeerTiming) -> None:
        self.tokens_per_s.append(timing.tokens_per_s)
        self.step_ms.append(timing.step_ms)
        self.prefill_ms.append(timing.prefill_ms)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerRuns:
        return cls(
            str(d["label"]),
            list(d.get("tokens_per_s", [])),
            list(d.get("step_ms", [])),
            str(d.get("skipped", "")),
            list(d.get("prefill_ms", [])),
        )


@dataclass(frozen=True)
class PairedRatio:
    median: float
    worst: float  # the smallest pair: the verdict's number
    n: int


def pair_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> PairedRatio | None:
    """numerator_i / denominator_i over the runs both have, in run order (never sorted first: a pair is one moment of
    the machine): the median and the worst (smallest) pair; None without a pair."""
    pairs = [a / b for a, b in zip(numerator, denominator) if b > 0]
    if not pairs:
        return None
    return PairedRatio(statistics.median(pairs), min(pairs), len(pairs))


def paired_ratio(glowplug_tps: Sequence[float], peer: PeerRuns) -> PairedRatio | None:
    return pair_ratios(glowplug_tps, peer.tokens_per_s)


def fmt_ratio(r: PairedRatio | None, why: str = "") -> str:
    """A table cell: "2.10x (worst 1.95x, n=3)", or "skipped: <reason>"."""
    if r is None:
        return f"skipped: {why}" if why else "-"
    return f"{r.median:.2f}x (worst {r.worst:.2f}x, n={r.n})"


class Peer(Protocol):
    label: str

    @property
    def held_bytes(self) -> int:
        """Bytes this peer's model keeps in the process (its weights), for the memory split."""
        ...

    @property
    def info(self) -> str:
        """What the report says about this peer's build ("" when nothing beyond its label)."""
        ...

    def skip_reason(self, batch: int) -> str | None: ...

    def time_run(self, prompts: list[list[int]], new_tokens: int) -> PeerTiming:
        """One run of `prompts` as one batch: its decode and its prefill."""
        ...

    def close(self) -> None:
        """Release what the peer holds outside Python's reach (native contexts)."""
        ...


@dataclass
class SkippedPeer:
    """A requested peer that cannot run here: its column says why, and the bench goes on."""

    label: str
    reason: str
    held_bytes: int = 0
    info: str = ""

    def skip_reason(self, batch: int) -> str | None:
        return self.reason

    def time_run(self, prompts: list[list[int]], new_tokens: int) -> PeerTiming:
        raise RuntimeError(self.reason)

    def close(self) -> None:
        return None


def time_hf_decode(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> PeerTiming:
    """transformers' decode: generate(N) - generate(1) on the same inputs (see the module docstring)."""
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)

    def now() -> float:  # generate returns once its tokens are on the host, but be explicit on a GPU
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    with torch.inference_mode():
        t0 = now()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = now()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = now()
    decode = (t2 - t1) - (t1 - t0)
    steps = new_tokens - 1
    return PeerTiming(len(prompts) * steps / decode, decode / steps * 1000, (t1 - t0) * 1000)


@dataclass
class HFPeer:
    """transformers' generate in one dtype, loaded once and timed inside every glowplug cell."""

    label: str
    model: Any
    pad_id: int
    _warm: set[int] = field(default_factory=set)

    @property
    def held_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + sum(
            b.numel() * b.element_size() for b in self.model.buffers()
        )

    @property
    def info(self) -> str:
        import transformers

        return f"transformers {transformers.__version__}"

    def skip_reason(self, batch: int) -> str | None:
        return None

    def time_run(self, prompts: list[list[int]], new_tokens: int) -> PeerTiming:
        if len(prompts) not in self._warm:  # first use of this batch shape: its allocations, untimed
            time_hf_decode(self.model, prompts, 4, self.pad_id)
            self._warm.add(len(prompts))
        return time_hf_decode(self.model, prompts, new_tokens, self.pad_id)

    def close(self) -> None:
        return None


def load_hf_peers(model_dir: Path, dtypes: Sequence[Any], device: str) -> list[Peer]:
    """One transformers peer per dtype (the same folder or GGUF the engine loaded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from glowplug.engine.models.store import transformers_args

    where, kw = transformers_args(model_dir)  # a folder prepared from a GGUF: transformers reads the GGUF
    tok = AutoTokenizer.from_pretrained(where, **kw)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out: list[Peer] = []
    for dtype in dtypes:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw).to(device).eval()
        out.append(HFPeer(f"transformers {str(dtype).removeprefix('torch.')}", model, pad))
    return out


# ------------------------------------------------------------------------------------------------ llama.cpp
LLAMACPP_N_BATCH = 512  # llama-bench's pp512: n_batch = n_ubatch = 512


def llamacpp_build() -> str:
    """The library's version and the build flags it reports (llama_print_system_info), for the report."""
    import llama_cpp

    flags = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip().rstrip("|").strip()
    return f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}; llama_print_system_info: {flags}"


def time_llamacpp_decode(
    llm: Any, prompt: Sequence[int], new_tokens: int, clock: Clock = time.perf_counter
) -> PeerTiming:
    """llama.cpp's decode on one prompt: the first generated token closes the prefill; the clock then runs over
    the next `new_tokens - 1` tokens (each one eval of the previous token plus a greedy sample)."""
    llm.reset()  # no prefix reuse from the previous run: every run evaluates its whole prompt
    tokens: Iterator[int] = llm.generate(
        list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
    )
    p0 = clock()
    next(tokens)  # the prompt's eval and the first token: the prefill
    t0 = clock()
    for _ in range(new_tokens - 1):
        next(tokens)
    elapsed = clock() - t0
    steps = new_tokens - 1
    return PeerTiming(steps / elapsed, elapsed / steps * 1000, (t0 - p0) * 1000)


@dataclass
class LlamaCppPeer:
    """llama-cpp-python's generator loop on the GGUF the engine loaded, the threads torch uses, batch 1."""

    llm: Any
    gguf: Path
    label: str = "llama.cpp"
    _warm: bool = False

    @property
    def held_bytes(self) -> int:
        # The weights are mmapped from the file and all read every step, so the file's bytes are resident.
        return self.gguf.stat().st_size

    @property
    def info(self) -> str:
        return f"{llamacpp_build()}; Llama.generate, n_batch {self.llm.n_batch}, n_threads {self.llm.n_threads}"

    def skip_reason(self, batch: int) -> str | None:
        return None if batch == 1 else "the generator loop decodes one sequence (llama.cpp batched runs batches)"

    def time_run(self, prompts: list[list[int]], new_tokens: int) -> PeerTiming:
        if len(prompts) != 1:
            raise ValueError("the llama.cpp generator peer runs batch 1 only")
        if not self._warm:
            time_llamacpp_decode(self.llm, prompts[0], 4)
            self._warm = True
        return time_llamacpp_decode(self.llm, prompts[0], new_tokens)

    def close(self) -> None:
        return None


def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class LlamaCppBatchedPeer:
    """llama.cpp's batched decode (see the module docstring) on the model a `llama_cpp.Llama` loaded: one context per
    batch size, made when a cell of that size first runs and freed when another size comes (or at `close`)."""

    def __init__(
        self,
        llm: Any,
        gguf: Path,
        n_threads: int,
        seq_tokens: int,
        *,
        shares_model: bool = False,
        n_batch: int = LLAMACPP_N_BATCH,
        label: str = "llama.cpp batched",
    ) -> None:
        """`llm`: a llama_cpp.Llama whose model (its public `model` handle) this peer reads; `seq_tokens`: KV cells
        each sequence needs (the longest prompt + new tokens); `shares_model`: another peer already counts the
        file's bytes in the memory split."""
        import llama_cpp

        self._lc = llama_cpp
        self.llm, self.gguf, self.n_threads, self.n_batch, self.label = llm, gguf, n_threads, n_batch, label
        self.seq_tokens = _pad_to(seq_tokens, 256)  # llama.cpp pads a context to 256 cells
        self.shares_model = shares_model
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model)))
        self._ctx: Any = None
        self._n_seq = 0
        self._batch: Any = None
        self._batch_cap = 0
        self._warm = False

    @property
    def held_bytes(self) -> int:
        return 0 if self.shares_model else self.gguf.stat().st_size

    @property
    def info(self) -> str:
        return (
            f"{llamacpp_build()}; C API batched decode, n_batch = n_ubatch = {self.n_batch}, n_threads "
            f"{self.n_threads}, {self.seq_tokens} KV cells per sequence, kv_unified off, the library's default "
            "context settings otherwise (flash attention: auto; KV cache: f16)"
        )

    def skip_reason(self, batch: int) -> str | None:
        return None

    def _context(self, n_seq: int) -> Any:
        lc = self._lc
        if self._ctx is not None and self._n_seq == n_seq:
            return self._ctx
        self._free_context()
        p = lc.llama_context_default_params()
        p.n_ctx = n_seq * self.seq_tokens
        p.n_batch = p.n_ubatch = self.n_batch
        p.n_seq_max = n_seq
        p.n_threads = p.n_threads_batch = self.n_threads
        p.kv_unified = False
        ctx = lc.llama_init_from_model(self.llm.model, p)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {n_seq} sequences of {self.seq_tokens} tokens")
        self._ctx, self._n_seq, self._warm = ctx, n_seq, False
        need = max(self.n_batch, n_seq)
        if need > self._batch_cap:
            if self._batch is not None:
                lc.llama_batch_free(self._batch)
            self._batch, self._batch_cap = lc.llama_batch_init(need, 0, 1), need
        return ctx

    def _free_context(self) -> None:
        if self._ctx is not None:
            self._lc.llama_free(self._ctx)
            self._ctx, self._n_seq = None, 0

    def close(self) -> None:
        self._free_context()
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch, self._batch_cap = None, 0

    def _decode(self, ctx: Any, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self._batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(out)
            b.seq_id[i][0] = seq
        rc = self._lc.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")

    def _argmax(self, ctx: Any, i: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self._lc.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(
        self, prompts: list[list[int]], new_tokens: int, clock: Clock = time.perf_counter
    ) -> tuple[PeerTiming, list[list[int]]]:
        """One timed run (see the module docstring) and the greedy tokens of every sequence."""
        n_seq = len(prompts)
        ctx = self._context(n_seq)
        if max(len(p) for p in prompts) + new_tokens > self.seq_tokens:
            raise ValueError(
                f"a prompt of {max(len(p) for p in prompts)} tokens and {new_tokens} new ones do not fit "
                f"the {self.seq_tokens} KV cells per sequence"
            )
        self._lc.llama_memory_clear(self._lc.llama_get_memory(ctx), True)
        entries = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        out: list[list[int]] = [[] for _ in prompts]
        p0 = clock()
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            self._decode(ctx, chunk)
            for i, (_, _, s, wants) in enumerate(chunk):
                if wants:
                    out[s].append(self._argmax(ctx, i))
        t0 = clock()
        for step in range(new_tokens - 1):
            self._decode(ctx, [(out[s][-1], len(prompts[s]) + step, s, True) for s in range(n_seq)])
            for s in range(n_seq):
                out[s].append(self._argmax(ctx, s))
        elapsed = clock() - t0
        steps = new_tokens - 1
        return PeerTiming(n_seq * steps / elapsed, elapsed / steps * 1000, (t0 - p0) * 1000), out

    def time_run(self, prompts: list[list[int]], new_tokens: int) -> PeerTiming:
        self._context(len(prompts))
        if not self._warm:  # a new context's first decodes allocate its compute buffers: untimed
            self.generate(prompts, 4)
            self._warm = True
        return self.generate(prompts, new_tokens)[0]


def load_llamacpp_peers(model_dir: Path, kinds: Sequence[str], seq_tokens: int, n_threads: int) -> list[Peer]:
    """The llama.cpp peers of `kinds` ("llamacpp": the generator loop, "llamacpp-batched": the C API's batches) on
    one loaded model, or one SkippedPeer per kind saying why not (module missing, model not from a GGUF)."""
    labels = {"llamacpp": "llama.cpp", "llamacpp-batched": "llama.cpp batched"}
    try:
        import llama_cpp
    except ImportError as exc:
        return [SkippedPeer(labels[k], f"llama_cpp not importable ({exc})") for k in kinds]
    from glowplug.engine.models.store import gguf_file_for

    gguf = gguf_file_for(model_dir)
    if gguf is None:
        return [SkippedPeer(labels[k], f"{model_dir} was not prepared from a GGUF") for k in kinds]
    n_ctx = seq_tokens + 16
    try:
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_batch=min(n_ctx, 2048),
            logits_all=False,
            verbose=False,
        )
    except Exception as exc:  # an optional peer: an architecture or build it cannot load costs its column only
        why = f"llama.cpp could not load {gguf.name}: {type(exc).__name__}: {exc}"
        return [SkippedPeer(labels[k], why) for k in kinds]
    out: list[Peer] = []
    for kind in kinds:
        if kind == "llamacpp":
            out.append(LlamaCppPeer(llm, gguf))
        else:
            out.append(LlamaCppBatchedPeer(llm, gguf, n_threads, seq_tokens, shares_model="llamacpp" in kinds))
    return out


def load_llamacpp_peer(model_dir: Path, n_ctx: int, n_threads: int) -> Peer:
    """The generator-loop peer alone (load_llamacpp_peers with "llamacpp")."""
    return load_llamacpp_peers(model_dir, ["llamacpp"], n_ctx, n_threads)[0]
