"""The llama.cpp contender at one VRAM budget, inside bench.e2e.runner's child process: llama-bench
(bench.e2e.llamacpp_command) runs as that child's subprocess, so in the same cgroup and under the
same memory.max rules as every other contender:

  - the page cache is dropped first, memory.max is the set-up limit (overhead + budget) while the
    model loads;
  - at llama-bench's first warm-up (model loaded; its progress lines say so) memory.max is tightened
    to what the processes hold themselves + the budget's bytes + slack (bench.e2e.measure.budget_ram_limit).
    llama-bench cannot be paused between its warm-up and its timed runs, so the warm-up already runs
    under the tightened limit and the timed runs start with at most the budget's bytes of page cache
    (the warm-up's experts), where the other contenders start with none;
  - disk reads are llama-bench's /proc/<pid>/io read_bytes (and the block device's), sampled when a
    timed run starts (its progress line) and when its JSON record arrives.

Decoding runs a 2-token test before the full one; when the full test cannot end inside the time
share (predicted from the short one, or the deadline passes), llama-bench is stopped and the short
test's figures stand, stated in the notes, as the other contenders stop decoding at their deadline.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

from bench.e2e.llamacpp_command import (LlamaBenchOutputError, LlamaBenchPlan, LlamaBenchTest, build_flavour,
                                        build_status_problem, llama_bench_path, llamacpp_required, parse_test)
from bench.e2e.measure import (block_device_stat, device_read_bytes, drop_page_cache, process_read_bytes,
                               setup_ram_limit_bytes, tighten_ram_limit)
from bench.e2e.prepare import PreparedModel

STOP_GRACE_SECONDS = 5
LOG_TAIL_LINES = 15
PROGRESS = re.compile(r"llama-bench: benchmark (\d+)/(\d+): (.*)")


class LlamaCppUnavailable(RuntimeError):
    """No usable llama-bench binary while EXPERTPACK_REQUIRE_LLAMACPP=1; the message says why."""


def binary_problem(binary: Path, device: str) -> str | None:
    """Why `binary` cannot serve as the contender on `device`, or None."""
    build_failed = build_status_problem()
    if build_failed and not binary.is_file():
        return build_failed
    if not binary.is_file():
        return (f"llama-bench not found at {binary} (build it with bench/llamacpp/build.sh, or name one with "
                f"--llamacpp-bin / $EXPERTPACK_LLAMACPP_BIN)")
    if not os.access(binary, os.X_OK):
        return f"{binary} is not executable"
    flavour = build_flavour(binary)
    if device.startswith("cuda") and flavour == "cpu":
        return (f"{binary} is a CPU build (its BUILD_INFO says so): a GPU run needs bench/llamacpp/build.sh "
                "without --cpu")
    return None


def _reads(pid: int, device_stat: Path | None) -> dict:
    return {"process_read_bytes": process_read_bytes(pid), "device_read_bytes": device_read_bytes(device_stat)}


def _delta(start: dict | None, end: dict | None) -> dict | None:
    if start is None or end is None:
        return None
    return {key: None if start[key] is None or end[key] is None else end[key] - start[key] for key in start}


class LlamaBenchProcess:
    """llama-bench running one plan: its progress lines and test records, each stamped with the disk
    reads at that moment; `on_loaded` runs once, at the first warm-up or timed run."""

    def __init__(self, plan: LlamaBenchPlan, log_path: Path, device_stat: Path | None, on_loaded):
        self.plan, self.log_path, self.device_stat, self.on_loaded = plan, log_path, device_stat, on_loaded
        self.run_starts: dict[int, dict] = {}  # test index (1-based) -> reads when its timed run began
        self.tests: list[tuple[LlamaBenchTest, dict]] = []  # records in arrival order, with reads at arrival
        self.load_reads: dict | None = None  # from the start to the first warm-up: model load
        self.warm_up_reads: dict | None = None  # the first test's warm-up, up to its timed run
        self._warm_up_start: dict | None = None
        self.output_errors: list[str] = []
        self._arrivals: list[float] = []  # perf_counter() when each record arrived
        self._lock = threading.Lock()
        self._on_loaded_thread: threading.Thread | None = None

    def run(self, deadline: float) -> tuple[int | str, str | None]:
        """(exit status or how it was stopped, why it was stopped early or None)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as self._log:
            self._log.write(" ".join(self.plan.command()) + "\n")
            self._process = subprocess.Popen(self.plan.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, bufsize=1)
            self._start = _reads(self._process.pid, self.device_stat)
            readers = [threading.Thread(target=self._read_progress, daemon=True),
                       threading.Thread(target=self._read_records, daemon=True)]
            for reader in readers:
                reader.start()
            stopped = None
            while self._process.poll() is None:
                stopped = self._reason_to_stop(deadline)
                if stopped:
                    self._stop()
                    break
                time.sleep(0.05)
            status = self._process.wait()
            for thread in (*readers, self._on_loaded_thread):
                if thread is not None:
                    thread.join(timeout=STOP_GRACE_SECONDS)
        return ("stopped" if stopped else status), stopped

    def _reason_to_stop(self, deadline: float) -> str | None:
        now = time.perf_counter()
        if now >= deadline:
            return "its time share ran out"
        if len(self.plan.decode_tests) == 1:
            return None
        with self._lock:
            probe = [(t, at) for (t, _), at in zip(self.tests, self._arrivals, strict=True)
                     if t.n_gen == self.plan.decode_tests[0]]
        if probe:
            # the full test starts when the probe ends: its 1-token warm-up plus its tokens, at the probe's speed
            test, arrived = probe[0]
            needed = (self.plan.tokens + 1) * test.ns_per_token / 1e9
            if arrived + needed > deadline:
                return (f"tg{self.plan.tokens} would have needed ~{needed:.0f} s at tg{test.n_gen}'s speed, "
                        f"{deadline - arrived:.0f} s of its time share were left")
        return None

    def _stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def _read_progress(self) -> None:
        for line in self._process.stderr:
            match = PROGRESS.match(line.strip())
            if match:
                index, event = int(match.group(1)), match.group(3)
                reads = _reads(self._process.pid, self.device_stat)
                if self._on_loaded_thread is None and ("warmup" in event or " run " in event):
                    self.load_reads, self._warm_up_start = _delta(self._start, reads), reads
                    # its own thread: lowering memory.max blocks while the kernel reclaims, and the
                    # next progress lines must be stamped when they come
                    self._on_loaded_thread = threading.Thread(target=self.on_loaded, daemon=True)
                    self._on_loaded_thread.start()
                if event.startswith(("prompt run", "generation run")):
                    with self._lock:
                        self.run_starts[index] = reads
                        if self.warm_up_reads is None:
                            self.warm_up_reads = _delta(self._warm_up_start, reads)
            with self._lock:
                self._log.write(line)

    def _read_records(self) -> None:
        for line in self._process.stdout:
            reads = _reads(self._process.pid, self.device_stat)
            with self._lock:
                self._log.write(line)
                if not line.strip():
                    continue
                try:
                    self.tests.append((parse_test(json.loads(line)), reads))
                    self._arrivals.append(time.perf_counter())
                except (ValueError, LlamaBenchOutputError) as exc:
                    self.output_errors.append(f"{exc}: {line.strip()[:200]}")

    def test_reads(self, position: int) -> dict | None:
        """Disk reads of the timed run of the test that arrived `position`-th (0-based)."""
        return _delta(self.run_starts.get(position + 1), self.tests[position][1])

    def log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-LOG_TAIL_LINES:])


