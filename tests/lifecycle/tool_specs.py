"""The two tools the tool-call tests offer (a weather and a time function), the question that needs one, and the
check every returned call must pass: a named tool, an OpenAI call id, arguments that validate against its schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        assert call.function.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), specs[call.function.name])
