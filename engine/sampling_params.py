"""Sampling parameters: one validated schema shared by the offline API, the CLI and the HTTP server."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
# A logit bias is added to a token's logit before sampling: -100 bans the token, +100 forces it (OpenAI's range).
LOGIT_BIAS_LIMIT = 100.0
# Below this a temperature samples greedily: dividing float32 logits by ~1e-38 overflows to inf, and the softmax of
# inf is NaN, which crashed the sampler (and with it every request in the batch). vLLM uses the same threshold.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int = Field(1, ge=1, le=16, description="Completions per prompt.")
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Sample from the smallest set of tokens this likely.")
    top_k: int = Field(-1, ge=-1, description="Sample from the k likeliest tokens; -1 or 0 disables.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p x the likeliest.")
    # At least 0.01: a near-zero penalty divides logits into inf (the same NaN crash as a near-zero temperature).
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0, description="Above 1 discourages repeated tokens.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Penalty for any token already generated.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Penalty per repeat of a generated token.")
    seed: int | None = Field(None, ge=0, lt=2**63, json_schema_extra={"default_text": "the engine's --seed"})
    max_tokens: int = Field(16, ge=1, description="Most new tokens.")
    # Free text: a stop string may contain a comma, so the flag never splits its value (see base/flags.py).
    stop: tuple[str, ...] = Field((), description="Stop before this text.", json_schema_extra={"free_text": True})
    stop_token_ids: tuple[int, ...] = Field((), description="Stop after any of these token ids.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Top-n logprobs per output token.",
        json_schema_extra={"default_text": "off"},
    )
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    # llguidance's grammar text (engine/structured.py builds it from a JSON schema, regex, choices or Lark and checks
    # it); every sampled token must keep the output inside it, and the sequence ends ("stop") when it is complete.
    grammar: str | None = Field(
        None,
        description="Constrain the output to this llguidance grammar.",
        json_schema_extra={"default_text": "off", "free_text": True},
    )

    # Token id -> value added to its logit (in [-100, 100]); the HTTP API's string keys are read as ids here. Ids are
    # checked against the served vocabulary where it is known (engine/outputs.py check_request).
    logit_bias: dict[int, float] | None = Field(
        None, description="Add this to the token's logit before sampling.", json_schema_extra={"default_text": "off"}
    )

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: object) -> object:
        if not isinstance(v, dict):
            return v
        out: dict[int, object] = {}
        for key, value in v.items():
            if isinstance(key, bool) or not (
                isinstance(key, int) or (isinstance(key, str) and key.isascii() and key.isdigit())
            ):
                raise ValueError(
                    f"key {key!r} is not a token id: keys are token ids written as decimal integers "
                    f'(e.g. {{"1234": -100}})'
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"the bias of token {key} is {value!r}, not a number in [-100, 100]")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"the bias of token {key} is {value}, outside [-100, 100]")
            out[int(key)] = value
        return out or None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        return v

    @field_validator("stop")
    @classmethod
    def _stop_ok(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(v)})")
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _greedy_seed(self) -> SamplingParams:
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