def run_llamacpp_budget(name: str, model: PreparedModel, fraction: float, spec: dict, cgroup, deadline: float,
                        share: float) -> dict:
    """bench.e2e.runner's per-budget step for the llama.cpp contender: the same result record as the
    others (prefill_tok_s, decode_tok_s, tokens, ssd_bytes_per_token, reads, RAM limit), plus
    `llamacpp` (command, placement, llama-bench's own per-test timings for the profiler). `share`
    goes unused: llama-bench's tests are sized up front and stopped at `deadline`."""
    from bench.e2e.contenders import budget_bytes

    budget = budget_bytes(model, fraction)
    result = {"contender": name, "shape": model.shape.name, "budget_fraction": fraction, "budget_bytes": budget}
    notes = result["notes"] = []
    binary = llama_bench_path()
    problem = binary_problem(binary, spec["device"])
    if problem:
        if llamacpp_required():
            raise LlamaCppUnavailable(f"{problem} (and EXPERTPACK_REQUIRE_LLAMACPP=1)")
        return result | {"skipped": problem}
    threads = spec.get("torch_threads") or len(os.sched_getaffinity(0))
    plan = LlamaBenchPlan(binary, model.gguf_path, fraction, budget, model.shape.expert_bytes * model.shape.experts,
                          model.moe_layers, model.shape.dense_layers, spec["prompt_len"], spec["tokens"], threads)
    notes.append(plan.describe() + f"; -t {threads}, flash attention auto, batch sizes llama-bench's defaults")
    if cgroup is not None:
        cgroup.set_limit(setup_ram_limit_bytes(spec["ram_overhead_bytes"], budget))
    result["page_cache_dropped"] = drop_page_cache()

    limit_errors = []

    def on_loaded() -> None:
        if cgroup is not None:  # llama.cpp has no cache of its own in host RAM: the page cache gets the budget
            try:
                tighten_ram_limit(cgroup, budget, 0, result)
            except (OSError, ValueError) as exc:
                limit_errors.append(exc)

    log_path = Path(spec["workdir"]) / f"llamacpp-{model.shape.arch}-{fraction}-{os.getpid()}.log"
    bench = LlamaBenchProcess(plan, log_path, block_device_stat(model.gguf_path), on_loaded)
    status, stopped = bench.run(deadline)
    if limit_errors:  # its figures would not be under the budget's RAM limit
        raise RuntimeError(f"memory.max of {cgroup.path} not tightened for the timed runs: {limit_errors[0]}")
    if cgroup is not None:
        result["ram_peak_bytes"] = cgroup.peak_bytes()
    return _figures(result, plan, bench, status, stopped, spec["device"])


