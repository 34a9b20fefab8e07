"""`storaged --config storaged.toml [--socket ...] [--vram-cache-bytes 8GiB] ...`

TOML first, then flags override it. Exit status: 0 after a clean SIGTERM/SIGINT shutdown,
2 for a bad configuration, 1 when a bundle or the device cannot be opened.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storaged import __version__
from storaged.config import FLAG, ConfigError, Flag, StoragedConfig, load_config

EXIT_STARTUP = 1
EXIT_CONFIG = 2


def _model_flag(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=BUNDLE_DIR, got {text!r}")
    return name, path


# A field's type -> how its flag's text is converted (Path stays text: StoragedConfig expands it).
_FLAG_TYPES: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str, Path: str}


def flag_fields() -> list[tuple[dataclasses.Field, Flag, Any]]:
    """(field, its Flag, its type) of every StoragedConfig field that is a command-line flag."""
    hints = typing.get_type_hints(StoragedConfig)
    return [(f, f.metadata[FLAG], hints[f.name]) for f in dataclasses.fields(StoragedConfig) if FLAG in f.metadata]


def flag_name(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="storaged", description="Serve expert slots from pack bundles.")
    parser.add_argument("--version", action="version", version=f"storaged {__version__}")
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--model", type=_model_flag, action="append", metavar="NAME=BUNDLE_DIR",
                        help="serve a model (repeatable; added to or replacing the file's models)")
    for field, flag, kind in flag_fields():
        help_ = flag.help if field.default is dataclasses.MISSING else f"{flag.help} (default {field.default})"
        # default None: a flag not given leaves the TOML file's value (or the field's default) alone
        if kind is bool and flag.type is None:
            parser.add_argument(flag_name(field), action=argparse.BooleanOptionalAction, default=None, help=help_)
            continue
        convert = flag.type or _FLAG_TYPES.get(kind)
        if convert is None:
            raise TypeError(f"StoragedConfig.{field.name}: no command-line conversion for {kind}; "
                            "give its Flag a type")
        parser.add_argument(flag_name(field), type=convert, metavar=flag.metavar, help=help_)
    return parser


def config_from_args(args: argparse.Namespace) -> StoragedConfig:
    overrides = {field.name: getattr(args, field.name) for field, _, _ in flag_fields()}
    models: dict[str, str] = {}
    for name, path in args.model or ():
        if name in models:
            raise ConfigError("--model", f"{name}={path}", f"model {name!r} is given twice (also as "
                              f"{name}={models[name]}); each --model NAME must be unique")
        models[name] = path
    return load_config(args.config, overrides, extra_models=models)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"storaged: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    # Bundles are validated before torch, grpc and the device are even imported, so a bad
    # bundle fails in a fraction of a second.
    from storaged.server.models import ModelOpenError, open_models

    try:
        models = open_models(config.models)
    except ModelOpenError as exc:
        print(f"storaged: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    from storaged.server.daemon import run

    return run(config, models)


if __name__ == "__main__":
    sys.exit(main())
