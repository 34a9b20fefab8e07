"""run_contender: one contender in a child process (under a cgroup memory.max where possible), at
one or several VRAM budgets, each a cold start; returns the measured figures per budget.

    python -m bench.e2e.runner SPEC.json     # the child; the parent writes SPEC and reads its result file

The child writes its result file after every budget, so a child killed by its time limit still
leaves the budgets it finished.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.e2e.measure import (CgroupUnavailable, MemoryCgroup, ReadCounter, block_device_stat, drop_page_cache,
                               setup_ram_limit_bytes, tighten_ram_limit)
from bench.e2e.llamacpp_command import build_in_progress, build_paused
from bench.e2e.prepare import PreparedModel

REPO = Path(__file__).resolve().parents[2]
KILL_GRACE_SECONDS = 20  # beyond the run's own deadline: daemon shutdown, the result file
# memory.max beyond what a contender holds after its warm-up plus its budget: Python objects,
# gRPC buffers and allocator growth during the timed run (anonymous memory cannot be reclaimed)


def _run_one_budget(name: str, model: PreparedModel, fraction: float, spec: dict, cgroup: MemoryCgroup | None,
                    deadline: float, share: float) -> dict:
    import torch

    from bench.e2e.contenders import ContenderSkipped, budget_bytes, build_contender
    from bench.e2e.generation import synchronize, timed_generation, warm_up

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    budget = budget_bytes(model, fraction)
    result = {"contender": name, "shape": model.shape.name, "budget_fraction": fraction, "budget_bytes": budget}
    notes = result["notes"] = []
    if cgroup is not None:
        cgroup.set_limit(setup_ram_limit_bytes(spec["ram_overhead_bytes"], budget))
    result["page_cache_dropped"] = drop_page_cache()
    try:
        built = build_contender(name, model, fraction, device, dtype, Path(spec["workdir"]),
                                static_len=spec["prompt_len"] + spec["tokens"] + 8, layer_floor=spec["layer_floor"])
    except ContenderSkipped as exc:
        return result | {"skipped": str(exc)}
    try:
        notes += built.notes
        vocab = built.model.config.vocab_size
        counter = ReadCounter(block_device_stat(model.bundle_dir), list(built.reader_pids))
        counter.start()
        warm_up(built.model, device, vocab, built.decoder, sample_seed=spec.get("sample_seed"))
        result["warm_up_reads"] = counter.stop()
        ready = built.before_timing()
        if ready:
            notes.append(ready)
        # the warm-up's page faults read ahead far beyond the experts it used (a whole 4 GB GGUF at
        # 100%, second GPU session): dropped, so only a contender's own cache (storaged's VRAM slots of
        # the warm-up's 4 tokens, reported in warm_up_reads) starts the timed run warm
        result["page_cache_dropped_after_warm_up"] = drop_page_cache()
        if cgroup is not None:
            tighten_ram_limit(cgroup, budget, built.host_cache_bytes, result)
        counter.start()  # prefill reads are counted separately from decode's
        before = built.pack_reads()
        marks = {}


        def on_decode_start() -> None:
            marks["prefill"] = counter.stop()
            marks["reads"] = built.pack_reads()
            counter.start()

        with build_paused() as paused:  # llama.cpp's background build, if any, waits for the timed part
            building = build_in_progress() and not paused
            run = timed_generation(built.model, device, vocab_size=vocab, prompt_len=spec["prompt_len"],
                                   tokens=spec["tokens"], deadline=deadline, on_decode_start=on_decode_start,
                                   sample_seed=spec.get("sample_seed"), min_seconds=share / 2, decoder=built.decoder)
            synchronize(device)
            decode_reads, after = counter.stop(), built.pack_reads()
            building = building or (build_in_progress() and not paused)
        if paused:
            result["build_paused"] = True
            notes.append("llama.cpp's background build paused while timed")
        if "static_steps_redone" in run:
            result["static_steps_redone"] = run["static_steps_redone"]
    finally:
        built.close()
    decoded = run["decoded"]
    measured = decode_reads["process_read_bytes"]
    source = "process"
    if measured is None:
        measured, source = decode_reads["device_read_bytes"], "device"
    result.update(prefill_tok_s=spec["prompt_len"] / run["prefill_seconds"],
                  decode_tok_s=decoded / run["decode_seconds"], tokens=decoded, prompt_len=spec["prompt_len"],
                  ssd_bytes_per_token=None if measured is None else measured / decoded,
                  ssd_bytes_source=None if measured is None else source,
                  decode_reads=decode_reads, prefill_reads=marks.get("prefill"), token_ids=run["token_ids"],
                  from_memory=None)
    if measured is None:
        notes.append("SSD bytes not measurable here: neither /proc/<pid>/io nor the block device stats")
    if decoded < spec["tokens"]:
        notes.append(f"stopped after {decoded} of {spec['tokens']} tokens by its time budget")
    if after is not None and marks.get("reads") is not None:
        # every routed (layer, expert) of a decoded token is a distinct expert of its layer's top-k
        routed = decoded * model.moe_layers * model.shape.top_k
        reads = after - marks["reads"]
        result.update(from_memory=max(0.0, 1 - reads / max(1, routed)), decode_pack_reads=reads, decode_routed=routed)
    elif before is None:
        notes.append("experts from memory: n/a (no pack read counter for this contender)")
    if building:
        # compilers at nice 19 still take cores, caches and memory bandwidth from the daemon's reads
        # and the client's launches: the disk-bound budgets lost 10-30% this way
        result["timed_during_build"] = True
        notes.append("timed while bench/llamacpp/build.sh compiled in the background")
    if cgroup is not None:
        result["ram_peak_bytes"] = cgroup.peak_bytes()
    return result


def child_main(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    model = PreparedModel.from_dict(spec["model"])
    out, results = Path(spec["result_path"]), []
    cgroup = None
    if spec.get("cgroup"):
        cgroup = MemoryCgroup.__new__(MemoryCgroup)  # made by the parent; the child only adjusts it
        cgroup.path, cgroup.limit_bytes = Path(spec["cgroup"]), 0
    if spec["device"] == "cpu" and spec.get("torch_threads"):
        import torch
        torch.set_num_threads(spec["torch_threads"])
    run_one_budget = _run_one_budget
    if spec["contender"] == "llamacpp":  # llama-bench, a subprocess of this child: no torch model here
        from bench.e2e.llamacpp_run import run_llamacpp_budget as run_one_budget
    started = time.perf_counter()
    for n, fraction in enumerate(spec["budgets"]):
        share = (spec["seconds"] - (time.perf_counter() - started)) / (len(spec["budgets"]) - n)
        try:
            result = run_one_budget(spec["contender"], model, fraction, spec, cgroup, time.perf_counter() + share,
                                    share)
        except Exception as exc:  # noqa: BLE001 - one failed budget is reported, the next still runs
            traceback.print_exc()
            result = {"contender": spec["contender"], "shape": model.shape.name, "budget_fraction": fraction,
                      "error": f"{type(exc).__name__}: {exc}"}
        results.append(result)
        out.write_text(json.dumps(results, indent=1))
    return 0


def run_contender_budgets(name: str, model: PreparedModel, budgets: list[float], *, tokens: int, prompt_len: int,
                          seconds: float, device: str, dtype: str, workdir: Path, ram_overhead_bytes: int,
                          torch_threads: int | None = None, sample_seed: int | None = None,
                          layer_floor: bool = False) -> list[dict]:
    """`name` at every budget (fractions of the experts) in one child process; `seconds` is shared by
    the budgets (decoding stops early to stay inside it). Missing budgets come back as errors."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"{name}-{model.shape.arch}-{os.getpid()}-{time.monotonic_ns()}"
    spec_path, result_path, log_path = (workdir / f"{tag}.{s}" for s in ("spec.json", "result.json", "log"))
    cgroup, cgroup_note = None, None
    try:
        cgroup = MemoryCgroup(f"expertpack-e2e-{tag}", ram_overhead_bytes + budget_bytes_max(model, budgets))
    except (CgroupUnavailable, OSError) as exc:
        cgroup_note = f"host RAM NOT limited: {exc}"
    spec = {"contender": name, "model": model.as_dict(), "budgets": budgets, "tokens": tokens,
            "prompt_len": prompt_len, "seconds": seconds, "device": device, "dtype": dtype, "workdir": str(workdir),
            "ram_overhead_bytes": ram_overhead_bytes, "result_path": str(result_path), "torch_threads": torch_threads,
            "cgroup": str(cgroup.path) if cgroup else None, "sample_seed": sample_seed, "layer_floor": layer_floor}
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # the child enters the cgroup before it imports anything, so all of its memory is counted
    enter = (f"open('{cgroup.path}/cgroup.procs','w').write(str(__import__('os').getpid()));" if cgroup else "")
    command = [sys.executable, "-c", f"{enter}import sys; from bench.e2e.runner import child_main; "
               f"sys.exit(child_main(__import__('pathlib').Path({str(spec_path)!r})))"]
    status = None
    with open(log_path, "w") as log:
        try:
            status = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=seconds + KILL_GRACE_SECONDS).returncode
        except subprocess.TimeoutExpired:
            status = "timed out"
        except Exception as exc:  # noqa: BLE001 - e.g. main's SIGTERM: subprocess.run killed the child; keep its budgets
            status = f"interrupted: {exc}"
    if cgroup is not None:
        cgroup.close()
    results = json.loads(result_path.read_text()) if result_path.exists() else []
    done = {r["budget_fraction"] for r in results}
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
    for fraction in budgets:
        if fraction not in done:
            results.append({"contender": name, "shape": model.shape.name, "budget_fraction": fraction,
                            "error": f"child ended ({status}) before this budget; log {log_path}:\n{tail}"})
    for result in results:
        result.setdefault("notes", [])
        if cgroup_note:
            result["notes"].append(cgroup_note)
    return sorted(results, key=lambda r: r["budget_fraction"])


def budget_bytes_max(model: PreparedModel, budgets: list[float]) -> int:
    from bench.e2e.contenders import budget_bytes
    return budget_bytes(model, max(budgets))


def run_contender(name: str, model: PreparedModel, budget: float, tokens: int, prompt_len: int, **options) -> dict:
    """One contender at one VRAM budget (a fraction of the experts): prefill_tok_s, decode_tok_s, tokens,
    ssd_bytes_per_token, hit_rate, notes (plus skipped or error where it did not run)."""
    return run_contender_budgets(name, model, [budget], tokens=tokens, prompt_len=prompt_len, **options)[0]


if __name__ == "__main__":
    sys.exit(child_main(Path(sys.argv[1])))
