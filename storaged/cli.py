"""`storaged --config storaged.toml [--socket ...] [--vram-cache-bytes 8GiB] ...`

TOML first, then flags override it. Exit status: 0 after a clean SIGTERM/SIGINT shutdown,
2 for a bad configuration, 1 when a bundle or the device cannot be opened.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from storaged import __version__
from storaged.config import ConfigError, StoragedConfig, load_config

EXIT_STARTUP = 1
EXIT_CONFIG = 2


def _model_flag(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=BUNDLE_DIR, got {text!r}")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="storaged", description="Serve expert slots from pack bundles.")
    parser.add_argument("--version", action="version", version=f"storaged {__version__}")
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--model", type=_model_flag, action="append", metavar="NAME=BUNDLE_DIR",
                        help="serve a model (repeatable; added to or replacing the file's models)")
    parser.add_argument("--socket", help="Unix socket path (default /run/expertpack/storaged.sock)")
    parser.add_argument("--vram-cache-bytes", help="arena byte budget, e.g. 8GiB")
    parser.add_argument("--host-cache-bytes", help="pinned host tier byte budget; 0 = off")
    parser.add_argument("--staging-buffers", type=int)
    parser.add_argument("--io-parallelism", type=int)
    parser.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--verify-checksums", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--verify-hits", type=float, metavar="FRACTION",
                        help="share of cache hits re-checked against their checksum: 0 off (default), 1.0 every hit")
    parser.add_argument("--metrics-address", help="host:port of the Prometheus endpoint, or 'off'")
    parser.add_argument("--device", help="'cpu' or 'cuda:N'")
    parser.add_argument("--shutdown-grace-seconds", type=float)
    parser.add_argument("--fence-timeout-seconds", type=float,
                        help="how long a session may stay mid-step while a slot it may read waits (default 10)")
    parser.add_argument("--max-ids-per-acquire", type=int)
    parser.add_argument("--session-idle-seconds", type=float,
                        help="close a session without an Acquire stream or data plane connection after this "
                             "long (default 60)")
    parser.add_argument("--max-sessions-per-peer", type=int,
                        help="most live sessions one uid may hold; 0 = no bound (default 256)")
    return parser


def config_from_args(args: argparse.Namespace) -> StoragedConfig:
    overrides = {
        "socket": args.socket, "vram_cache_bytes": args.vram_cache_bytes,
        "host_cache_bytes": args.host_cache_bytes, "staging_buffers": args.staging_buffers,
        "io_parallelism": args.io_parallelism, "direct_io": args.direct_io,
        "verify_checksums": args.verify_checksums, "verify_hits": args.verify_hits,
        "metrics_address": args.metrics_address,
        "device": args.device, "shutdown_grace_seconds": args.shutdown_grace_seconds,
        "max_ids_per_acquire": args.max_ids_per_acquire, "fence_timeout_seconds": args.fence_timeout_seconds,
        "session_idle_seconds": args.session_idle_seconds, "max_sessions_per_peer": args.max_sessions_per_peer,
    }
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
    from storaged.server.models import ModelLoadError, open_models

    try:
        models = open_models(config.models)
    except ModelLoadError as exc:
        print(f"storaged: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    from storaged.server.daemon import run

    return run(config, models)


if __name__ == "__main__":
    sys.exit(main())
