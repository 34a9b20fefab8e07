"""`systemd-analyze security` exposure of the shipped units stays at or below the recorded score.

The score (0 safest .. 10) is systemd's own sum over its hardening checks, computed offline from the
unit file (`--offline=yes`: no running systemd needed). RECORDED is what docs/reliability.md
states; a change to a unit that raises its exposure fails here until the figure is updated (and
the reason given). tests/ops/test_systemd_units.py keeps the looser bound of 4.0.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "ops" / "systemd"
RECORDED = {"storaged.service": 3.2, "inference.service": 3.2}
_OVERALL = re.compile(r"Overall exposure level for (\S+): (\d+\.\d)")
_OPEN_ITEM = re.compile(r"^✗ (\S+)\s.*?\s(\d+\.\d)\s*$")


def analyze(unit: Path) -> tuple[float, list[tuple[str, float]]]:
    """(overall exposure, the open items with their share, largest first); skips where it cannot run."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd; ops/ci-deps.sh installs it)")
    result = subprocess.run([tool, "security", "--offline=yes", "--man=no", str(unit)], capture_output=True,
                            text=True, timeout=60)
    match = _OVERALL.search(result.stdout)
    if match is None:
        pytest.skip(f"systemd-analyze security --offline=yes cannot score {unit.name} here "
                    f"(exit {result.returncode}): {(result.stderr or result.stdout).strip()[:300]}")
    items = [(m.group(1), float(m.group(2))) for line in result.stdout.splitlines() if (m := _OPEN_ITEM.match(line))]
    return float(match.group(2)), sorted(items, key=lambda item: -item[1])


@pytest.mark.parametrize("unit", sorted(RECORDED))
def test_exposure_stays_at_or_below_the_recorded_score(unit, figures):
    score, items = analyze(UNITS / unit)
    figures.record("systemd_security", **{unit: {"score": score, "recorded": RECORDED[unit],
                                                 "largest_open": [f"{name} {share}" for name, share in items[:3]]}})
    assert score <= RECORDED[unit], f"{unit}: exposure {score} > recorded {RECORDED[unit]}; open: {items}"


def test_docs_state_the_recorded_scores():
    text = (UNITS.parents[1] / "docs" / "reliability.md").read_text()
    for unit, score in RECORDED.items():
        assert re.search(rf"`{re.escape(unit)}`[^\n]*\b{score}\b", text), f"docs/reliability.md lacks {unit} {score}"
