"""Measured, never estimated: bytes read from the disk (per process from /proc/<pid>/io, and for the
whole block device from /sys/dev/block/<major:minor>/stat), and the host RAM limit (a cgroup v2
memory.max that also bounds the page cache, so no contender can keep the model in RAM)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

SECTOR_BYTES = 512  # /sys/block stat counts 512-byte sectors whatever the device's sector size
CGROUP_ROOT = Path("/sys/fs/cgroup")


def process_read_bytes(pid: int | str = "self") -> int | None:
    """read_bytes of /proc/<pid>/io (bytes the process and its threads made the block layer fetch,
    O_DIRECT and page faults included), or None where the kernel does not expose it."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def block_device_stat(path: Path) -> Path | None:
    """The stat file of the block device holding `path` (the whole disk when it is a partition)."""
    device = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    if not node.exists():
        return None
    stat = node / "stat"
    parent_stat = node.resolve().parent / "stat"
    if (node / "partition").exists() and parent_stat.exists():
        return parent_stat
    return stat if stat.exists() else None


def device_read_bytes(stat: Path | None) -> int | None:
    if stat is None:
        return None
    try:
        return int(stat.read_text().split()[2]) * SECTOR_BYTES  # field 3: sectors read
    except (OSError, ValueError, IndexError):
        return None


@dataclasses.dataclass
class ReadCounter:
    """Bytes read from the disk between start() and stop() by a set of processes and by the device."""

    device_stat: Path | None
    pids: list[int | str] = dataclasses.field(default_factory=lambda: ["self"])
    _process: list[int | None] = dataclasses.field(default_factory=list)
    _device: int | None = None

    def start(self) -> None:
        self._process = [process_read_bytes(p) for p in self.pids]
        self._device = device_read_bytes(self.device_stat)

    def stop(self) -> dict:
        """{'process_read_bytes': ..., 'device_read_bytes': ...}; None where not measurable."""
        after = [process_read_bytes(p) for p in self.pids]
        pairs = list(zip(self._process, after, strict=True))
        process = None if any(a is None or b is None for a, b in pairs) else sum(b - a for a, b in pairs)
        device_after = device_read_bytes(self.device_stat)
        device = None if self._device is None or device_after is None else device_after - self._device
        return {"process_read_bytes": process, "device_read_bytes": device}


class CgroupUnavailable(RuntimeError):
    """No writable cgroup v2 with the memory controller here; the message says what is missing."""


def cgroup_v2_problem(root: Path = CGROUP_ROOT) -> str | None:
    """Why a memory-limited cgroup cannot be made here, or None when it can."""
    controllers = root / "cgroup.controllers"
    if not controllers.exists():
        return f"{root} is not a cgroup v2 hierarchy (no cgroup.controllers)"
    if "memory" not in controllers.read_text().split():
        return f"the memory controller is not available in {root}"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (needs root)"
    return None


class MemoryCgroup:
    """A child cgroup with memory.max (and memory.swap.max 0): processes moved into it, and their page
    cache, stay under the limit. Removed by close() once its processes have exited."""

    def __init__(self, name: str, limit_bytes: int, root: Path = CGROUP_ROOT):
        problem = cgroup_v2_problem(root)
        if problem is not None:
            raise CgroupUnavailable(problem)
        subtree = root / "cgroup.subtree_control"
        if "memory" not in subtree.read_text().split():
            try:
                subtree.write_text("+memory")
            except OSError as exc:
                raise CgroupUnavailable(f"cannot enable the memory controller in {subtree}: {exc}") from None
        self.path = root / name
        self.path.mkdir(exist_ok=True)
        self.set_limit(limit_bytes)
        swap = self.path / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")  # else the limit would push pages to swap instead of dropping them

    def set_limit(self, limit_bytes: int) -> None:
        (self.path / "memory.max").write_text(str(int(limit_bytes)))
        self.limit_bytes = int(limit_bytes)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def usage(self) -> tuple[int, int]:
        """(memory.current, the reclaimable page cache in it) in bytes."""
        current = int((self.path / "memory.current").read_text())
        return current, page_cache_bytes((self.path / "memory.stat").read_text())

    def peak_bytes(self) -> int | None:
        peak = self.path / "memory.peak"
        return int(peak.read_text()) if peak.exists() else None

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass  # a process is still inside; the kernel keeps it until then


PAGE_CACHE_KEYS = ("active_file", "inactive_file")  # memory.stat: file-backed LRU pages (shmem is not on them)


def page_cache_bytes(memory_stat: str) -> int:
    """The reclaimable page cache of a cgroup v2 memory.stat text (active_file + inactive_file)."""
    fields = dict(line.split(maxsplit=1) for line in memory_stat.splitlines() if line.strip())
    missing = [key for key in PAGE_CACHE_KEYS if key not in fields]
    if missing:
        raise ValueError(f"memory.stat has no {', '.join(missing)} line")
    return sum(int(fields[key]) for key in PAGE_CACHE_KEYS)


def budget_ram_limit(current_bytes: int, page_cache: int, budget: int, own_cache_bytes: int, slack: int) -> int:
    """memory.max for the timed part of a run: what the contender holds itself (its memory.current
    without the page cache: interpreter, CUDA context, dense weights, pinned buffers, storaged's host
    tier) plus the rest of the RAM budget for the page cache, plus `slack` for growth while it runs.
    The budget is the VRAM budget's bytes; a contender's own host cache (`own_cache_bytes`) counts
    against it, so storaged's host tier and a GGUF mmap's page cache get the same bytes."""
    if not 0 <= page_cache <= current_bytes:
        raise ValueError(f"page cache {page_cache} bytes outside memory.current {current_bytes}")
    if min(budget, own_cache_bytes, slack) < 0:
        raise ValueError(f"negative byte count: budget {budget}, own cache {own_cache_bytes}, slack {slack}")
    return current_bytes - page_cache + max(0, budget - own_cache_bytes) + slack


def drop_page_cache() -> bool:
    """Flush and drop the page cache (root only); False when refused."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


RAM_SLACK_BYTES = 512 * 2**20  # host RAM a contender may use beyond its budget and its own bytes


def setup_ram_limit_bytes(overhead_bytes: int, budget: int) -> int:
    """memory.max while a contender loads and warms up: a generous process baseline (interpreter,
    torch, CUDA context, dense weights) plus the budget; tightened before the clock starts."""
    return overhead_bytes + budget


def tighten_ram_limit(cgroup: MemoryCgroup, budget: int, own_cache_bytes: int, result: dict) -> None:
    """memory.max for the timed run (budget_ram_limit): lowering it below
    memory.current makes the kernel reclaim the page cache down to the budget at once."""
    current, page_cache = cgroup.usage()
    cgroup.set_limit(budget_ram_limit(current, page_cache, budget, own_cache_bytes, RAM_SLACK_BYTES))
    result.update(ram_limit_bytes=cgroup.limit_bytes, ram_own_bytes=current - page_cache,
                  ram_page_cache_allowance_bytes=max(0, budget - own_cache_bytes))
