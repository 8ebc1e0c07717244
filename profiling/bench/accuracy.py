"""Quantization accuracy against the bf16 model: perplexity, mean KL divergence of the next-token distributions,
and top-1 agreement (the three numbers llama.cpp judges its quantization types by).

The evaluation text needs no download and copies no one's prose: a few KB this project wrote (below), plus
continuations that the bf16 model itself generates greedily from the project's own prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

EVAL_TEXT = """\
The lighthouse keeper kept two notebooks. In the first she wrote the weather every hour: the wind, the height of
the swell, the colour of the sky at dawn and at dusk. In the second she wrote down the ships. Most nights there
were none, and the page said only the date and a short line, "sea empty". On the nights there were ships she
drew them, badly, with the lamps they showed and the direction they were heading.

After eleven winters she noticed that the two notebooks told the same story. When the barometer fell for three
days in a row, the fishing boats stayed in the harbour, and the big freighters came closer to the coast, looking
for the calm water behind the headland. When the wind turned to the north, the ferries ran late. She had never
planned to study any of this. It simply accumulated, one careful line at a time.

A bakery opens at four in the morning. The first hour is quiet work: the ovens warm up, the dough that rested
overnight is cut and weighed, and the trays are lined with paper. By five the smell reaches the street. By six
the first customers arrive, mostly people on their way to early shifts, who buy the same thing every day and
pay with exact change. The baker knows their orders before they speak. Nobody writes these orders down, and yet
they are remembered more reliably than most things that are written.

Water boils at a lower temperature on a mountain, because the air pressure is lower. A pot of pasta that takes
ten minutes at sea level can take noticeably longer at altitude, which surprises travellers who trust the
instructions on the packet. Cooks in high towns learn to add time, to cover their pots, and to be patient.

Counting is older than writing. Long before anyone wrote words, people cut notches into sticks and bones to keep
track of days, animals, or debts. A notch is a promise that something happened. Twenty notches in a row say
twenty of something, even if nobody remembers what. The number outlives the story it was counting.

A small program starts slowly for reasons that are easy to miss. It reads its files from disk, it builds its
data structures, it compiles what it will need later, and it checks how much memory it may use. Each step looks
harmless on its own. Together they add up to a minute of waiting, and the only sign of it is a quiet terminal.
Measuring each step, and writing the numbers down next to each other, is usually the first useful thing to do.

The garden in late summer is mostly about water. Tomatoes split if they are watered unevenly, beans stop
flowering in the heat, and the lettuce turns bitter. The gardener waters in the evening, when less of it
evaporates, and checks the soil with a finger rather than trusting the calendar.
"""

CONTINUATION_PROMPTS = (
    "Write a short note explaining why a train might arrive late.",
    "Describe how to make a cup of tea, step by step.",
    "Explain what a map legend is to a child.",
    "List three reasons people keep diaries.",
    "What should you pack for a rainy weekend trip?",
    "Why do leaves change colour in autumn?",
)


class AccuracyConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "smollm2"
    quantization: tuple[str, ...] = ("auto", "int8", "int4", "w8a8", "int2")
    group_size: int | None = None
    quantize_lm_head: bool = True
    window: int = Field(256, ge=16, le=4096, description="Tokens per evaluation window.")
    continuation_tokens: int = Field(48, ge=0, le=512)
    native: bool = Field(
        True,
        description="Also score each scheme through glowplug's native kernels (what the "
        "compiled decode step runs), where they load.",
    )
    peer: bool = Field(True, description="Also score llama.cpp (llama-cpp-python) on the same GGUF file and windows.")
    out: Path | None = None


PEER_ROW = "llama.cpp (same file)"
# The target: the default scheme's perplexity on the project's text within this much of the reference's.
AUTO_TARGET_PCT = 1.5


@dataclass
class AccuracyRow:
    """One scheme's scores against the reference. `perplexity` is over every window; `text_perplexity` over the
    project's text only, which no model under test wrote (the continuation windows are the reference's own greedy
    output, on which the reference's perplexity is low by construction: they serve the KL and top-1 columns)."""

    quantization: str
    perplexity: float
    ppl_change_pct: float
    mean_kl: float
    top1_agreement: float
    tokens: int
    text_perplexity: float = float("nan")
    text_change_pct: float = float("nan")
    text_tokens: int = 0


def text_windows(tokenizer: Any, window: int) -> list[list[int]]:
    """The project's text cut into windows of `window` tokens (a tail under 16 tokens is dropped)."""
    ids = list(tokenizer(EVAL_TEXT)["input_ids"])
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    return [w for w in windows if len(w) >= 16]


