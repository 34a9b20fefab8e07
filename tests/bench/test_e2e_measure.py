"""bench.e2e.measure's RAM limit arithmetic and cgroup files (a directory laid out as a cgroup v2
hierarchy stands in for /sys/fs/cgroup, which this machine does not let us write)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.e2e.measure import MemoryCgroup, budget_ram_limit, page_cache_bytes  # noqa: E402
from bench.e2e.measure import RAM_SLACK_BYTES, tighten_ram_limit  # noqa: E402

GIB = 2**30
STAT = "anon 3000\nfile 900\nshmem 100\nactive_file 500\ninactive_file 300\nkernel 7\n"


@pytest.mark.parametrize(
    "current, page_cache, budget, own, slack, expected",
    [
        (8 * GIB, 4 * GIB, GIB, 0, 0, 5 * GIB),  # mmap: own memory + the whole budget for the page cache
        (8 * GIB, 4 * GIB, GIB, GIB, 0, 4 * GIB),  # storaged: its host tier is the budget already
        (8 * GIB, 0, GIB, 2 * GIB, 0, 8 * GIB),  # a host cache above the budget gets no page cache, not less
        (8 * GIB, 4 * GIB, 0, 0, 512, 4 * GIB + 512),
        (0, 0, 0, 0, 0, 0),
    ])
def test_budget_ram_limit(current, page_cache, budget, own, slack, expected):
    assert budget_ram_limit(current, page_cache, budget, own, slack) == expected


@pytest.mark.parametrize("current, page_cache, budget, own, slack", [
    (GIB, 2 * GIB, 0, 0, 0),  # page cache larger than the usage holding it
    (GIB, -1, 0, 0, 0),
    (GIB, 0, -1, 0, 0),
    (GIB, 0, 0, -1, 0),
    (GIB, 0, 0, 0, -1),
])
def test_budget_ram_limit_rejects_inconsistent_figures(current, page_cache, budget, own, slack):
    with pytest.raises(ValueError):
        budget_ram_limit(current, page_cache, budget, own, slack)


def test_page_cache_is_the_file_lru_without_shmem():
    assert page_cache_bytes(STAT) == 800


def test_page_cache_names_a_missing_line():
    with pytest.raises(ValueError, match="inactive_file"):
        page_cache_bytes("anon 1\nactive_file 2\n")


@pytest.fixture
def cgroup_root(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    return tmp_path


def test_tightened_limit_is_written_to_memory_max(cgroup_root):
    cgroup = MemoryCgroup("run", 20 * GIB, root=cgroup_root)
    assert (cgroup.path / "memory.max").read_text() == str(20 * GIB)
    (cgroup.path / "memory.current").write_text(f"{6 * GIB}\n")
    (cgroup.path / "memory.stat").write_text(f"anon {5 * GIB}\nactive_file {GIB}\ninactive_file 0\n")
    result = {}
    tighten_ram_limit(cgroup, budget=3 * GIB, own_cache_bytes=GIB, result=result)
    expected = 5 * GIB + 2 * GIB + RAM_SLACK_BYTES
    assert (cgroup.path / "memory.max").read_text() == str(expected) == str(result["ram_limit_bytes"])
    assert result["ram_own_bytes"] == 5 * GIB and result["ram_page_cache_allowance_bytes"] == 2 * GIB
