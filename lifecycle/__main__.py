"""`python -m glowplug.lifecycle [MODEL] [--host H] [--port P] [serve flags] [engine flags]`: the service alone.

The same entry `glowplug serve` wires up; it exists so the service can run (and be tested) as a real process on
its own. Flags are generated from ServeConfig and EngineConfig, one per field.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from glowplug.profiling.process import mark_main_entry

if TYPE_CHECKING:
    from glowplug.engine.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    from glowplug.base.flags import CommandParser, add_model_argument, add_model_flags
    from glowplug.engine.config import EngineConfig

    from .config import add_serve_flags

    parser = CommandParser(prog="python -m glowplug.lifecycle", description=__doc__)
    add_model_argument(parser)  # MODEL or --model, as in every glowplug command
    add_serve_flags(parser.add_argument_group("serving (one flag per ServeConfig field)"))
    add_model_flags(
        parser.add_argument_group("engine (one flag per EngineConfig field)"), EngineConfig, exclude={"model"}
    )
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from glowplug.engine.config import CacheConfig, EngineConfig, QuantConfig, SchedulerConfig

    names: set[str] = set()
    for model in (EngineConfig, SchedulerConfig, CacheConfig, QuantConfig):
        names |= set(model.model_fields)
    fields = {k: v for k, v in vars(args).items() if k in names and k != "model"}
    fields["model"] = args.model
    return EngineConfig.from_flat(**fields)


def main(argv: list[str] | None = None) -> int:
    marks = mark_main_entry()  # first: the phase table's process_start ends here
    args = build_parser().parse_args(argv)
    marks.defer_full_gc()  # this process serves one engine: see FullGcDeferral
    from pydantic import ValidationError

    from glowplug.base.flags import FlagError, explain, resolve_model_argument

    from .config import serve_config_from_args
    from .server import serve

    try:
        resolve_model_argument(args)
        config = engine_config_from_args(args)
        serve_cfg = serve_config_from_args(args)
    except ValidationError as exc:
        print(f"glowplug: invalid setting:\n{explain(exc)}", file=sys.stderr)
        return 2
    except FlagError as exc:
        print(f"glowplug: error: {exc}", file=sys.stderr)
        return 2
    return serve(config, serve_cfg, marks=marks)


if __name__ == "__main__":
    from glowplug.base.process import exit_process

    exit_process(main())
