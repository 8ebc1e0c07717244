"""Structured outputs and tool calls against a real server: their cost in the batch, and whether what they produce
is valid.

Cost, on the benchmark's model (a server started with the engine flags, as every mode here):
- TPOT of a batch of 16 concurrent streams with 8 constrained (`response_format` json_schema) against the same 16
  unconstrained, interleaved pairs (the order inside a pair alternates, so a drifting machine favours neither
  side); every stream is cut by max_tokens (EOS ignored; the constrained schema cannot end sooner), so both
  batches hold 16 rows for every step. Target: constrained / unconstrained <= 1.05 on the worst pair.
- The first constrained request's extra TTFT for a new schema (never seen by the server: a property named by a
  counter makes its grammar new) and for the same schema repeated, each against an unconstrained request of the
  same prompt made just before (the prompt's prefix is cached for all three). Targets on the worst pair: <= 50 ms
  and <= 5 ms.
- llguidance's own costs, in this process, for the model's tokenizer: its tokenizer view, each schema's matcher
  (parse and compile), and the mask of each token while a matcher walks a generated object.
Correctness, through the openai client: --structured-objects objects over the data file's 20 schemas (nesting,
enums, arrays, `required`, `additionalProperties: false`) must all parse and validate (`jsonschema`), on the
benchmark's model and on --real-model; on --real-model, `tool_choice: "auto"` over the 30 tool prompts (every
emitted call names an offered tool with arguments that validate; how many prompts produced a call is reported),
then `"required"` and the prompt's tool by name over --structured-forced-prompts of them (100%).

The schemas, prompts and tools are data (profiling/bench/serve/data/structured.json), not code.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import ServeBenchConfig
from .load import run_closed
from .server import StartedServer, served_model

DATA = Path(__file__).parent / "data" / "structured.json"
TPOT_TARGET = 1.05  # constrained batch TPOT / unconstrained, worst pair
TTFT_NEW_TARGET_MS = 50.0
TTFT_REPEAT_TARGET_MS = 5.0
BATCH = 16
CONSTRAINED_ROWS = 8
CHAT = "/v1/chat/completions"
Say = Callable[[str], None]


def load_data(path: Path = DATA) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _chat_body(
    model: str,
    system: str,
    prompt: str,
    max_tokens: int,
    schema: dict[str, Any] | None,
    name: str = "answer",
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt}],
        **extra,
    }
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
    return body


# ------------------------------------------------------------------------------------------------ cost: TPOT
@dataclass
class BatchRun:
    constrained: bool
    tpot_ms: float  # mean over the batch's streams
    stream_tpot_ms: list[float]
    output_tokens: list[int]
    failed: int


def _batch(base_url: str, bodies: list[dict[str, Any]], constrained: bool, timeout: float) -> BatchRun:
    results = run_closed(base_url, CHAT, bodies, len(bodies), max_duration=timeout, timeout=timeout)
    tpots = [r.tpot_s * 1e3 for r in results if r.ok and r.tpot_s is not None]
    return BatchRun(
        constrained,
        statistics.fmean(tpots) if tpots else float("nan"),
        tpots,
        [r.output_tokens or 0 for r in results],
        sum(1 for r in results if not r.ok),
    )


def run_tpot_pairs(
    cfg: ServeBenchConfig, base_url: str, model: str, data: dict[str, Any], say: Say
) -> list[tuple[BatchRun, BatchRun]]:
    """Pairs of (unconstrained batch, constrained batch): 16 streams each, 8 of the second constrained."""
    spec, system, tokens = data["tpot"], data["system"], cfg.structured_tpot_tokens
    extra = {"ignore_eos": True}
    plain = [
        _chat_body(model, system, f"{spec['prompt']} (batch row {i})", tokens, None, **extra) for i in range(BATCH)
    ]
    mixed = [
        _chat_body(
            model, system, f"{spec['prompt']} (batch row {i})", tokens, spec["schema"] if i % 2 == 0 else None, **extra
        )
        for i in range(BATCH)
    ]
    _batch(base_url, mixed, True, cfg.request_timeout)  # warm-up: the schema parsed, both batch shapes run
    _batch(base_url, plain, False, cfg.request_timeout)
    pairs = []
    for i in range(cfg.runs):
        order = [(plain, False), (mixed, True)] if i % 2 == 0 else [(mixed, True), (plain, False)]
        runs = {c: _batch(base_url, b, c, cfg.request_timeout) for b, c in order}
        pairs.append((runs[False], runs[True]))
        say(
            f"structured: TPOT pair {i + 1}/{cfg.runs}: unconstrained {runs[False].tpot_ms:.1f} ms, "
            f"8 of 16 constrained {runs[True].tpot_ms:.1f} ms"
        )
    return pairs


# ------------------------------------------------------------------------------------------------ cost: TTFT
@dataclass
class TTFTTrial:
    plain_ms: float
    new_ms: float
    repeat_ms: float

    @property
    def extra_new_ms(self) -> float:
        return self.new_ms - self.plain_ms

    @property
    def extra_repeat_ms(self) -> float:
        return self.repeat_ms - self.plain_ms


def _ttft_ms(base_url: str, body: dict[str, Any], timeout: float) -> float:
    (r,) = run_closed(base_url, CHAT, [body], 1, max_duration=timeout, timeout=timeout)
    if not r.ok or r.ttft_s is None:
        raise RuntimeError(f"a TTFT request failed: {r.error} {r.detail}")
    return r.ttft_s * 1e3


def run_ttft_trials(
    cfg: ServeBenchConfig, base_url: str, model: str, data: dict[str, Any], say: Say
) -> list[TTFTTrial]:
    """Per trial: the prompt unconstrained, then with a schema the server has never seen, then that schema again
    (one token each: the first token is what TTFT times)."""
    spec, system = data["ttft"], data["system"]
    stamp = int(time.time())

    def fresh(i: int) -> dict[str, Any]:
        schema = json.loads(json.dumps(spec["schema"]))
        schema["properties"][f"note_{stamp}_{i}"] = {"type": "string", "maxLength": 8}
        return schema

    for warm in (None, fresh(-1)):  # a warm-up request of each kind
        _ttft_ms(base_url, _chat_body(model, system, spec["prompt"], 1, warm), cfg.request_timeout)
    trials = []
    for i in range(max(cfg.runs, cfg.structured_ttft_trials)):
        schema = fresh(i)
        plain = _ttft_ms(base_url, _chat_body(model, system, spec["prompt"], 1, None), cfg.request_timeout)
        new = _ttft_ms(base_url, _chat_body(model, system, spec["prompt"], 1, schema), cfg.request_timeout)
        repeat = _ttft_ms(base_url, _chat_body(model, system, spec["prompt"], 1, schema), cfg.request_timeout)
        trials.append(TTFTTrial(plain, new, repeat))
    say(
        "structured: TTFT extra, new schema (ms): "
        + ", ".join(f"{t.extra_new_ms:.1f}" for t in trials)
        + "; repeated: "
        + ", ".join(f"{t.extra_repeat_ms:.1f}" for t in trials)
    )
    return trials


# ------------------------------------------------------------------------------------------------ correctness
@dataclass
class ObjectResults:
    model: str
    requested: int
    valid: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    texts: list[tuple[str, str]] = field(default_factory=list)  # (schema name, text) of the valid ones

    @property
    def passed(self) -> bool:
        return self.requested > 0 and self.valid == self.requested


def _openai(base_url: str, timeout: float) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=timeout, max_retries=0)


def _parallel(jobs: list[Callable[[], Any]], width: int) -> list[Any]:
    with ThreadPoolExecutor(max_workers=width) as pool:
        return list(pool.map(lambda job: job(), jobs))


def run_objects(
    base_url: str, model: str, data: dict[str, Any], count: int, max_tokens: int, timeout: float, say: Say
) -> ObjectResults:
    """`count` objects spread over the schemas (seeded sampling at temperature 0.7, so the repeats differ), each
    parsed and validated against its schema."""
    import jsonschema

    client = _openai(base_url, timeout)
    schemas = data["schemas"]

    def one(i: int) -> tuple[str, bool, str, str]:
        spec = schemas[i % len(schemas)]
        reply = client.chat.completions.create(
            model=model,
            max_tokens=max_tokens,
            temperature=0.7,
            seed=i,
            messages=[{"role": "system", "content": data["system"]}, {"role": "user", "content": spec["prompt"]}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": spec["name"], "schema": spec["schema"], "strict": True},
            },
        )
        text = reply.choices[0].message.content or ""
        try:
            jsonschema.validate(json.loads(text), spec["schema"])
        except (ValueError, jsonschema.ValidationError) as exc:
            return spec["name"], False, text, f"{reply.choices[0].finish_reason}: {type(exc).__name__}: {exc}"[:300]
        return spec["name"], True, text, ""

    t0 = time.perf_counter()
    rows = _parallel([lambda i=i: one(i) for i in range(count)], BATCH)
    out = ObjectResults(model, count, sum(1 for r in rows if r[1]), wall_s=time.perf_counter() - t0)
    out.failures = [{"schema": n, "text": t[:300], "why": w} for n, ok, t, w in rows if not ok]
    out.texts = [(n, t) for n, ok, t, _w in rows if ok]
    say(f"structured: {out.valid}/{count} objects valid on {model} ({out.wall_s:.0f} s)")
    return out


@dataclass
class ToolResults:
    choice: str
    prompts: int
    with_call: int
    valid_calls: int
    invalid: list[dict[str, Any]] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return self.valid_calls + len(self.invalid)

    @property
    def passed(self) -> bool:
        """auto: every emitted call valid; required and named: every prompt produced a valid call."""
        if self.choice == "auto":
            return self.calls > 0 and not self.invalid
        return self.with_call == self.prompts and not self.invalid


def run_tools(
    base_url: str,
    model: str,
    data: dict[str, Any],
    choice: str,
    prompts: list[dict[str, Any]],
    max_tokens: int,
    timeout: float,
    say: Say,
) -> ToolResults:
    import jsonschema

    client = _openai(base_url, timeout)
    tools = data["tools"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def one(p: dict[str, Any]) -> list[tuple[bool, dict[str, Any]]]:
        tool_choice: Any = choice if choice != "named" else {"type": "function", "function": {"name": p["tool"]}}
        reply = client.chat.completions.create(
            model=model,
            max_tokens=max_tokens,
            temperature=0.0,
            tools=tools,
            tool_choice=tool_choice,
            messages=[{"role": "user", "content": p["prompt"]}],
        )
        calls = reply.choices[0].message.tool_calls or []
        checked = []
        for call in calls:
            name, raw = call.function.name, call.function.arguments
            info = {"prompt": p["prompt"], "name": name, "arguments": raw[:200]}
            try:
                if name not in params or (choice == "named" and name != p["tool"]):
                    raise ValueError(f"names {name!r}")
                jsonschema.validate(json.loads(raw), params[name])
            except (ValueError, jsonschema.ValidationError) as exc:
                checked.append((False, {**info, "why": f"{type(exc).__name__}: {exc}"[:200]}))
                continue
            checked.append((True, info))
        return checked

    per_prompt = _parallel([lambda p=p: one(p) for p in prompts], BATCH)
    out = ToolResults(
        choice,
        len(prompts),
        sum(1 for c in per_prompt if c and all(ok for ok, _ in c)),
        sum(ok for c in per_prompt for ok, _ in c),
    )
    out.invalid = [info for c in per_prompt for ok, info in c if not ok]
    say(
        f"structured: tool_choice {choice}: {out.with_call}/{out.prompts} prompts with a valid call, "
        f"{len(out.invalid)} invalid calls"
    )
    return out


# ------------------------------------------------------------------------------------------------ llguidance's own
def library_costs(
    tokenizer: Any, vocab_size: int, data: dict[str, Any], walks: list[tuple[str, str]]
) -> dict[str, Any]:
    """llguidance's own times in this process for `tokenizer`: the tokenizer view, each schema's matcher (its
    grammar as the server builds it: engine/structured.json_schema_grammar), and the mask of every token while a
    matcher walks the generated objects `walks` ((schema name, text))."""
    import llguidance
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask

    from glowplug.engine.structured import json_schema_grammar, tokenizer_json

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer_json(tokenizer)(), n_vocab=vocab_size)
    view_s = time.perf_counter() - t0
    grammars = {s["name"]: json_schema_grammar(s["schema"]) for s in data["schemas"]}
    compile_ms = []
    for grammar in grammars.values():
        t0 = time.perf_counter()
        llguidance.LLMatcher(lltok, grammar)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    mask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    mask_ms: list[float] = []
    for name, text in walks:
        matcher = llguidance.LLMatcher(lltok, grammars[name])
        for token in lltok.tokenize_str(text):
            t0 = time.perf_counter()
            fill_next_token_bitmask(matcher, mask, 0)
            mask_ms.append((time.perf_counter() - t0) * 1e3)
            if not matcher.consume_token(token):
                break
    mask_ms.sort()
    return {
        "tokenizer_view_s": view_s,
        "matcher_ms": {"median": statistics.median(compile_ms), "max": max(compile_ms), "n": len(compile_ms)},
        "mask_ms": {
            "p50": mask_ms[len(mask_ms) // 2],
            "mean": statistics.fmean(mask_ms),
            "p99": mask_ms[int(len(mask_ms) * 0.99)],
            "max": mask_ms[-1],
            "n": len(mask_ms),
        }
        if mask_ms
        else {},
    }


# ------------------------------------------------------------------------------------------------ the mode
@contextmanager
def _server(cfg: ServeBenchConfig, server_for: Any, model: Path | None) -> Iterator[tuple[str, str]]:
    """(base URL, served model name): the benchmark's server, or one of --real-model (its GGUF run as stored)."""
    if model is None:
        with server_for(cfg) as (base_url, _pid):
            yield base_url, cfg.served_model_name or served_model(base_url)
        return
    # A 1.5B model's queue of 16 tool requests waits longer than the default admission allows (429): let it wait.
    real = cfg.model_copy(
        update={
            "model": str(model),
            "quantization": "auto",
            "max_queue_wait": max(cfg.max_queue_wait or 0.0, cfg.request_timeout),
        }
    )
    with StartedServer(real) as srv:
        yield srv.base_url, served_model(srv.base_url)


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def _spread(values: list[float], digits: int = 3) -> str:
    from glowplug.profiling.bench.tables import fmt_spread

    return fmt_spread(values, digits)


