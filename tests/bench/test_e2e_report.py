"""bench/e2e/report.py: the lookahead table (SSD bytes with ÷ without hints, the 15% bar)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.e2e.report import lookahead_lines, markdown  # noqa: E402


def run(contender: str, fraction: float, tok_s: float, per_token: float | None) -> dict:
    return {"shape": "S", "contender": contender, "budget_fraction": fraction, "decode_tok_s": tok_s,
            "ssd_bytes_per_token": per_token}


@pytest.mark.parametrize(("with_bytes", "without", "cell"), [
    (115e6, 100e6, "1.15× (within)"),  # exactly the bar
    (116e6, 100e6, "1.16× (over)"),
    (80e6, 100e6, "0.80× (within)"),  # hints that save reads (a host-tier hit instead of a miss)
    (0.0, 0.0, "– (–)"),  # nothing read either way: no ratio
])
def test_lookahead_rows_state_the_ratio_and_the_bar(with_bytes, without, cell):
    rows = lookahead_lines([run("storaged", 0.25, 6.0, with_bytes), run("storaged_no_lookahead", 0.25, 5.0, without)])
    assert rows[-1] == f"| S | 25% | {with_bytes / 1e6:.1f} | {without / 1e6:.1f} | {cell} | 1.20× |"


def test_lookahead_table_needs_both_runs_at_the_same_budget():
    assert lookahead_lines([run("storaged", 0.25, 6.0, 1e6), run("storaged_no_lookahead", 0.5, 5.0, 1e6)]) == []
    text = markdown({"e2e": {"runs": [run("storaged", 0.1, 4.0, 2e8), run("storaged_no_lookahead", 0.1, 4.4, 1.9e8),
                                      run("storaged_serial", 0.1, 3.0, 2e8)]}})
    section = text.split("### Lookahead hints")[1]
    assert "| S | 10% | 200.0 | 190.0 | 1.05× (within) | 0.91× |" in section


def test_ratio_tables_compare_storaged_cold_and_preloaded_with_each_baseline():
    runs = [run("storaged", 0.5, 60.0, 2e6), run("storaged_preload", 0.5, 180.0, 0.0), run("storaged_serial", 0.5, 6.0, 1e8),
            run("llamacpp", 0.5, 300.0, 0.0), run("storaged_copy_up", 0.5, 30.0, 2e6)]
    runs[3] |= {"prefill_tok_s": 200.0, "llamacpp": {"n_cpu_moe": 6, "moe_layers_in_vram": 6}}
    text = markdown({"e2e": {"runs": runs}})
    ratios = text.split("## Decode speed ratios")[1].split("### storaged ÷ llama.cpp")[0]
    assert "| S | storaged | 50% | 10.00× | – | – | 0.20× | – |" in ratios
    assert "| S | storaged_preload | 50% | 30.00× | – | – | 0.60× | – |" in ratios
    assert "storaged_copy_up |" not in ratios  # a variant for its own comparison, not a headline row
    peer = text.split("### storaged ÷ llama.cpp")[1]
    assert "| S | storaged_preload | 50% | 0.60× | – | 300.00 | 200.00 | 6 | 6 |" in peer
