#!/usr/bin/env python3
"""Run the fault suite (tests/reliability) and print docs/reliability.md's tables as markdown.

    .venv/bin/python scripts/reliability_report.py          # quick sizes (the default test loop)
    .venv/bin/python scripts/reliability_report.py --full   # also the slow cases, at full size
    .venv/bin/python scripts/reliability_report.py --figures figures.json   # render saved figures only

The tests write what they measured to a JSON file (EXPERTPACK_RELIABILITY_FIGURES); this script
renders it, taking the slow (full-size) figures of a case where both were run. It also counts the
bad-input rows that other test modules assert (OTHER_TABLES), by collecting them with pytest,
so the table's row count covers every surface. Sizes can be raised with the variables the tests
read: EXPERTPACK_RELIABILITY_KILLS, _ACQUIRES (per client and round), _CORRUPT (objects).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES_ENV = "EXPERTPACK_RELIABILITY_FIGURES"

# Other modules' bad-input tables: surface → (test file, test function or None for the whole file).
OTHER_TABLES: dict[str, list[tuple[str, str | None]]] = {
    "gRPC and data plane": [
        ("tests/storaged/test_server.py", "test_bad_acquire_gets_invalid_argument"),
        ("tests/storaged/test_server.py", "test_unknown_session_is_not_found"),
        ("tests/storaged/test_server_dataplane.py", "test_release_of_a_layer_without_experts_is_refused"),
        ("tests/storaged/test_server_dataplane.py", "test_bad_acquires_are_invalid_argument_and_the_session_survives"),
        ("tests/storaged/test_server_dataplane.py", "test_bad_hellos_are_refused_with_a_status"),
        ("tests/storaged/test_server_dataplane.py",
         "test_malformed_requests_are_invalid_argument_and_close_the_connection"),
        ("tests/storaged/test_bad_input_codes.py", None),
    ],
    "TOML": [
        ("tests/storaged/test_config.py", "test_parse_size_rejects"),
        ("tests/storaged/test_config.py", "test_bad_field_raises_config_error_naming_it"),
        ("tests/storaged/test_config.py", "test_incomplete_or_malformed_file"),
        ("tests/storaged/test_server_lifecycle.py", "test_bad_config_fails_start_with_clear_error"),
    ],
    "bundles": [
        ("tests/storaged/test_server_lifecycle.py", "test_bad_bundle_fails_start_with_clear_error"),
        ("tests/packformat/test_bundle.py", "test_broken_bundle_is_refused_naming_the_file"),
        ("tests/packformat/test_bundle.py", "test_validate_refuses_a_broken_pack"),
        ("tests/packtools/test_cli.py", "test_bad_build_fails_cleanly"),
    ],
    "HTTP": [
        ("tests/inference/test_server.py", "test_invalid_requests_get_openai_errors"),
        ("tests/inference/test_server_fields.py", "test_refused_fields_get_a_400_naming_them"),
        ("tests/inference/test_server_protocol.py", "test_refusals_name_the_field"),
        ("tests/inference/test_server_protocol.py",
         "test_every_refused_field_accepts_its_off_value_and_refuses_the_rest"),
    ],
}
SURFACES = ("gRPC and data plane", "TOML", "CLI flags", "bundles", "HTTP")


def run_suite(full: bool, figures: Path) -> int:
    # pyproject.toml's addopts deselect the slow sizes; the full run selects every test
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability",
               "-m", "slow or not slow" if full else "not slow"]
    # pytest's report goes to stderr: stdout carries the tables only
    return subprocess.run(command, cwd=REPO, env={**os.environ, FIGURES_ENV: str(figures)},
                          stdout=sys.stderr).returncode


def other_table_rows() -> dict[str, int]:
    """Collected test cases of OTHER_TABLES, by surface (files that do not exist count 0)."""
    files = sorted({path for tables in OTHER_TABLES.values() for path, _ in tables if (REPO / path).exists()})
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-m", "slow or not slow", *files],
                            cwd=REPO, capture_output=True, text=True)
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    counts = collections.Counter()
    for surface, tables in OTHER_TABLES.items():
        for path, function in tables:
            prefix = f"{path}::" + (f"{function}[" if function else "")
            counts[surface] += sum(node.startswith(prefix) for node in ids)
    return counts


def _pick(figures: dict, case: str) -> dict | None:
    return figures.get(f"{case}_slow") or figures.get(f"{case}_default")


def _phases(killed_in: dict) -> str:
    return ", ".join(f"{n} {phase}" for phase, n in sorted(killed_in.items(), key=lambda item: -item[1]))


def fault_table(figures: dict) -> list[str]:
    rows = ["| fault | what was done | figure | asserted |", "| --- | --- | --- | --- |"]
    if kills := _pick(figures, "client_kills"):
        sessions = kills.get("sessions_left")
        idle = kills.get("session_idle_seconds")
        after = (f"{sessions} sessions left once idle ones were closed (session_idle_seconds = {idle:g})"
                 if idle is not None else
                 f"{sessions} sessions left (no session_idle_seconds in this build: those attached without a "
                 "stream are never closed)")
        rows.append(f"| client processes SIGKILLed at random points | {kills['kills']} clients, 8 at once, killed "
                    f"{_phases(kills['killed_in'])} | {kills['pins_left']} pins left; {after}; "
                    f"{kills['identical']}/{kills['objects']} objects served byte-identical afterwards | 0 pins, "
                    "0 sessions after the idle time, every object identical |")
    if stress := _pick(figures, "acquire_stress"):
        rss = " → ".join(f"{m:g}" for m in stress["rss_anon_mib"])
        rows.append(f"| {stress['clients']} clients × {stress['acquires_per_client']:,} Acquires, {stress['rounds']} "
                    f"rounds | 1-2 random experts a request, bytes checked by crc32; 48 objects over 40 VRAM + 16 "
                    f"host slots ({stress['vram_hits']:,} VRAM hits, {stress['host_hits']:,} host hits, "
                    f"{stress['reads']:,} pack reads) | {stress['errors']} errors, {stress['mismatches']} byte "
                    f"mismatches in {stress['acquires']:,} Acquires; daemon heap (RssAnon, MiB) {rss}: "
                    f"+{stress['rss_growth_last_round_mib']:g} MiB in the last round | 0 errors, 0 mismatches, "
                    "last round's heap growth ≤ 8 MiB |")
    if corrupt := _pick(figures, "corruption"):
        rows.append(f"| objects corrupted on disk one at a time | {corrupt['corrupted']} of {corrupt['objects']} "
                    "objects, 1-4 bytes flipped at random payload offsets while serving, cold in both tiers; read "
                    f"twice each | {corrupt['data_loss']}/{corrupt['reads']} reads DATA_LOSS, {corrupt['counted']} "
                    f"counted in checksum_failures_total; {corrupt['other_failures']} failures among the "
                    f"{corrupt['control_objects']} objects of another model and the restored ones | every read "
                    "DATA_LOSS and counted once, 0 other failures |")
    for mode in ("direct", "buffered"):
        if faults := figures.get(f"disk_faults_{mode}"):
            codes = "; ".join(f"{kind.upper() if kind == 'eio' else kind + ' reads'}: {', '.join(c)}"
                              for kind, c in faults["codes"].items())
            attempts = faults["reads"] // faults["faulted_objects"]
            rows.append(f"| disk faults ({'O_DIRECT' if mode == 'direct' else 'buffered'} reads), LD_PRELOAD "
                        f"shim | EIO on 3 objects, short reads on 3, each read {attempts} times | {codes}; "
                        f"{faults['counted']}/{faults['reads']} counted in io_errors_total "
                        f"({faults['injected_calls']} read calls failed); {faults['others_served']}/"
                        f"{faults['others']} other objects served; daemon alive: {faults['daemon_alive']} | "
                        "UNAVAILABLE naming the object, each read counted, others served, daemon alive |")
    if bad := figures.get("bad_input"):
        mine = bad["rows"]
        others = bad.get("other_tables", {})
        total = sum(mine.values()) + sum(others.values())
        by_surface = ", ".join(f"{s} {mine.get(s, 0) + others.get(s, 0)}" for s in SURFACES)
        # in SURFACES' order: the kept JSON's key order need not be the run's
        mine_text = ", ".join(f"{s} {mine[s]}" for s in SURFACES if s in mine)
        others_text = ", ".join(f"{s} {others[s]}" for s in SURFACES if s in others)
        rows.append(f"| bad inputs | tests/reliability's table: {mine_text}; "
                    f"other modules' tables: {others_text or 'not counted'} "
                    f"| {total} rows ({by_surface}), each as asserted | exit status or code, message naming the "
                    "input, no traceback |")
    if units := figures.get("systemd_security"):
        scores = "; ".join(f"`{unit}` {u['score']} (largest open: {', '.join(u['largest_open']).replace('|', '/')})"
                           for unit, u in sorted(units.items()))
        rows.append(f"| `systemd-analyze security --offline=yes` | both units in ops/systemd | {scores} | "
                    "each at or below its recorded score |")
    return rows


def restart_table(figures: dict) -> list[str]:
    cases = figures.get("daemon_restarts", {})
    rows = ["storaged killed or stopped under a client, then restarted on the same socket:", "",
            "| storaged got | client's session | the client saw | daemon exit | next request, fresh client | "
            "old session / old client after restart |", "| --- | --- | --- | --- | --- | --- |"]
    for name, case in sorted(cases.items()):
        signame, _, rest = name.partition(" ")
        state, _, transport = rest.rpartition(" (")
        rows.append(f"| {signame} {state} | {transport.rstrip(')')} | {case['client_saw']} | {case['exit_status']} | "
                    f"{case['fresh_client_next_request']} | {case['old_session_after_restart']} / "
                    f"{case['old_client_attach_after_restart']} |")
    return rows if cases else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also run the slow cases (full sizes)")
    parser.add_argument("--figures", type=Path, help="render this figures file; run nothing")
    parser.add_argument("--keep", type=Path, help="where to keep the figures JSON of this run")
    args = parser.parse_args(argv)
    status = 0
    if args.figures is None:
        target = args.keep or Path(tempfile.mkstemp(prefix="reliability-", suffix=".json")[1])
        target.write_text("")
        status = run_suite(args.full, target)
        figures = json.loads(target.read_text() or "{}")
        if "bad_input" in figures:
            figures["bad_input"]["other_tables"] = other_table_rows()
            target.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    else:
        figures = json.loads(args.figures.read_text())
    print("\n".join([*fault_table(figures), "", *restart_table(figures)]))
    if status:
        print(f"reliability_report: the suite failed (pytest exit {status}); the table shows what ran",
              file=sys.stderr)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
