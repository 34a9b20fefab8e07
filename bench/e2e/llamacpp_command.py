"""llama.cpp's llama-bench as the e2e benchmark's peer: where its binary is, the command line a
llama.cpp user would write for a VRAM budget, and the parsing of its JSON output.

Per budget (a fraction of the routed experts' bytes, as for every contender):
  100%   -ngl 99: every weight in VRAM.
  less   -ngl 99 (attention, norms, router and shared experts in VRAM) and --n-cpu-moe N:
           layers_in_vram = min(moe_layers, floor(budget_bytes / one MoE layer's expert bytes in the GGUF))
           N = dense_layers + (moe_layers - layers_in_vram), or 0 when every MoE layer fits
         llama.cpp keeps the experts of the first N blocks on the CPU (mmap'd from the GGUF), so N
         counts the leading dense blocks too (they have no experts to move).
Both: -lm mmap (experts read through the page cache, which the RAM limit bounds), -fa auto and the
batch sizes at llama-bench's defaults, one thread per core, -r 1, JSON lines on stdout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN_ENV = "EXPERTPACK_LLAMACPP_BIN"
REQUIRE_ENV = "EXPERTPACK_REQUIRE_LLAMACPP"  # "1": a missing binary is an error, not a skipped run
DEFAULT_BIN = REPO / ".llamacpp" / "bin" / "llama-bench"
BUILD_INFO = "BUILD_INFO"  # written by bench/llamacpp/build.sh next to the binary
# bench/run_all.sh builds in the background and writes build.sh's exit status to this file when done
BUILD_STATUS_ENV = "EXPERTPACK_LLAMACPP_BUILD_STATUS"
# a file holding the session id of that build (run_all.sh starts it with setsid): its processes
# are paused while a contender is timed
BUILD_SESSION_ENV = "EXPERTPACK_LLAMACPP_BUILD_SESSION"
PROBE_TOKENS = 2  # a short decode test first: its figure stands when the full one cannot finish in time
ALL_LAYERS = 99  # -ngl: more than any model here has


class LlamaBenchOutputError(ValueError):
    """llama-bench printed something that is not the JSON test records expected; says what is wrong."""


def llama_bench_path(explicit: str | os.PathLike | None = None) -> Path:
    """The binary to run: `explicit`, else $EXPERTPACK_LLAMACPP_BIN, else .llamacpp/bin/llama-bench."""
    chosen = explicit or os.environ.get(BIN_ENV) or DEFAULT_BIN
    return Path(chosen).expanduser().resolve()


def llamacpp_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") == "1"


def build_flavour(binary: Path) -> str | None:
    """'cuda' or 'cpu' from build.sh's BUILD_INFO beside the binary; None for a binary built otherwise."""
    try:
        for line in (binary.parent / BUILD_INFO).read_text().splitlines():
            if line.startswith("flavour="):
                return line.split("=", 1)[1].strip()
    except OSError:
        return None
    return None


def wait_for_build(deadline: float, poll_seconds: float = 1.0) -> str | None:
    """Waits (until time.perf_counter(), the runner's clock, reaches `deadline`) for the background
    build bench/run_all.sh started, if any; returns why the contender cannot use it, or None (built,
    or no build pending)."""
    status_path = os.environ.get(BUILD_STATUS_ENV)
    if not status_path:
        return None
    path = Path(status_path)
    while not path.exists():
        if time.perf_counter() >= deadline:
            return f"bench/llamacpp/build.sh had not finished when the llamacpp contender's turn came ({path} absent)"
        time.sleep(poll_seconds)
    return build_status_problem()


def build_in_progress() -> bool:
    """Whether the background build bench/run_all.sh started is still compiling (its status file absent)."""
    status_path = os.environ.get(BUILD_STATUS_ENV)
    return bool(status_path) and not Path(status_path).exists()


