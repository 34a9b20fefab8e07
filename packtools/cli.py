"""packtools command line: build, validate, inspect, synth."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import traceback

from packtools import __version__


def _cmd_build(args) -> int:
    from packtools.build import build_bundle
    from packtools.inspect import human_bytes

    report = build_bundle(args.source, args.output, force=args.force, progress=not args.quiet)
    print(f"wrote {report.bundle}: {report.objects} expert objects ({human_bytes(report.expert_bytes)}), "
          f"{report.dense_tensors} dense tensors ({human_bytes(report.dense_bytes)}) in "
          f"{report.seconds:.1f} s; peak RSS {human_bytes(report.peak_rss_bytes)}")
    return 0


def _cmd_validate(args) -> int:
    from packtools.inspect import validate

    result = validate(args.bundle, full=args.full)
    for failure in result.bad_objects:
        print(f"BAD {failure}", file=sys.stderr)
    what = "structure and every object checksum" if result.checked_checksums else "structure"
    if result.ok:
        print(f"{result.bundle}: OK ({what} of {result.objects} objects)")
        return 0
    print(f"{result.bundle}: {len(result.bad_objects)} of {result.objects} objects are corrupt", file=sys.stderr)
    return 1


def _cmd_inspect(args) -> int:
    from packformat.bundle import open_bundle
    from packtools.inspect import format_summary, summarize

    with open_bundle(args.bundle) as bundle:
        summary = summarize(bundle)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def _cmd_synth(args) -> int:
    from packtools.synth.cli import run_synth

    path = run_synth(args)
    print(f"wrote {args.format} model {args.arch} to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packtools", description=__doc__)
    parser.add_argument("--version", action="version", version=f"packtools {__version__}")
    parser.add_argument("--debug", action="store_true", help="also print the traceback of an error (exit status unchanged)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="convert a GGUF file or HF model directory into a bundle")
    p.add_argument("source", help="a .gguf file (first shard of a split set) or a HF model directory")
    p.add_argument("-o", "--output", required=True, help="bundle directory to create")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("validate", help="check a bundle's structure (and checksums with --full)")
    p.add_argument("bundle")
    p.add_argument("--full", action="store_true", help="also verify every object checksum")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("inspect", help="summarize a bundle")
    p.add_argument("bundle")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("synth", help="make a random-weight model of a real architecture")
    from packtools.synth.cli import add_synth_arguments

    add_synth_arguments(p)
    p.set_defaults(func=_cmd_synth)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (systemd, docker stop, timeout), unwound like Ctrl-C so a build removes its
    staging directory instead of leaving a partial pack of any size on disk."""


def _raise_terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal.signal's requirement
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        return args.func(args)
    except KeyboardInterrupt as exc:
        print("interrupted; no partial output was left behind", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a one-line message and exit 2
        if args.debug:
            traceback.print_exc()  # more to read, the same outcome: --debug never changes the exit status
        print(f"packtools {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
