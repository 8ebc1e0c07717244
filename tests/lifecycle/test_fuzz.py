"""schemathesis against a real server's own OpenAPI document: no 5xx and no schema violation on generated requests.

The benchmark (`glowplug bench serve --fuzz`, 500+ cases per generation endpoint) runs the same code with more
cases; here a smaller, derandomized run keeps CI fast. The document itself is checked to be precise where it
matters: ranges from SamplingParams, the served model as the only `model`, content required off assistant turns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lifecycle_harness import ThreadServer, engine_config

from glowplug.lifecycle.config import ServeConfig
from glowplug.profiling.bench.serve.fuzz import GENERATION_OPERATIONS, run_fuzz

CI_CASES = 60


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ThreadServer]:
    # A short context keeps every generated request cheap: at most 64 positions, n <= 16.
    srv = ThreadServer(
        engine_config(tiny_model, max_model_len=64), ServeConfig(port=0, served_model_name="tiny", max_queue=64)
    ).start()
    srv.wait_ready()
    yield srv
    srv.stop()


def test_openapi_document_is_precise(server: ThreadServer) -> None:
    doc = httpx.get(server.base_url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    comp = schemas["CompletionRequest"]["properties"]
    assert {"type": "integer", "minimum": 1, "maximum": 16} in comp["n"]["anyOf"]
    assert comp["model"]["anyOf"][0]["enum"] == ["tiny"]
    temp = next(m for m in comp["temperature"]["anyOf"] if m.get("type") == "number")
    assert temp["minimum"] == 0.0 and temp["maximum"] == 10.0
    message = schemas["ChatMessage"]["anyOf"]
    user = next(m for m in message if "user" in m["properties"]["role"]["enum"])
    assert "content" in user["required"]
    post = doc["paths"]["/v1/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("CompletionRequest")
    assert {"200", "400", "404", "429", "503"} <= set(post["responses"])
    assert "text/event-stream" in post["responses"]["200"]["content"]
    assert "Retry-After" in post["responses"]["429"]["headers"]


def test_fuzz_no_server_errors_no_schema_violations(server: ThreadServer) -> None:
    result = run_fuzz(server.base_url, CI_CASES, timeout=60)
    report = {
        f"{op.method} {op.path}": (op.cases, op.statuses, op.failures, op.examples[:2]) for op in result.operations
    }
    for op in result.operations:
        assert op.server_errors == 0, report
        assert op.violations == 0, report
        if (op.path, op.method) in GENERATION_OPERATIONS:
            assert op.cases >= CI_CASES, report
            # The document is precise enough that generated requests mostly get through to the engine.
            assert op.statuses.get(200, 0) > 0, report
    assert result.passed
    # The server is still healthy and idle after the fuzzing.
    assert httpx.get(server.base_url + "/health/ready", timeout=10).status_code == 200