def eval_token_windows(tokenizer: Any, generate_continuations: Any, window: int, cont_tokens: int) -> list[list[int]]:
    """The project's text cut into windows (text_windows, first), plus one window per bf16 continuation (prompt +
    generated)."""
    windows = text_windows(tokenizer, window)
    if cont_tokens:
        windows += generate_continuations(list(CONTINUATION_PROMPTS), cont_tokens)
    return windows


def next_token_logprobs(model: Any, windows: list[list[int]]) -> list[Any]:
    """log-softmax of the next-token logits at every position of every window (fp32), one tensor per window."""
    import torch

    from glowplug.engine.attention import AttentionMetadata

    out = []
    with torch.inference_mode():
        for w in windows:
            ids = torch.tensor(w)
            hidden = model(ids, torch.arange(len(w)), AttentionMetadata.causal([len(w)]))
            out.append(torch.log_softmax(model.compute_logits(hidden[:-1]).float(), dim=-1))
    return out


def perplexity(test: list[Any], windows: list[list[int]]) -> tuple[float, int]:
    """(perplexity of the log-probabilities `test` on `windows`, tokens scored)."""
    import torch

    nll, n = 0.0, 0
    for t, w in zip(test, windows):
        nll -= float(t.gather(1, torch.tensor(w[1:])[:, None]).sum())
        n += len(w) - 1
    return math.exp(nll / n), n


def llama_cpp_logprobs(model: str, windows: list[list[int]]) -> list[Any] | None:
    """The windows scored by llama.cpp (llama-cpp-python, one thread per usable core) on the same
    GGUF file: the peer's own kernels and activations; None when the model is not a GGUF or llama_cpp is absent."""
    import os

    import numpy as np
    import torch

    if not model.endswith(".gguf"):
        return None
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    peer = Llama(
        model_path=model,
        n_ctx=max(len(w) for w in windows),
        n_threads=len(os.sched_getaffinity(0)),
        logits_all=True,
        verbose=False,
    )
    out = []
    for w in windows:
        peer.reset()
        peer.eval(w)
        logits = torch.from_numpy(np.array(peer.scores[: len(w) - 1], dtype=np.float32))
        out.append(torch.log_softmax(logits, dim=-1))
    peer.close()
    return out


def compare(ref: list[Any], test: list[Any], windows: list[list[int]]) -> tuple[float, float, float, int]:
    """(perplexity of `test`, mean KL(ref || test), top-1 agreement, tokens scored)."""
    import torch

    nll, kl, agree, n = 0.0, 0.0, 0.0, 0
    for r, t, w in zip(ref, test, windows):
        targets = torch.tensor(w[1:])
        nll -= float(t.gather(1, targets[:, None]).sum())
        kl += float((r.exp() * (r - t)).sum())
        agree += float((r.argmax(-1) == t.argmax(-1)).sum())
        n += len(targets)
    return math.exp(nll / n), kl / n, agree / n, n


def run_accuracy(cfg: AccuracyConfig) -> list[AccuracyRow]:
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.llm import LLM
    from glowplug.engine.sampling_params import SamplingParams

    from .timing import model_position_limit

    def build(quant: str) -> Any:
        # Eager (compile off): this measures the quantization's error, and every prompt here is a prefill; the
        # compiled decode kernels are held to the eager ones by tests/test_compile.py.
        fields: dict[str, Any] = {
            "model": cfg.model,
            "dtype": "bfloat16",
            "quantization": quant,
            "compile": "off",
            "quantize_lm_head": cfg.quantize_lm_head,
        }
        if quant != "none" and cfg.group_size is not None and quant in ("int8", "int4"):
            fields["group_size"] = cfg.group_size
        # 1024 leaves room for the chat-templated continuations; a smaller model (the tests' tiny one) gets its limit.
        length = min(max(cfg.window, 1024), model_position_limit(cfg.model))
        return LLM(config=EngineConfig.from_flat(**fields, max_model_len=length))

    ref_llm = build("none")

    def continuations(prompts: list[str], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n)
        outs = ref_llm.generate(prompts, params, chat=True)  # noqa: F821 - bound above, deleted once it is done
        return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]

    windows = eval_token_windows(ref_llm.tokenizer, continuations, cfg.window, cfg.continuation_tokens)
    n_text = len(text_windows(ref_llm.tokenizer, cfg.window))
    ref = next_token_logprobs(ref_llm.engine.model, windows)
    ref_text_ppl, _ = perplexity(ref[:n_text], windows[:n_text])

    def row(label: str, got: list[Any]) -> AccuracyRow:
        ppl, kl, top1, n = compare(ref, got, windows)
        text_ppl, text_n = perplexity(got[:n_text], windows[:n_text])
        return AccuracyRow(
            label, ppl, 100 * (ppl / ref_ppl - 1), kl, top1, n, text_ppl, 100 * (text_ppl / ref_text_ppl - 1), text_n
        )

    ref_ppl = compare(ref, ref, windows)[0]
    rows = [row("none (bf16)", ref)]
    del ref_llm
    for quant in cfg.quantization:
        llm = build(quant)
        rows.append(row(quant, next_token_logprobs(llm.engine.model, windows)))
        native = native_logprobs(llm, windows) if cfg.native else None
        if native is not None:
            label, got = native
            rows.append(row(f"{quant} ({label})", got))
        del llm
    peer = llama_cpp_logprobs(cfg.model, windows) if cfg.peer else None
    if peer is not None:
        rows.append(row(PEER_ROW, peer))
    return rows


