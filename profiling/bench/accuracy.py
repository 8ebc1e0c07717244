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
    native: bool = Field(True, description="Also score each scheme through glowplug's native kernels (what the "
                         "compiled decode step runs), where they load.")  # fmt: skip
    out: Path | None = None


@dataclass
class AccuracyRow:
    quantization: str
    perplexity: float
    ppl_change_pct: float
    mean_kl: float
    top1_agreement: float
    tokens: int


def eval_token_windows(tokenizer: Any, generate_continuations: Any, window: int, cont_tokens: int) -> list[list[int]]:
    """The project's text cut into windows, plus one window per bf16 continuation (prompt + generated)."""
    ids = list(tokenizer(EVAL_TEXT)["input_ids"])
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    windows = [w for w in windows if len(w) >= 16]
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
        fields: dict[str, Any] = {"model": cfg.model, "dtype": "bfloat16", "quantization": quant, "compile": "off",
                                  "quantize_lm_head": cfg.quantize_lm_head}  # fmt: skip
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
    ref = next_token_logprobs(ref_llm.engine.model, windows)
    ref_ppl, _, _, n = compare(ref, ref, windows)
    rows = [AccuracyRow("none (bf16)", ref_ppl, 0.0, 0.0, 1.0, n)]
    del ref_llm
    for quant in cfg.quantization:
        llm = build(quant)
        got = next_token_logprobs(llm.engine.model, windows)
        ppl, kl, top1, n = compare(ref, got, windows)
        rows.append(AccuracyRow(quant, ppl, 100 * (ppl / ref_ppl - 1), kl, top1, n))
        native = native_logprobs(llm, windows) if cfg.native else None
        if native is not None:
            label, got = native
            ppl, kl, top1, n = compare(ref, got, windows)
            rows.append(AccuracyRow(f"{quant} ({label})", ppl, 100 * (ppl / ref_ppl - 1), kl, top1, n))
        del llm
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
        "| quantization | perplexity | vs bf16 | mean KL (nats) | top-1 agreement | tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = f" {flags[r.quantization]}" if r.quantization in flags else ""
        lines.append(
            f"| {r.quantization}{mark} | {r.perplexity:.3f} | {r.ppl_change_pct:+.2f}% | {r.mean_kl:.4f} "
            f"| {100 * r.top1_agreement:.1f}% | {r.tokens} |"
        )
    lines += ["", "All schemes in bfloat16 activations, compile off (eager), against the bf16 model in the same "
              "dtype and compile mode. A \"(native <level>)\" row scores the same quantized weights through glowplug's "
              "native kernels at that ISA level, what the compiled decode step runs (int4 from AVX2 up: int8 "
              "activations per group; int8: 16-bit fixed-point activations)."]  # fmt: skip
    if flags:
        lines += ["", flag_note(flags)]
    return "\n".join(lines) + "\n"
