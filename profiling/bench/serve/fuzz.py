"""Fuzzing the HTTP API with schemathesis against the server's own OpenAPI document (`GET /openapi.json`).

For each operation, hypothesis generates up to N request bodies from the document (lifecycle/openapi.py makes it
precise: SamplingParams' ranges, the served model, the limits the server enforces), each is sent to the server and
its response checked by schemathesis: not a 5xx, a documented status, a documented content type, documented
headers, a body that matches the documented schema. Every case is run to the end (a failure is recorded and
counted, not raised), so the result is a count per check over all cases, not the first failure only.

Not checked: positive_data_acceptance. What a JSON schema cannot say (prompt + max_tokens within max-model-len,
stream_options only with stream, top_logprobs only with logprobs, best_of == n, token ids within the vocabulary)
is a documented 400, which schemathesis would call a rejected valid request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The generation endpoints get N cases each; the probes and listings have (almost) no input, a few cases suffice.
GENERATION_OPERATIONS = (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"))
OTHER_OPERATIONS = (("/v1/models", "GET"), ("/health/live", "GET"), ("/health/ready", "GET"), ("/metrics", "GET"))
_OTHER_CASES = 5


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

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
            response_schema_conformance]  # fmt: skip


def fuzz_operation(schema: Any, base_url: str, path: str, method: str, cases: int, timeout: float) -> OperationResult:
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.core.failures import FailureGroup

    result = OperationResult(path, method)
    operation = schema[path][method]
    statuses: Counter[int] = Counter()
    failures: Counter[str] = Counter()
    checks = _checks()

    @settings(max_examples=cases, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy())
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
    base_url: str, cases: int, *, timeout: float = 120.0, progress: Callable[[str], None] | None = None
) -> FuzzResult:
    try:
        import schemathesis
    except ImportError as exc:
        raise RuntimeError("--fuzz needs schemathesis: pip install 'glowplug[test]'") from exc
    say = progress or (lambda _m: None)
    schema = schemathesis.openapi.from_url(base_url.rstrip("/") + "/openapi.json")
    out = []
    for path, method in GENERATION_OPERATIONS + OTHER_OPERATIONS:
        n = cases if (path, method) in GENERATION_OPERATIONS else _OTHER_CASES
        say(f"fuzz: {method} {path}, up to {n} cases")
        out.append(fuzz_operation(schema, base_url, path, method, n, timeout))
    return FuzzResult(cases, out)


def render_fuzz(r: FuzzResult, head: str) -> str:
    from ..tables import markdown_table

    rows = [
        [f"`{op.method} {op.path}`", op.cases, ", ".join(f"{s}: {n}" for s, n in op.statuses.items()),
         op.server_errors, ", ".join(f"{k}: {v}" for k, v in op.failures.items()) or "0"]
        for op in r.operations
    ]  # fmt: skip
    parts = [
        head,
        f"- schemathesis (positive cases from `GET /openapi.json`), up to {r.cases_per_endpoint} cases per generation "
        "endpoint; checks: not_a_server_error, status_code_conformance, content_type_conformance, "
        "response_headers_conformance, response_schema_conformance",
        f"- verdict: **{'PASS' if r.passed else 'FAIL'}** (0 responses 5xx, 0 schema violations)",
        "",
        markdown_table(["Operation", "Cases", "Statuses", "5xx", "Violations (by check)"], rows),
        "",
    ]
    examples = [e for op in r.operations for e in op.examples]
    if examples:
        parts += ["## First failures", "", *(f"```\n{e}\n```" for e in examples[:10]), ""]
    return "\n".join(parts)


def fuzz_mode(
    cfg: Any, argv: list[str] | None, say: Callable[[str], None], server_for: Any
) -> tuple[bool, list[Path]]:
    from ..cli_support import prepare_out_dir, write_json
    from ..machine import report_header

    out = prepare_out_dir(cfg.out_dir)
    with server_for(cfg) as (base_url, _pid):
        result = run_fuzz(base_url, cfg.fuzz_cases, timeout=cfg.request_timeout, progress=say)
    text = render_fuzz(result, report_header("Fuzzing the HTTP API (schemathesis)", argv))
    (out / "fuzz.md").write_text(text)
    write_json(out / "fuzz.json", {"config": cfg.model_dump(mode="json"), **result.as_dict()})
    print(text)
    return result.passed, [out / "fuzz.md", out / "fuzz.json"]
