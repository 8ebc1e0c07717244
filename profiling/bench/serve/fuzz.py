"""Fuzzing the HTTP API with schemathesis against the server's own OpenAPI document (`GET /openapi.json`).

For each operation, hypothesis generates up to N request bodies from the document (lifecycle/openapi.py makes it
precise: SamplingParams' ranges, the served model, the limits the server enforces), each is sent to the server and
its response checked by schemathesis: not a 5xx, a documented status, a documented content type, documented
headers, a body that matches the documented schema. Every case is run to the end (a failure is recorded and
counted, not raised), so the result is a count per check over all cases, not the first failure only.

What each case may cost is bounded in the generated case, not in the server (which runs with its own limits, the
default max-model-len included): max_tokens and max_completion_tokens above --fuzz-max-tokens, or absent (the server
would then generate up to max-model-len), are set to it, and n and best_of above --fuzz-max-n to it; under `prompt`
and `messages`, every string is cut to --fuzz-max-prompt-chars characters and every list to --fuzz-max-prompt-items
items (a drawn chat of kilobytes of odd Unicode is thousands of prompt tokens: tens of seconds of prefill on a small
CPU). Every other field is left as hypothesis drew it; the bounds keep the documented ranges (a list only gets
shorter, down to no fewer than one item), so a bounded case is as valid (or as invalid) as the one drawn, and the
report states the bounds.

Not checked: positive_data_acceptance. What a JSON schema cannot say (prompt + max_tokens within max-model-len,
stream_options only with stream, top_logprobs only with logprobs, best_of == n, token ids within the vocabulary)
is a documented 400, which schemathesis would call a rejected valid request.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The generation endpoints get N cases each; the probes and listings have (almost) no input, a few cases suffice.
GENERATION_OPERATIONS = (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"))
OTHER_OPERATIONS = (("/v1/models", "GET"), ("/health/live", "GET"), ("/health/ready", "GET"), ("/metrics", "GET"))
_OTHER_CASES = 5


@dataclass(frozen=True)
class FuzzBound:
    """The most work one generated case may ask for: output tokens per sequence, and sequences (n, best_of)."""

    max_tokens: int
    max_n: int
    max_prompt_chars: int = 64
    max_prompt_items: int = 4

    def _cut(self, value: Any) -> Any:
        if isinstance(value, str):
            return value[: self.max_prompt_chars]
        if isinstance(value, list):
            return [self._cut(v) for v in value[: max(1, self.max_prompt_items)]]
        if isinstance(value, dict):
            return {k: self._cut(v) for k, v in value.items()}
        return value

    def apply(self, body: Any) -> Any:
        """A copy of the body with the work-multiplying fields clamped; anything not a JSON object passes as is."""
        if not isinstance(body, dict):
            return body
        out = dict(body)
        given = False
        for key in ("max_tokens", "max_completion_tokens"):
            value = out.get(key)
            # A JSON integer may come as 1e8 (hypothesis draws integral floats too): any number counts.
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                given = True
                out[key] = min(value, self.max_tokens)
        if not given:  # absent or null: the server would generate up to max-model-len
            out["max_tokens"] = self.max_tokens
        for key in ("n", "best_of"):
            value = out.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = min(value, self.max_n)
        for key in ("prompt", "messages"):
            if key in out:
                out[key] = self._cut(out[key])
        return out

    def describe(self) -> str:
        return (
            f"max_tokens and max_completion_tokens capped at {self.max_tokens} (set to it when absent or null), "
            f"n and best_of capped at {self.max_n}; under prompt and messages, strings cut to "
            f"{self.max_prompt_chars} characters and lists to {self.max_prompt_items} items"
        )


def bounded_strategy(operation: Any, bound: FuzzBound | None) -> Any:
    """schemathesis's strategy for the operation, each generated case's JSON body passed through the bound."""
    strategy = operation.as_strategy()
    if bound is None:
        return strategy

    def clamp(case: Any) -> Any:
        case.body = bound.apply(case.body)
        return case

    return strategy.map(clamp)


@dataclass
class OperationResult:
    path: str
    method: str
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # check name -> failing cases
    examples: list[str] = field(default_factory=list)  # the first few failures, with a curl to reproduce

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    @property
    def violations(self) -> int:
        return sum(self.failures.values())


@dataclass
class FuzzResult:
    cases_per_endpoint: int
    operations: list[OperationResult]
    bound: FuzzBound | None = None
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(op.server_errors == 0 and op.violations == 0 for op in self.operations) and all(
            op.cases >= self.cases_per_endpoint
            for op in self.operations
            if (op.path, op.method) in GENERATION_OPERATIONS
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "cases_per_endpoint": self.cases_per_endpoint,
            "bound": None if self.bound is None else self.bound.__dict__,
            "wall_s": self.wall_s,
            "passed": self.passed,
            "operations": [
                {**op.__dict__, "server_errors": op.server_errors, "violations": op.violations}
                for op in self.operations
            ],
        }


def _checks() -> list[Any]:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]


def fuzz_operation(
    schema: Any, base_url: str, path: str, method: str, cases: int, timeout: float, bound: FuzzBound | None = None
) -> OperationResult:
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.core.failures import FailureGroup

    result = OperationResult(path, method)
    operation = schema[path][method]
    statuses: Counter[int] = Counter()
    failures: Counter[str] = Counter()
    checks = _checks()

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=bounded_strategy(operation, bound))
    def one(case: Any) -> None:
        response = case.call(base_url=base_url, timeout=timeout)
        result.cases += 1
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=checks)
        except FailureGroup as group:
            for failure in group.exceptions:
                name = getattr(failure, "title", type(failure).__name__)
                failures[str(name)] += 1
            if len(result.examples) < 5:
                result.examples.append(f"{response.status_code}: {str(group)[:1500]}")

    one()
    result.statuses = dict(sorted(statuses.items()))
    result.failures = dict(failures)
    return result


def run_fuzz(
    base_url: str,
    cases: int,
    *,
    timeout: float = 120.0,
    progress: Callable[[str], None] | None = None,
    bound: FuzzBound | None = None,
) -> FuzzResult:
    try:
        import schemathesis
    except ImportError as exc:
        raise RuntimeError("--fuzz needs schemathesis: pip install 'glowplug[test]'") from exc
    say = progress or (lambda _m: None)
    schema = schemathesis.openapi.from_url(base_url.rstrip("/") + "/openapi.json")
    out = []
    t0 = time.perf_counter()
    for path, method in GENERATION_OPERATIONS + OTHER_OPERATIONS:
        n = cases if (path, method) in GENERATION_OPERATIONS else _OTHER_CASES
        say(f"fuzz: {method} {path}, up to {n} cases")
        out.append(fuzz_operation(schema, base_url, path, method, n, timeout, bound))
    return FuzzResult(cases, out, bound, time.perf_counter() - t0)


def render_fuzz(r: FuzzResult, head: str) -> str:
    from glowplug.profiling.bench.tables import markdown_table

    rows = [
        [
            f"`{op.method} {op.path}`",
            op.cases,
            ", ".join(f"{s}: {n}" for s, n in op.statuses.items()),
            op.server_errors,
            ", ".join(f"{k}: {v}" for k, v in op.failures.items()) or "0",
        ]
        for op in r.operations
    ]
    parts = [
        head,
        f"- schemathesis (positive cases from `GET /openapi.json`), up to {r.cases_per_endpoint} cases per generation "
        "endpoint; checks: not_a_server_error, status_code_conformance, content_type_conformance, "
        "response_headers_conformance, response_schema_conformance",
        f"- bound on each generated case (the server keeps its own limits): "
        f"{r.bound.describe() if r.bound else 'none'}; fuzzing took {r.wall_s:.0f} s",
        f"- verdict: **{'PASS' if r.passed else 'FAIL'}** (0 responses 5xx, 0 schema violations)",
        "",
        markdown_table(["Operation", "Cases", "Statuses", "5xx", "Violations (by check)"], rows),
        "",
        "Cases: requests generated and sent; Statuses: response status -> count; 5xx: responses >= 500; "
        "Violations: failing cases per schemathesis check (a case can fail several). A verdict, not a measurement: "
        "no ratio and no timing is judged here.",
        "",
    ]
    examples = [e for op in r.operations for e in op.examples]
    if examples:
        parts += ["## First failures", "", *(f"```\n{e}\n```" for e in examples[:10]), ""]
    return "\n".join(parts)


def fuzz_mode(
    cfg: Any, tokenizer: Any, argv: list[str] | None, say: Callable[[str], None], server_for: Any
) -> tuple[bool, list[Path]]:
    """The fuzz mode (the tokenizer is unused: schemathesis writes the requests)."""
    from glowplug.profiling.bench.cli_support import prepare_out_dir
    from glowplug.profiling.bench.machine import report_header

    from .report import write_mode_report

    out = prepare_out_dir(cfg.out_dir)
    with server_for(cfg) as (base_url, _pid):
        bound = FuzzBound(cfg.fuzz_max_tokens, cfg.fuzz_max_n, cfg.fuzz_max_prompt_chars, cfg.fuzz_max_prompt_items)
        result = run_fuzz(base_url, cfg.fuzz_cases, timeout=cfg.request_timeout, progress=say, bound=bound)
    text = render_fuzz(result, report_header("Fuzzing the HTTP API (schemathesis)", argv))
    return result.passed, write_mode_report(cfg, out, "fuzz", text, result.as_dict())
