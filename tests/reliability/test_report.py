"""scripts/reliability_report.py: the tables in docs/reliability.md are what it renders from the
figures file kept with them, and the other modules' bad-input tables it counts still exist."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability_report: begin -->", "<!-- reliability_report: end -->"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("reliability_report", REPO / "scripts" / "reliability_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_tables_are_the_rendered_figures(report):
    text = DOC.read_text()
    figures_file = re.search(r"figures: \[(docs/results/[^\]]+\.json)\]", text)
    assert figures_file, "docs/reliability.md names no figures file"
    figures = json.loads((REPO / figures_file.group(1)).read_text())
    rendered = "\n".join([*report.fault_table(figures), "", *report.restart_table(figures)])
    assert text.split(BEGIN)[1].split(END)[0].strip() == rendered.strip()


def test_counted_tables_exist(report):
    for surface, tables in report.OTHER_TABLES.items():
        for path, function in tables:
            if function is None:
                continue  # a whole module, counted when present
            assert f"def {function}(" in (REPO / path).read_text(), f"{surface}: {path}::{function} is gone"
