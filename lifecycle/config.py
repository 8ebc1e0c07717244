"""ServeConfig: the settings of the HTTP service around one engine (the engine's own live in EngineConfig).

Frozen and validated like EngineConfig, so the CLI flags, a config file and tests all go through one schema; the
flags are generated from the fields (`add_serve_flags`), so a new setting is a new flag with nothing to keep in sync.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

LogFormat = Literal["auto", "json", "console"]

# Where `glowplug serve` takes the API key from when --api-key is not given: an environment variable keeps the key
# out of the process's command line (which `ps` shows to every user of the machine).
API_KEY_ENV = "GLOWPLUG_API_KEY"
MIB = 1 << 20


class ServeConfig(BaseModel):
    """How `glowplug serve` listens, admits and shuts down.

    Requests that arrive before the engine is READY are admitted (they count against `max_queue`) and wait up to
    `ready_wait` seconds for the start-up to finish; past that they get 503 with a Retry-After of the start-up's
    ETA. `ready_wait=0` answers 503 at once until READY.
    """

    # Inputs stay out of error messages: one of them may be the API key.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 for all interfaces).")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one (logged at start).")
    max_queue: int = Field(
        256,
        ge=1,
        description="Most requests admitted but not yet running in the engine; past it the server answers 429.",
    )
    max_queue_wait: float | None = Field(
        30.0,
        ge=0.0,
        description="Admission by expected wait: answer 429 (Retry-After: the expected wait) when a new request "
        "would wait longer than this many seconds for its first token (set it from your TTFT SLO); "
        "unset = admit up to --max-queue only.",
    )
    drain_timeout: float = Field(
        30.0, ge=0.0, description="Seconds in-flight requests may take to finish after SIGTERM/SIGINT."
    )
    ready_wait: float = Field(
        30.0, ge=0.0, description="Seconds a request that arrives during start-up waits for READY before a 503."
    )
    restart_core: bool = Field(
        False,
        description="When the engine core process dies after READY, start a new one (a new start-up, with a new "
        "trace) instead of exiting; open streams end with an error event either way.",
    )
    failed_exit_delay: float = Field(
        5.0,
        ge=0.0,
        description="When the engine core dies after READY (without --restart-core): seconds the server keeps "
        "answering 503 with the reason, so probes and clients see why, before it exits with status 1.",
    )
    served_model_name: str | None = Field(
        None,
        description="The model id in /v1/models and responses (default: the --model value; a model file's "
        "file name, not its path).",
    )
    # ---- the transport: limits checked before any work (lifecycle/transport.py; README, "Hostile input")
    max_body_bytes: int = Field(
        16 * MIB,
        ge=0,
        description="Largest request body in bytes: a larger one gets 413 before it is read (by its Content-Length) "
        "or as soon as it passes the limit (chunked). 16 MiB: millions of words of text, more than any context "
        "holds. 0 = no limit.",
    )
    max_json_depth: int = Field(
        128,
        ge=1,
        le=512,
        description="Deepest nesting of JSON arrays and objects in a request body; deeper gets 400 before parsing "
        "(Python's parser would fail near 1,000 levels with a RecursionError).",
    )
    max_json_values: int = Field(
        1 << 20,
        ge=1024,
        description="Most array elements and object members in a request body (counted by their commas, before "
        "parsing); more gets 413. Each parsed value costs ~130 bytes and ~0.1 us with the GIL held: 2^20 (the "
        "default) is 128 prompts of 8 K token ids, ~130 MB and ~100 ms.",
    )
    body_read_timeout: float = Field(
        60.0,
        ge=0.0,
        description="Seconds the whole request body may take to arrive after the request head; slower gets 408 "
        "and the connection is closed. 0 = no limit.",
    )
    header_read_timeout: float = Field(
        20.0,
        ge=0.0,
        description="Seconds a request head may take to arrive complete, from the connection opening (or from its "
        "first byte, on a kept-alive connection); then the connection is closed. 0 = no limit.",
    )
    api_key: SecretStr | None = Field(
        None,
        description=f"Require `Authorization: Bearer <key>` on /v1/* (401 otherwise); health probes, /metrics, "
        f"/startup and the page stay open. Default: ${API_KEY_ENV} if set, else no key.",
    )
    log_level: str = Field("info", description="debug, info, warning, error or critical.")
    log_format: LogFormat = Field("auto", description="json, console, or auto (JSON unless stderr is a terminal).")

    @field_validator("host")
    @classmethod
    def _host_set(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("host must not be empty; use 127.0.0.1 or 0.0.0.0")
        return v.strip()

    @field_validator("api_key")
    @classmethod
    def _key_is_a_header_value(cls, v: SecretStr | None) -> SecretStr | None:
        # Sent as `Authorization: Bearer <key>`: a key with spaces or control characters could never match.
        # The message never contains the key.
        if v is not None:
            key = v.get_secret_value()
            if not key or not all("!" <= ch <= "~" for ch in key):
                raise ValueError("the API key must be non-empty printable ASCII without spaces")
        return v

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, v: str) -> str:
        if not isinstance(logging.getLevelName(v.upper()), int):
            raise ValueError(f"unknown log level {v!r}; use debug, info, warning, error or critical")
        return v.lower()

    def model_name(self, engine_model: str) -> str:
        """The model's id in /v1/models and every response: --served-model-name, else the --model value, except
        that a model file is named by its file name (`qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`), not its path."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(engine_model).expanduser()
        return path.name if path.is_file() else engine_model

    def model_names(self, engine_model: str) -> tuple[str, ...]:
        """Every `model` a request may name: the served name; without --served-model-name, also the --model value
        as given and as an absolute path (what clients written against the path-named server send)."""
        name = self.model_name(engine_model)
        if self.served_model_name:
            return (name,)
        path = Path(engine_model).expanduser()
        full = str(path.resolve()) if path.exists() else engine_model
        return tuple(dict.fromkeys((name, engine_model, full)))


def add_serve_flags(parser: argparse.ArgumentParser | Any) -> list[str]:
    """One `--flag` per ServeConfig field (argparse group or parser); returns the field names added."""
    from glowplug.base.flags import add_model_flags

    return add_model_flags(parser, ServeConfig)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig for parsed flags; unset flags keep the defaults (raises pydantic.ValidationError)."""
    given = {k: v for k, v in vars(args).items() if k in ServeConfig.model_fields}
    if "api_key" not in given and os.environ.get(API_KEY_ENV):
        given["api_key"] = os.environ[API_KEY_ENV]
    return ServeConfig(**given)
