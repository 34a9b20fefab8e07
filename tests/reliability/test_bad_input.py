"""The bad-input table for storaged's TOML file, command-line flags and bundles: every row's outcome
asserted (bad_input_config.py, bad_input_bundles.py).

A row passes when storaged exits with the row's status, says what is wrong in one line of stderr
(argparse's refusals: its usage block, then one error line) naming every needle of the row, and
prints no traceback. Quick loop: storaged.cli.main in this process, the daemon's `run` replaced by
one that records an accepted configuration (a row that is accepted fails rather than starting a
daemon). Slow: each row through a real `python -m storaged` process.
"""

from __future__ import annotations

import collections
import contextlib
import io
import shutil
import subprocess

import pytest

from bad_input_bundles import BUNDLE_ROWS, BundleRow
from bad_input_config import BASE, CLI_ROWS, TOML_ROWS, CliRow, Row, TomlRow
from storaged_testkit import PYTHON, REPO, daemon_env

ROWS: list[Row] = [*TOML_ROWS, *CLI_ROWS, *BUNDLE_ROWS]


def _argv(row: Row, tmp_path, good_bundle) -> list[str]:
    bundle = good_bundle
    if isinstance(row, BundleRow):
        bundle = tmp_path / "bundle"
        shutil.copytree(good_bundle, bundle)
        row.edit(bundle)

    def fill(text):
        if isinstance(text, bytes):
            return fill(text.decode("latin-1")).encode("latin-1")  # byte for byte, paths are ASCII
        return text.replace("{bundle}", str(bundle)).replace("{socket}", str(tmp_path / "s.sock"))

    config = tmp_path / "storaged.toml"
    text = fill(row.text if isinstance(row, TomlRow) else BASE)
    if isinstance(text, bytes):
        config.write_bytes(text)
    else:
        config.write_text(text)
    if isinstance(row, CliRow):
        return [*(["--config", str(config)] if row.with_base else []), *(fill(a) for a in row.args)]
    return ["--config", str(config)]


def _in_process(argv: list[str], monkeypatch) -> tuple[int, str]:
    import storaged.server.daemon
    from storaged import cli

    accepted = []

    def run(config, models):  # reached only when every check passed: the row was accepted
        for model in models.values():
            model.close()
        accepted.append(config)
        return 0

    monkeypatch.setattr(storaged.server.daemon, "run", run)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            status = cli.main(argv)
        except SystemExit as exc:  # argparse's refusals
            status = exc.code
    assert not accepted, f"accepted: {accepted[0]}"
    return status, stderr.getvalue()


def _subprocess(argv: list[str]) -> tuple[int, str]:
    try:
        result = subprocess.run([PYTHON, "-m", "storaged", *argv], cwd=REPO, env=daemon_env(), capture_output=True,
                                text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("storaged accepted the input and kept running")
    return result.returncode, result.stderr


def _check(row: Row, status: int, stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert status == row.status, stderr
    for needle in row.needles:
        assert needle in stderr, f"{needle!r} not in {stderr!r}"
    lines = stderr.strip().splitlines()
    if lines and lines[0].startswith("usage:"):  # argparse: its usage block, then one error line
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("storaged: "), stderr


@pytest.fixture(scope="module")
def good_bundle(bundle):
    return bundle.path


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.surface}:{r.id}")
def test_bad_input_row(row, tmp_path, good_bundle, monkeypatch):
    _check(row, *_in_process(_argv(row, tmp_path, good_bundle), monkeypatch))


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.surface}:{r.id}")
def test_bad_input_row_through_a_real_process(row, tmp_path, good_bundle):
    _check(row, *_subprocess(_argv(row, tmp_path, good_bundle)))


def test_the_good_base_is_accepted(tmp_path, good_bundle, monkeypatch):
    """The rows start from a configuration storaged accepts: each fails for its own edit only."""
    with pytest.raises(AssertionError, match="accepted"):
        _in_process(_argv(TomlRow("TOML", "base", 0, (), BASE), tmp_path, good_bundle), monkeypatch)


def test_row_counts(figures):
    counts = collections.Counter(row.surface for row in ROWS)
    assert len({(row.surface, row.id) for row in ROWS}) == len(ROWS), "row ids repeat"
    figures.record("bad_input", rows=dict(counts))