def native_logprobs(llm: Any, windows: list[list[int]]) -> tuple[str, list[Any]] | None:
    """The windows scored with the quantized layers on glowplug's native kernels (`LLM.use_native_kernels`), and
    the row's label ("native <ISA level>"); None where the kernels do not load or no quantized layer has one. Not a
    flag on the eager row: the kernels compute differently (int4 takes the activations to int8 from the AVX2 level
    up, int8 to 16-bit fixed point), and the compiled decode step runs them."""
    from glowplug.kernels.modules import native_kernels_in_eager

    level = llm.use_native_kernels()
    if level is None:
        return None
    with native_kernels_in_eager():
        return f"native {level}", next_token_logprobs(llm.engine.model, windows)


def quality(rows: list[AccuracyRow]) -> dict[str, Any]:
    """The perplexities the speed reports read their quality flags from (see profiling/bench/quality.py)."""
    from .quality import quality_dict

    ref = rows[0].perplexity  # the bf16 reference row comes first
    return quality_dict({r.quantization: r.perplexity for r in rows[1:]}, ref)


def render_markdown(rows: list[AccuracyRow]) -> str:
    from .quality import flag_note

    flags = quality(rows)["flags"]
    lines = [
        "| quantization | perplexity, text | vs bf16, text | perplexity, all windows | vs bf16, all windows "
        "| mean KL (nats) | top-1 agreement | tokens (text / all) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = f" {flags[r.quantization]}" if r.quantization in flags else ""
        lines.append(
            f"| {r.quantization}{mark} | {r.text_perplexity:.3f} | {r.text_change_pct:+.2f}% | {r.perplexity:.3f} "
            f"| {r.ppl_change_pct:+.2f}% | {r.mean_kl:.4f} | {100 * r.top1_agreement:.1f}% "
            f"| {r.text_tokens} / {r.tokens} |"
        )
    lines += [
        "",
        "All schemes in bfloat16 activations, compile off (eager), against the bf16 model in the same "
        'dtype and compile mode. A "(native <level>)" row scores the same quantized weights through glowplug\'s '
        "native kernels at that ISA level, what the compiled decode step runs (int4 from AVX2 up: int8 "
        "activations per group; int8: 16-bit fixed-point activations).",
    ]
    lines += [
        "",
        "Perplexity, text: the project's text only, which no model under test wrote. Perplexity, all "
        "windows: with the bf16 model's own greedy continuations added, on which the bf16 model's perplexity "
        "is low by construction (they are its argmax tokens), so every other row looks worse there than it "
        "is; those windows serve the KL and top-1 columns. The target is judged on the text column, and the "
        "all-windows figure is shown beside it.",
    ]
    if flags:
        lines += ["", flag_note(flags)]
    return "\n".join(lines) + "\n"


def accuracy_verdicts(rows: list[AccuracyRow]) -> list[Any]:
    """The default scheme against the reference (AUTO_TARGET_PCT on the text column), and against llama.cpp on the
    same file where that row exists (no worse than the peer's perplexity on the text)."""
    from .verdicts import Verdict

    by = {r.quantization: r for r in rows}
    out = []
    auto = by.get("auto")
    if auto is not None:
        out.append(
            Verdict(
                f"auto's perplexity within {AUTO_TARGET_PCT}% of none's (text)",
                f"{auto.text_change_pct:+.2f}% (all windows {auto.ppl_change_pct:+.2f}%)",
                auto.text_change_pct <= AUTO_TARGET_PCT,
            )
        )
        peer = by.get(PEER_ROW)
        if peer is not None:
            out.append(
                Verdict(
                    "auto's perplexity no higher than llama.cpp's on the same file (text)",
                    f"{auto.text_perplexity:.3f} vs {peer.text_perplexity:.3f}",
                    auto.text_perplexity <= peer.text_perplexity,
                )
            )
    return out