def structured_mode(
    cfg: ServeBenchConfig, tokenizer: Any, argv: list[str] | None, say: Say, server_for: Any
) -> tuple[bool, list[Path]]:
    from glowplug.profiling.bench.cli_support import prepare_out_dir

    data = load_data(cfg.structured_data or DATA)
    out = prepare_out_dir(cfg.out_dir)
    load_start = _load()
    say(f"structured: load average at start {load_start}")
    if cfg.structured_real_only:
        return _real_only(cfg, argv, data, out, load_start, say, server_for)
    with _server(cfg, server_for, None) as (base_url, model):
        # The TPOT pairs first: by their end the work a server starts at READY (committing its KV pool, building
        # the tokenizer's grammar view) is over, and would otherwise land on the first trials' TTFT.
        pairs = run_tpot_pairs(cfg, base_url, model, data, say)
        ttft = run_ttft_trials(cfg, base_url, model, data, say)
        objects = run_objects(
            base_url, model, data, cfg.structured_objects, cfg.structured_max_tokens, cfg.request_timeout, say
        )
    vocab = _vocab_size(cfg.model)
    lib = library_costs(tokenizer, vocab, data, objects.texts)
    cost = (ttft, pairs, objects, lib, vocab, load_start)
    md = out / "structured.md"
    passed = _write(cfg, argv, data, out, cost, {}, say)  # the default model's part stays if the real one fails
    if cfg.real_model is None:
        return passed, [md, out / "structured.json"]
    real = _run_real(cfg, data, say, server_for)
    return _write(cfg, argv, data, out, cost, real, say), [md, out / "structured.json"]


