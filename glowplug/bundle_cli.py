"""`glowplug bundle create | install | show`: the ready-engine bundle from the command line (engine/bundle.py).

`create` takes the engine flags every start takes (and the model), validated by the same schema; `install` puts a
bundle's entries into GLOWPLUG_CACHE_DIR without starting; `show` prints a bundle's header. A file that is not a
bundle is refused with one line (exit 2)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .base.flags import add_model_argument


class BundleOut(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path = Field(description="Where to write the bundle (a file; its folder is created). Suffix: .glowplug")

    @field_validator("out")
    @classmethod
    def _file(cls, v: Path) -> Path:
        if v.is_dir():
            raise ValueError(f"--out {v} is a folder; name the bundle file, e.g. {v / 'model.glowplug'}")
        if v.suffix != ".glowplug":
            raise ValueError(f"--out {v}: name the bundle with the .glowplug suffix, e.g. {v.with_suffix('.glowplug')}")
        return v


class BundleFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    file: Path = Field(description="A bundle made with `glowplug bundle create`.")
    as_json: bool = Field(False, alias="json", description="JSON on stdout instead of text.")


def _say(line: str) -> None:
    print(f"glowplug: {line}", file=sys.stderr, flush=True)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def cmd_create(args: argparse.Namespace, engine_config: Callable[[argparse.Namespace], Any]) -> int:
    flags = BundleOut(out=args.out)
    config = engine_config(args)
    if config.bundle is not None:
        raise ValueError("--bundle does not apply to `bundle create`; drop it (a bundle is made from a start)")
    from glowplug.engine.bundle import BundleError, create_bundle

    try:
        result = create_bundle(config, flags.out, say=_say)
    except BundleError as exc:
        _say(f"error: {exc}")
        return 1
    over = result.size - result.model_bytes
    _say(
        f"wrote {result.path}: {_size(result.size)} ({_size(result.model_bytes)} model as stored + "
        f"{_size(over)} of entries) in {result.seconds:.1f} s (cold start {result.cold_s:.1f} s, warm "
        f"{result.warm_s:.1f} s)"
    )
    for cache, key, size in result.entries:
        print(f"  {cache:<16} {key}  {_size(size):>10}")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    flags = BundleFile(file=args.file, json=args.json)
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.bundle import install_bundle
    from glowplug.base.machine import isa_choice
    from glowplug.engine.bundle import install_filter

    store = ArtifactStore()
    report = install_bundle(flags.file, store, wanted=install_filter(isa_choice().cpu_level))
    if flags.as_json:
        print(json.dumps([e.__dict__ for e in report.entries], indent=1))
    else:
        _say(f"{flags.file.name} into {store.root}: {report.summary()}")
        for e in report.entries:
            print(f"  {e.cache:<16} {e.key}  {e.outcome}{': ' + e.reason if e.reason else ''}")
    return 1 if report.count("damaged") else 0


def cmd_show(args: argparse.Namespace) -> int:
    flags = BundleFile(file=args.file, json=args.json)
    from glowplug.base.artifacts.bundle import read_header
    from glowplug.base.machine import fact_changes, machine_facts

    header = read_header(flags.file)
    if flags.as_json:
        print(header.model_dump_json(indent=1))
        return 0
    print(f"{flags.file}: glowplug bundle made {header.created} by glowplug {header.glowplug}")
    print(f"  model: {header.model.get('spec')} ({header.model.get('name')})")
    print("  made on: " + ", ".join(f"{k}={v}" for k, v in header.machine.items()))
    differ = fact_changes(header.machine, machine_facts())
    print("  here: " + ("; ".join(differ) if differ else "the same machine facts"))
    for k, v in header.info.items():
        print(f"  {k}: {v}")
    for e in header.entries:
        print(
            f"  {e.cache:<16} {e.key}  {_size(sum(r.size for r in e.manifest.files.values())):>10}  "
            f"{len(e.manifest.files)} files"
        )
    return 0


def register(
    sub: Any,
    engine_parent: argparse.ArgumentParser,
    engine_config: Callable[[argparse.Namespace], Any],
    output_parent: argparse.ArgumentParser,
) -> None:
    """Add `glowplug bundle ...` to the top-level subparsers."""
    bundle = sub.add_parser("bundle", help="Ready-engine bundles: everything a start builds, in one file.")
    bsub = bundle.add_subparsers(dest="bundle_command", required=True, metavar="ACTION")
    create = bsub.add_parser(
        "create",
        parents=[engine_parent, output_parent],
        help="Start MODEL with these flags (cold, then warm, in an empty private cache dir) and write one file with "
        "the model, the compiled step, the kernels and the profiles.",
    )
    add_model_argument(create)
    create.add_argument("--out", required=True, type=Path, help=BundleOut.model_fields["out"].description)
    create.set_defaults(func=lambda a: cmd_create(a, engine_config))
    for name, text, func in (
        ("install", "Install a bundle's entries into GLOWPLUG_CACHE_DIR (exit 1 if one is damaged).", cmd_install),
        ("show", "Print a bundle's header: where it was made, for which config, its entries.", cmd_show),
    ):
        p = bsub.add_parser(name, help=text)
        p.add_argument("file", type=Path, help=BundleFile.model_fields["file"].description)
        p.add_argument("--json", action="store_true", help=BundleFile.model_fields["as_json"].description)
        p.set_defaults(func=func)