def _figures(result: dict, plan: LlamaBenchPlan, bench: LlamaBenchProcess, status, stopped: str | None,
             device: str) -> dict:
    notes = result["notes"]
    tests = [t for t, _ in bench.tests]
    prompt = next((n for n, t in enumerate(tests) if t.n_prompt == plan.prompt_len), None)
    decode = [n for n, t in enumerate(tests) if t.n_gen in plan.decode_tests]
    if bench.output_errors:
        raise LlamaBenchOutputError("; ".join(bench.output_errors))
    if prompt is None or not decode:
        raise RuntimeError(f"llama-bench ended ({status}{': ' + stopped if stopped else ''}) before its prompt "
                           f"and a generation test finished; log {bench.log_path}:\n{bench.log_tail()}")
    chosen = max(decode, key=lambda n: tests[n].n_gen)
    first = tests[0]
    if device.startswith("cuda") and "CUDA" not in first.backends:
        raise RuntimeError(f"llama-bench ran on {first.backends!r}, not CUDA: {plan.binary} is not a CUDA build")
    decode_test, decode_reads = tests[chosen], bench.test_reads(chosen)
    measured, source = None, None
    if decode_reads is not None:
        for key, name in (("process_read_bytes", "process"), ("device_read_bytes", "device")):
            if decode_reads[key] is not None:
                measured, source = decode_reads[key], name
                break
    if measured is None:
        notes.append("SSD bytes not measurable here: neither /proc/<pid>/io nor the block device stats")
    if decode_test.n_gen < plan.tokens:
        why = f"stopped, {stopped}" if stopped else f"llama-bench exited ({status}) before tg{plan.tokens} finished"
        notes.append(f"decoded {decode_test.n_gen} of {plan.tokens} tokens (llama-bench tg{decode_test.n_gen}): {why}")
    elif status != 0 and not stopped:
        notes.append(f"llama-bench exited with status {status} after its tests")
    notes.append(f"llama-bench decodes from an empty context (its tg test), the others after the {plan.prompt_len}-"
                 "token prompt; experts from memory: n/a (no pack read counter for this contender)")
    return result | {
        "prefill_tok_s": tests[prompt].avg_ts, "decode_tok_s": decode_test.avg_ts, "tokens": decode_test.n_gen,
        "prompt_len": plan.prompt_len,
        "ssd_bytes_per_token": None if measured is None else measured / decode_test.n_gen,
        "ssd_bytes_source": source, "decode_reads": decode_reads, "prefill_reads": bench.test_reads(prompt),
        "warm_up_reads": bench.warm_up_reads, "load_reads": bench.load_reads, "from_memory": None,
        "llamacpp": {
            "command": plan.command(), "n_cpu_moe": plan.n_cpu_moe, "moe_layers_in_vram": plan.layers_in_vram,
            "moe_layers": plan.moe_layers, "layer_expert_bytes": plan.layer_expert_bytes, "threads": plan.threads,
            "build_commit": first.build_commit, "backends": first.backends, "gpu_info": first.gpu_info,
            "flash_attn": first.flash_attn, "load_mode": first.load_mode, "exit": status,
            # llama-bench's own timings per test (avg_ns, stddev_ns, samples_ns, ns_per_token): the
            # peer's per-token time for a per-layer profiler
            "tests": [t.as_dict() | {"reads": bench.test_reads(n)} for n, t in enumerate(tests)],
            "log": str(bench.log_path)}}