def session_processes(session: int) -> list[int]:
    """Pids of the live processes of `session` (the sixth field of /proc/<pid>/stat)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == session:
            pids.append(int(entry.name))
    return pids


def _build_session() -> int | None:
    path = os.environ.get(BUILD_SESSION_ENV)
    try:
        return int(Path(path).read_text()) if path else None
    except (OSError, ValueError):  # not written yet, or torn: nothing to pause
        return None


@contextlib.contextmanager
def build_paused() -> Iterator[bool]:
    """Stops the background build's processes (SIGSTOP) for the block and continues them after, so
    a timed run does not share the cores with compilers; yields whether a build was paused. ninja
    gives each compiler a process group of its own, so the build is found by its session."""
    session = _build_session()
    if session is None or not build_in_progress():
        yield False
        return
    stopped: list[int] = []
    try:
        for _ in range(3):  # a compiler ninja spawned while the others were being stopped
            new = [pid for pid in session_processes(session) if pid not in stopped and pid != os.getpid()]
            if not new:
                break
            for pid in new:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                except ProcessLookupError:
                    pass
        yield bool(stopped)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def build_status_problem() -> str | None:
    """Why the background build failed (its status file holds a non-zero exit status), or None."""
    status_path = os.environ.get(BUILD_STATUS_ENV)
    if not status_path or not Path(status_path).exists():
        return None
    status = Path(status_path).read_text().strip()
    if status == "0":
        return None
    log = Path(status_path).with_suffix(".log")
    return f"bench/llamacpp/build.sh failed (exit status {status or 'unknown'}); its log: {log}"


def binary_summary(binary: Path) -> str:
    """One line on the binary for the results' statements: missing, or its build.sh BUILD_INFO."""
    if not binary.is_file():
        if os.environ.get(BUILD_STATUS_ENV) and not Path(os.environ[BUILD_STATUS_ENV]).exists():
            return "not built yet: bench/run_all.sh is building it in the background"
        return "missing: the llamacpp contender is reported as not run"
    try:
        info = dict(line.split("=", 1) for line in (binary.parent / BUILD_INFO).read_text().splitlines()
                    if "=" in line)
    except OSError:
        return "not built by bench/llamacpp/build.sh (no BUILD_INFO)"
    return (f"{info.get('flavour', '?')} build of llama.cpp {info.get('commit', '?')[:12]}, "
            f"{info.get('compiler', '?')}" + (f", {info['nvcc']}" if info.get("nvcc") else ""))