def _write(
    cfg: ServeBenchConfig,
    argv: list[str] | None,
    data: dict[str, Any],
    out: Path,
    cost: tuple[Any, ...],
    real: dict[str, Any],
    say: Say,
) -> bool:
    """Write structured.{md,json} and the verdicts; True when every target passed."""
    from glowplug.profiling.bench.machine import report_header
    from glowplug.profiling.bench.tables import markdown_table
    from glowplug.profiling.bench.verdicts import Verdict, verdicts_markdown

    ttft, pairs, objects, lib, vocab, load_start = cost
    load_end = _load()

    ratios = [c.tpot_ms / u.tpot_ms for u, c in pairs]
    failed_streams = sum(u.failed + c.failed for u, c in pairs)
    new = [t.extra_new_ms for t in ttft]
    rep = [t.extra_repeat_ms for t in ttft]
    verdicts = [
        Verdict(
            f"TPOT, 8 of 16 constrained / 16 unconstrained <= {TPOT_TARGET} (worst of {len(pairs)} pairs)",
            f"worst {max(ratios):.3f}, median {statistics.median(ratios):.3f}",
            max(ratios) <= TPOT_TARGET and failed_streams == 0,
        ),
        Verdict(
            f"extra TTFT, new schema <= {TTFT_NEW_TARGET_MS:g} ms (worst of {len(new)} trials)",
            f"worst {max(new):.1f} ms, median {statistics.median(new):.1f} ms",
            max(new) <= TTFT_NEW_TARGET_MS,
        ),
        Verdict(
            f"extra TTFT, repeated schema <= {TTFT_REPEAT_TARGET_MS:g} ms (worst of {len(rep)} trials)",
            f"worst {max(rep):.1f} ms, median {statistics.median(rep):.1f} ms",
            max(rep) <= TTFT_REPEAT_TARGET_MS,
        ),
        Verdict(
            f"{objects.requested} objects over {len(data['schemas'])} schemas parse and validate ({objects.model})",
            f"{objects.valid}/{objects.requested}",
            objects.passed,
        ),
    ]
    if real:
        verdicts += _real_verdicts(data, real)
    passed = all(v.passed for v in verdicts)

    pair_rows = [
        [
            str(i + 1),
            f"{u.tpot_ms:.1f}",
            f"{c.tpot_ms:.1f}",
            f"{r:.3f}",
            f"{statistics.fmean(c.stream_tpot_ms[::2]) if c.stream_tpot_ms else float('nan'):.1f}",
        ]
        for i, ((u, c), r) in enumerate(zip(pairs, ratios))
    ]
    ttft_rows = [
        [
            str(i + 1),
            f"{t.plain_ms:.1f}",
            f"{t.new_ms:.1f}",
            f"{t.repeat_ms:.1f}",
            f"{t.extra_new_ms:.1f}",
            f"{t.extra_repeat_ms:.1f}",
        ]
        for i, t in enumerate(ttft)
    ]
    mask = lib["mask_ms"]
    lines = [
        report_header("Structured outputs and tool calls: cost in the batch, validity", argv),
        f"- load average (1 / 5 / 15 min) at start: {load_start}; at end: {load_end} (the machine is shared; "
        f"{os.cpu_count()} cores; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        "inherited by the servers)",
        f"- model: {objects.model} (server flags as `bench serve`: --quantization {cfg.quantization}, "
        f"--max-num-seqs {cfg.max_num_seqs})"
        + (f"; real model: {cfg.real_model.name} (--quantization auto)" if cfg.real_model else ""),
        "",
        "## Verdicts",
        "",
        verdicts_markdown(verdicts),
        "",
        f"## TPOT: a batch of {BATCH} streams, {CONSTRAINED_ROWS} constrained, against the same {BATCH} unconstrained",
        "",
        f"{cfg.structured_tpot_tokens} tokens per stream (EOS ignored; the constrained rows' schema, an array of 40 "
        "objects with an integer, an enum and a boolean, cannot end sooner), greedy, chat; TPOT = the mean over the "
        "batch's streams of (last token - first token) / (tokens - 1). Pairs interleaved, the order alternating.",
        "",
        markdown_table(
            ["pair", "unconstrained TPOT (ms)", "8 constrained TPOT (ms)", "ratio", "constrained rows' own TPOT (ms)"],
            pair_rows,
        ),
        "",
        f"Ratio: median {statistics.median(ratios):.3f}, spread {min(ratios):.3f}–{max(ratios):.3f}, worst pair "
        f"{max(ratios):.3f}.",
        "",
        "## First-token cost of a grammar",
        "",
        "Per trial, one prompt three times, one token each: unconstrained, then with a json_schema the server has not "
        "seen (a property named by the trial makes it new), then the same schema again. Extra = constrained TTFT - "
        "the unconstrained TTFT of the same trial. The trials run after the TPOT pairs, once the work the server "
        "starts at READY (its KV pool's commit, the tokenizer's grammar view) is over, after one warm-up request of "
        "each kind, so no request here pays them.",
        "",
        markdown_table(
            [
                "trial",
                "unconstrained (ms)",
                "new schema (ms)",
                "repeated (ms)",
                "extra, new (ms)",
                "extra, repeated (ms)",
            ],
            ttft_rows,
        ),
        "",
        f"Extra TTFT (ms), new schema: {_spread(new, 1)}, worst {max(new):.1f}; repeated: {_spread(rep, 1)}, worst "
        f"{max(rep):.1f} (median (min–max)).",
        "",
        "## llguidance's own costs (this process, the model's tokenizer)",
        "",
        f"- tokenizer view ({vocab:,} tokens): {lib['tokenizer_view_s']:.2f} s",
        f"- a schema's matcher (parse + compile), over the {lib['matcher_ms']['n']} schemas: median "
        f"{lib['matcher_ms']['median']:.2f} ms, max {lib['matcher_ms']['max']:.2f} ms",
        (
            f"- mask per token, walking the {len(objects.texts)} valid generated objects ({mask['n']} masks): p50 "
            f"{mask['p50']:.3f} ms, mean {mask['mean']:.3f} ms, p99 {mask['p99']:.3f} ms, max {mask['max']:.2f} ms"
            if mask
            else "- mask per token: no valid object to walk"
        ),
        "",
        "## Validity",
        "",
        _objects_md(objects),
    ]
    if real:
        lines += _tools_md(cfg, data, real)
    else:
        lines.append(
            "The real model's part (objects and tool calls) is not in this report: "
            + (
                f"{cfg.real_model.name} was still running when it was written."
                if cfg.real_model
                else "give --real-model PATH."
            )
        )
    lines.append("")
    text = "\n".join(lines)
    md = _write_report(
        out / "structured.md",
        text,
        verdicts,
        {
            **_run_json(argv, cfg, load_start, load_end),
            "tpot_pairs": [
                {"unconstrained": asdict(u), "constrained": asdict(c), "ratio": r} for (u, c), r in zip(pairs, ratios)
            ],
            "ttft_trials": [
                {**asdict(t), "extra_new_ms": t.extra_new_ms, "extra_repeat_ms": t.extra_repeat_ms} for t in ttft
            ],
            "library": lib,
            "objects": _objects_json(objects),
            "real": _real_json(real),
            "verdicts": [asdict(v) for v in verdicts],
            "passed": passed,
        },
    )
    say(f"structured: wrote {md}")
    return passed


