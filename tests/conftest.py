"""Shared fixtures: tiny random checkpoints (made here, no network), the real default model, and the real GGUF files
`glowplug models fetch` assembles (skipped, naming that command, where they are not fetched)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# too_slow: on a loaded machine generating the examples is slow, which says nothing about the code under test.
settings.register_profile(
    "glowplug", deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("glowplug")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` skip, with the reason, where torch sees no GPU (CI, the CPU machines)."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    why = pytest.mark.skip(reason="needs a CUDA GPU (scripts/device_check.sh runs these on one)")
    for item in marked:
        item.add_marker(why)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_dir("qwen2") -> folder with a random HF checkpoint of that family (made once per session)."""
    from glowplug.engine.models.tiny import make_tiny_checkpoint

    made: dict[str, Path] = {}

    def get(variant: str = "llama") -> Path:
        if variant not in made:
            made[variant] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{variant}"), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model, converted once into the glowplug cache (GLOWPLUG_CACHE_DIR)."""
    from glowplug.engine.models.store import resolve_model

    return resolve_model("smollm2", quiet=True)


@pytest.fixture
def make_llm() -> Iterator[Callable[..., object]]:
    """Build LLMs; after the test, every engine's block manager must be back to all blocks free (no leaks)."""
    from glowplug.engine.llm import LLM

    built: list[LLM] = []

    def make(model: str | os.PathLike[str], **kwargs: object) -> LLM:
        llm = LLM(str(model), **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        stats = llm.engine.stats()
        assert not llm.engine.has_unfinished(), "engine still has unfinished requests"
        assert stats.kv_used_blocks == 0, f"KV blocks leaked: {stats.kv_used_blocks}"


def real_model(name: str) -> Path:
    """The file `glowplug models fetch NAME` makes (glowplug/model_fetch.py's recipe): the path in the recipe's
    test variable (GLOWPLUG_TEST_GEMMA3_GGUF, ...; .ci/run exports them), else the fetch's default place. Absent,
    the test skips with the command that fetches it as the reason; a variable naming a missing file fails, since
    whoever set it meant the test to run."""
    from glowplug.model_fetch import model_path, recipe

    r = recipe(name)
    named = os.environ.get(r.test_env)
    if named:
        if not Path(named).is_file():
            pytest.fail(f"{r.test_env}={named} is not a file: run `{r.fetch_command}` and point it at the path printed")
        return Path(named)
    path = model_path(r)
    if not path.is_file():
        pytest.skip(f"no {r.filename}: run `{r.fetch_command}` (or set {r.test_env} to the file)")
    return path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """gemma-3-270m Q4_K_M as llama.cpp wrote it (`glowplug models fetch gemma3-270m`)."""
    return real_model("gemma3-270m")


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (`glowplug models fetch qwen2.5-coder-1.5b`)."""
    return real_model("qwen2.5-coder-1.5b")