def moe_layers_in_vram(budget_bytes: int, layer_expert_bytes: int, moe_layers: int) -> int:
    """How many MoE layers' experts a user fits in a VRAM budget: whole layers, at most all of them."""
    if layer_expert_bytes <= 0 or moe_layers <= 0 or budget_bytes < 0:
        raise ValueError(f"layer expert bytes {layer_expert_bytes} and MoE layers {moe_layers} must be positive, "
                         f"budget bytes {budget_bytes} not negative")
    return min(moe_layers, budget_bytes // layer_expert_bytes)


@dataclasses.dataclass(frozen=True)
class LlamaBenchPlan:
    """One llama-bench run: a model, a VRAM budget and the test sizes."""

    binary: Path
    gguf: Path
    fraction: float  # of the routed experts' bytes, 1.0 = everything in VRAM
    budget_bytes: int  # the same bytes every contender gets (bench.e2e.contenders.budget_bytes)
    layer_expert_bytes: int  # one MoE layer's routed experts in the GGUF (gate, up, down of every expert)
    moe_layers: int
    dense_layers: int  # leading blocks without routed experts
    prompt_len: int
    tokens: int
    threads: int

    def __post_init__(self):
        if not 0 < self.fraction <= 1:
            raise ValueError(f"budget fraction {self.fraction} outside (0, 1]")
        for name in ("layer_expert_bytes", "moe_layers", "prompt_len", "tokens", "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.budget_bytes < 0 or self.dense_layers < 0:
            raise ValueError(f"budget bytes {self.budget_bytes} and dense layers {self.dense_layers} "
                             "must not be negative")

    @property
    def layers_in_vram(self) -> int:
        if self.fraction >= 1.0:
            return self.moe_layers
        return moe_layers_in_vram(self.budget_bytes, self.layer_expert_bytes, self.moe_layers)

    @property
    def n_cpu_moe(self) -> int:
        """--n-cpu-moe: the first N blocks keep their experts on the CPU (dense blocks counted)."""
        on_cpu = self.moe_layers - self.layers_in_vram
        return 0 if on_cpu == 0 else self.dense_layers + on_cpu

    @property
    def decode_tests(self) -> list[int]:
        """-n values: the short probe first, then the full count (one test when they coincide)."""
        return [self.tokens] if self.tokens <= PROBE_TOKENS else [PROBE_TOKENS, self.tokens]

    def command(self) -> list[str]:
        placement = ["-ngl", str(ALL_LAYERS)]
        if self.n_cpu_moe:
            placement += ["--n-cpu-moe", str(self.n_cpu_moe)]
        return [str(self.binary), "-m", str(self.gguf), "-p", str(self.prompt_len),
                "-n", ",".join(map(str, self.decode_tests)), *placement, "-lm", "mmap", "-fa", "auto",
                "-t", str(self.threads), "-r", "1", "-o", "jsonl", "--progress"]

    def describe(self) -> str:
        where = ("every weight in VRAM" if not self.n_cpu_moe else
                 f"{self.layers_in_vram} of {self.moe_layers} MoE layers' experts in VRAM "
                 f"(budget {self.budget_bytes} B / {self.layer_expert_bytes} B a layer), the rest mmap'd on the CPU")
        return f"-ngl {ALL_LAYERS}" + (f" --n-cpu-moe {self.n_cpu_moe}" if self.n_cpu_moe else "") + f": {where}"


@dataclasses.dataclass(frozen=True)
class LlamaBenchTest:
    """One test record of llama-bench's JSON: a prompt test (n_gen 0) or a generation test (n_prompt 0)."""

    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ns: int  # mean wall time of one repetition
    stddev_ns: int
    avg_ts: float  # tokens per second (n_prompt + n_gen over avg_ns)
    stddev_ts: float
    samples_ns: tuple[int, ...]
    build_commit: str
    backends: str  # e.g. "CUDA" or "CPU"
    gpu_info: str
    n_threads: int
    n_gpu_layers: int
    n_cpu_moe: int
    flash_attn: int  # llama-bench's enum: -1 auto, 0 off, 1 on
    load_mode: str

    @property
    def name(self) -> str:
        kind = f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"
        return kind + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def ns_per_token(self) -> float:
        return self.avg_ns / (self.n_prompt + self.n_gen)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"test": self.name, "ns_per_token": self.ns_per_token}


_INT_FIELDS = ("n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns", "n_threads", "n_gpu_layers", "n_cpu_moe",
               "flash_attn")
_FLOAT_FIELDS = ("avg_ts", "stddev_ts")
_STR_FIELDS = ("build_commit", "backends", "gpu_info", "load_mode")


def parse_test(record: dict) -> LlamaBenchTest:
    missing = [key for key in (*_INT_FIELDS, *_FLOAT_FIELDS, *_STR_FIELDS, "samples_ns") if key not in record]
    if missing:
        raise LlamaBenchOutputError(f"llama-bench test record lacks {', '.join(missing)}")
    try:
        test = LlamaBenchTest(**{k: int(record[k]) for k in _INT_FIELDS},
                              **{k: float(record[k]) for k in _FLOAT_FIELDS},
                              **{k: str(record[k]) for k in _STR_FIELDS},
                              samples_ns=tuple(int(s) for s in record["samples_ns"]))
    except (TypeError, ValueError) as exc:
        raise LlamaBenchOutputError(f"llama-bench test record has a malformed field: {exc}") from None
    if (test.n_prompt > 0) == (test.n_gen > 0):
        raise LlamaBenchOutputError(f"test {test.name}: expected a prompt or a generation test, got n_prompt "
                                    f"{test.n_prompt} and n_gen {test.n_gen}")
    if test.avg_ns <= 0 or not test.samples_ns:
        raise LlamaBenchOutputError(f"test {test.name}: no timed repetition (avg_ns {test.avg_ns})")
    return test


def parse_output(text: str) -> list[LlamaBenchTest]:
    """The tests of llama-bench's `-o json` (one array) or `-o jsonl` (one object a line) output."""
    stripped = text.strip()
    if not stripped:
        raise LlamaBenchOutputError("llama-bench printed no test record")
    try:
        records = json.loads(stripped) if stripped.startswith("[") else \
            [json.loads(line) for line in stripped.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise LlamaBenchOutputError(f"llama-bench output is not JSON: {exc}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise LlamaBenchOutputError("llama-bench JSON is not a list of test objects")
    return [parse_test(record) for record in records]