def _run_real(cfg: ServeBenchConfig, data: dict[str, Any], say: Say, server_for: Any) -> dict[str, Any]:
    assert cfg.real_model is not None
    say(f"structured: {cfg.real_model.name}: objects, then tool calls (auto, required, named)")
    prompts = data["tool_prompts"]
    forced = prompts[:: max(1, len(prompts) // cfg.structured_forced_prompts)][: cfg.structured_forced_prompts]
    real: dict[str, Any] = {}
    with _server(cfg, server_for, cfg.real_model) as (base_url, rmodel):
        real["objects"] = run_objects(
            base_url, rmodel, data, cfg.structured_objects, cfg.structured_max_tokens, cfg.request_timeout, say
        )
        for choice, chosen in (("auto", prompts), ("required", forced), ("named", forced)):
            real[choice] = run_tools(
                base_url, rmodel, data, choice, chosen, cfg.structured_tool_tokens, cfg.request_timeout, say
            )
    return real


def _real_verdicts(data: dict[str, Any], real: dict[str, Any]) -> list[Any]:
    from glowplug.profiling.bench.verdicts import Verdict

    ro: ObjectResults = real["objects"]
    out = [
        Verdict(
            f"{ro.requested} objects over {len(data['schemas'])} schemas parse and validate ({ro.model})",
            f"{ro.valid}/{ro.requested}",
            ro.passed,
        )
    ]
    auto: ToolResults = real["auto"]
    out.append(
        Verdict(
            f"tool_choice auto, {auto.prompts} prompts: every emitted call names an offered tool with "
            "validating arguments",
            f"{auto.valid_calls}/{auto.calls} calls valid; {auto.with_call}/{auto.prompts} prompts produced a call",
            auto.passed,
        )
    )
    for key in ("required", "named"):
        t: ToolResults = real[key]
        out.append(
            Verdict(f"tool_choice {key}: a valid call for every prompt (100%)", f"{t.with_call}/{t.prompts}", t.passed)
        )
    return out


def _tools_md(cfg: ServeBenchConfig, data: dict[str, Any], real: dict[str, Any]) -> list[str]:
    lines = [
        _objects_md(real["objects"]),
        "",
        "Tool calls (" + real["objects"].model + "): "
        f"{len(data['tools'])} tools; auto over all {real['auto'].prompts} prompts, required and named over "
        f"{real['required'].prompts} of them; max_tokens {cfg.structured_tool_tokens}, greedy.",
        "",
    ]
    for key in ("auto", "required", "named"):
        t = real[key]
        lines.append(
            f"- {key}: {t.with_call}/{t.prompts} prompts produced a valid call; {t.valid_calls} valid "
            f"calls, {len(t.invalid)} invalid"
            + (
                ": " + "; ".join(f"{i['name']}({i['arguments']}): {i.get('why', '')}" for i in t.invalid[:5])
                if t.invalid
                else ""
            )
        )
    return lines


def _real_only(
    cfg: ServeBenchConfig,
    argv: list[str] | None,
    data: dict[str, Any],
    out: Path,
    load_start: str,
    say: Say,
    server_for: Any,
) -> tuple[bool, list[Path]]:
    """--structured-real-only: the real model's objects and tool calls alone -> structured_real.{md,json}."""
    from glowplug.profiling.bench.machine import report_header
    from glowplug.profiling.bench.verdicts import verdicts_markdown

    if cfg.real_model is None:
        raise ValueError("--structured-real-only needs --real-model PATH")
    real = _run_real(cfg, data, say, server_for)
    verdicts = _real_verdicts(data, real)
    load_end = _load()
    text = "\n".join(
        [
            report_header("Structured outputs and tool calls on a real model: validity", argv),
            f"- load average (1 / 5 / 15 min) at start: {load_start}; at end: {load_end} (the machine is shared; "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, inherited by the server)",
            "",
            "## Verdicts",
            "",
            verdicts_markdown(verdicts),
            "",
            "## Validity",
            "",
            *_tools_md(cfg, data, real),
            "",
        ]
    )
    md = _write_report(
        out / "structured_real.md",
        text,
        verdicts,
        {
            **_run_json(argv, cfg, load_start, load_end),
            "real": _real_json(real),
            "verdicts": [asdict(v) for v in verdicts],
            "passed": all(v.passed for v in verdicts),
        },
    )
    return all(v.passed for v in verdicts), [md, md.with_suffix(".json")]


def _run_json(argv: list[str] | None, cfg: ServeBenchConfig, load_start: str, load_end: str) -> dict[str, Any]:
    """What a structured report's JSON opens with: the command, commit, config and the load around the run."""
    from glowplug.profiling.bench.machine import report_git_state

    return {
        "command": argv,
        "commit": report_git_state().describe(),
        "config": cfg.model_dump(mode="json"),
        "load_average": {"start": load_start, "end": load_end},
    }


def _real_json(real: dict[str, Any]) -> dict[str, Any]:
    """The real model's results: its objects, and each tool-call check with its verdict."""
    return {
        k: (_objects_json(v) if isinstance(v, ObjectResults) else {**asdict(v), "passed": v.passed})
        for k, v in real.items()
    }


def _write_report(md: Path, text: str, verdicts: list[Any], data: dict[str, Any]) -> Path:
    """The report `md` (the text, also printed), its verdicts sidecar and its JSON beside it (`data`)."""
    from glowplug.profiling.bench.cli_support import write_json
    from glowplug.profiling.bench.verdicts import write_verdicts

    md.write_text(text)
    write_verdicts(md, verdicts)
    write_json(md.with_suffix(".json"), data)
    print(text)
    return md


def _objects_md(r: ObjectResults) -> str:
    head = f"- {r.model}: {r.valid}/{r.requested} objects parse and validate ({r.wall_s:.0f} s, 16 in flight)"
    return head + "".join(f"\n  - {f['schema']}: {f['why']} — `{f['text'][:120]}`" for f in r.failures[:10])


def _objects_json(r: ObjectResults) -> dict[str, Any]:
    return {
        "model": r.model,
        "requested": r.requested,
        "valid": r.valid,
        "failures": r.failures,
        "wall_s": r.wall_s,
        "passed": r.passed,
    }


def _vocab_size(model: str) -> int:
    """The model's logits width (a mask row covers it), from its prepared folder's config."""
    from glowplug.engine.models.store import resolve_model

    config = json.loads((resolve_model(model, quiet=True) / "config.json").read_text())
    return int(config["vocab_size"])
