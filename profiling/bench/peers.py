"""The decode report's peers: other engines timed on the same prompts, back to back with each glowplug run.

A peer ratio is paired: for each repeat i the glowplug cell runs, then every peer runs on the same prompt token ids
(same streaming-read probe, a few seconds apart), and ratio_i = glowplug tok/s_i / peer tok/s_i. The report shows
the median ratio and the worst pair (the smallest), so a bandwidth drift between runs cannot pass for a speed-up.

Peers and their decode-time definitions (prefill excluded for every engine, as glowplug's decode tok/s is):
- transformers (`generate`, greedy): generate(N new tokens) minus generate(1 new token) on the same inputs, so the
  prompt's forward pass and the first token cancel out; tok/s = batch x (N - 1) / that difference.
- llama.cpp (llama-cpp-python's `Llama.generate`, greedy: temp 0, no repeat penalty): the prompt is evaluated and
  its first token sampled (the prefill), then the clock runs over the next N - 1 single-token evals + samples;
  tok/s = (N - 1) / that time. Batch 1 only: the high-level API decodes one sequence.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

Clock = Callable[[], float]


@dataclass
class PeerRuns:
    """One peer's runs inside one glowplug cell, in the cell's repeat order (or why it has none)."""

    label: str
    tokens_per_s: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    skipped: str = ""

    def ratios(self, glowplug_tps: Sequence[float]) -> list[float]:
        """glowplug tok/s over this peer's, run i against run i (both measured back to back)."""
        return [g / p for g, p in zip(glowplug_tps, self.tokens_per_s)]


@dataclass(frozen=True)
class PairedRatio:
    median: float
    worst: float  # the smallest pair: the verdict's number
    n: int


def paired_ratio(glowplug_tps: Sequence[float], peer: PeerRuns) -> PairedRatio | None:
    pairs = peer.ratios(glowplug_tps)
    if not pairs:
        return None
    return PairedRatio(statistics.median(pairs), min(pairs), len(pairs))


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

    def skip_reason(self, batch: int) -> str | None: ...

    def time_decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """(decode tok/s, ms per decode step) for one run of `prompts` as one batch."""
        ...


@dataclass
class SkippedPeer:
    """A requested peer that cannot run here: its column says why, and the bench goes on."""

    label: str
    reason: str
    held_bytes: int = 0

    def skip_reason(self, batch: int) -> str | None:
        return self.reason

    def time_decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        raise RuntimeError(self.reason)


def time_hf_decode(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, float]:
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
    return len(prompts) * steps / decode, decode / steps * 1000


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
            b.numel() * b.element_size() for b in self.model.buffers())  # fmt: skip

    def skip_reason(self, batch: int) -> str | None:
        return None

    def time_decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        if len(prompts) not in self._warm:  # first use of this batch shape: its allocations, untimed
            time_hf_decode(self.model, prompts, 4, self.pad_id)
            self._warm.add(len(prompts))
        return time_hf_decode(self.model, prompts, new_tokens, self.pad_id)


def load_hf_peers(model_dir: Path, dtypes: Sequence[Any], device: str) -> list[Peer]:
    """One transformers peer per dtype (the same folder or GGUF the engine loaded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...engine.models.store import transformers_args

    where, kw = transformers_args(model_dir)  # a folder prepared from a GGUF: transformers reads the GGUF
    tok = AutoTokenizer.from_pretrained(where, **kw)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out: list[Peer] = []
    for dtype in dtypes:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw).to(device).eval()
        out.append(HFPeer(f"transformers {str(dtype).removeprefix('torch.')}", model, pad))
    return out


def time_llamacpp_decode(llm: Any, prompt: Sequence[int], new_tokens: int, clock: Clock = time.perf_counter
                         ) -> tuple[float, float]:  # fmt: skip
    """llama.cpp's decode on one prompt: the first generated token closes the prefill; the clock then runs over
    the next `new_tokens - 1` tokens (each one eval of the previous token plus a greedy sample)."""
    llm.reset()  # no prefix reuse from the previous run: every run evaluates its whole prompt
    tokens: Iterator[int] = llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                         repeat_penalty=1.0, reset=True)  # fmt: skip
    next(tokens)  # the prompt's eval and the first token: the prefill
    t0 = clock()
    for _ in range(new_tokens - 1):
        next(tokens)
    elapsed = clock() - t0
    steps = new_tokens - 1
    return steps / elapsed, elapsed / steps * 1000


@dataclass
class LlamaCppPeer:
    """llama-cpp-python on the GGUF the engine loaded, the threads torch uses, batch 1."""

    llm: Any
    gguf: Path
    label: str = "llama.cpp"
    _warm: bool = False

    @property
    def held_bytes(self) -> int:
        # The weights are mmapped from the file and all read every step, so the file's bytes are resident.
        return self.gguf.stat().st_size

    def skip_reason(self, batch: int) -> str | None:
        return None if batch == 1 else "llama.cpp peer runs batch 1 only"

    def time_decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        if len(prompts) != 1:
            raise ValueError("llama.cpp peer runs batch 1 only")
        if not self._warm:
            time_llamacpp_decode(self.llm, prompts[0], 4)
            self._warm = True
        return time_llamacpp_decode(self.llm, prompts[0], new_tokens)


def load_llamacpp_peer(model_dir: Path, n_ctx: int, n_threads: int) -> Peer:
    """The llama.cpp peer, or a SkippedPeer saying why not (module missing, model not from a GGUF)."""
    label = "llama.cpp"
    try:
        import llama_cpp
    except ImportError as exc:
        return SkippedPeer(label, f"llama_cpp not importable ({exc})")
    from ...engine.models.store import gguf_file_for

    gguf = gguf_file_for(model_dir)
    if gguf is None:
        return SkippedPeer(label, f"{model_dir} was not prepared from a GGUF")
    try:
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                              n_batch=min(n_ctx, 2048), logits_all=False, verbose=False)  # fmt: skip
    except Exception as exc:  # an optional peer: an architecture or build it cannot load costs its column only
        return SkippedPeer(label, f"llama.cpp could not load {gguf.name}: {type(exc).__name__}: {exc}")
    return LlamaCppPeer(llm, gguf, f"llama.cpp {getattr(llama_cpp, '__version__', '')}".strip())
