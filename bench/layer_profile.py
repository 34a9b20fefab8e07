"""Where a decode step's time goes, per MoE layer, for storaged's paths and the resident model, in one run.

    python bench/layer_profile.py --shape qwen3 --layers 12 --device cuda --out /tmp/profile.json
    python bench/layer_profile.py --shape qwen3 --tiny --device cpu --modes storaged-eager   # smoke test
    python bench/layer_profile.py --budget 0.5 --decode sample --modes storaged-graph-compiled storaged-eager

Modes (each on the same synthesized model; by default every expert resident: the all-hit regime;
with --budget F < 1 storaged's VRAM cache holds F of the experts' bytes and its host tier as much
again, experts are not pre-loaded and steps that meet an absent one run on the acquire path):
  resident          every expert dequantized into transformers' own experts (grouped_mm)
  storaged-graph    storaged arena, decode steps as CUDA graphs reading the slot map (StaticDecoder),
                    eager decoder layers in the graph
  storaged-graph-compiled  the same, the captured step's decoder layers compiled by inductor (the default
                    of `inference` on CUDA)
  storaged-graph-cpu  storaged-graph-compiled with CPU threads computing a share of each step's host-tier
                    experts (--cpu-experts-threads, --cpu-experts-share; inference.experts.cpu_experts)
  storaged-graph-copy  storaged-graph-cpu with the GPU's share of the host-tier experts copied to VRAM by
                    the copy engine (inference.kernels.copy_agent) instead of read in place
  storaged-eager    storaged arena, one data-plane acquire per MoE layer, fused kernels, no graph
  llamacpp          llama-bench -ngl 99 on the same GGUF (its own timing: per token only)

For each mode: decode and prefill tokens/s, milliseconds per token, and, from torch.profiler over
`--profile-steps` decode steps, device time per MoE layer by kind (experts GEMV, combine,
dequantize, grouped GEMM, dense GEMM, attention, copies, other kernels), the share of the step the
device is busy, the milliseconds of a timed step beyond its device work (`idle ms`: host work
between replays, syncs and launches; the profiled steps pick tokens as the timed ones do), and the
host time spent acquiring experts. Prints a table last; --out keeps JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.e2e.generation import (  # noqa: E402
    prompt_ids, synchronize, timed_generation, token_picker, token_sampler, warm_up)
from bench.e2e.prepare import prepare_model  # noqa: E402
from bench.e2e.shapes import FULL_SHAPES, TINY_SHAPES  # noqa: E402
from storaged.stats_snapshot import ACQUIRE_PHASES  # noqa: E402

MODES = ("resident", "storaged-graph", "storaged-graph-compiled", "storaged-graph-cpu", "storaged-graph-copy",
         "storaged-eager", "llamacpp")
CPU_EXPERTS_MODES = ("storaged-graph-cpu", "storaged-graph-copy")
GRAPH_MODES = ("storaged-graph", "storaged-graph-compiled", *CPU_EXPERTS_MODES)  # the static decoder's
SDPA_BACKENDS = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION"}  # --sdpa-backend -> torch.nn.attention.SDPBackend
# kernel name -> kind; the first pattern that matches wins
KINDS = (
    ("experts GEMV", r"moe_gemv"),
    ("experts GEMM", r"moe_gemm"),
    ("combine", r"moe_combine"),
    ("dequantize", r"(q\d_k|q\d_\d|q8_0|mxfp4|ue8m0|f4_e2m1)_kernel|dequant"),
    ("grouped GEMM", r"grouped|GroupMM|group_gemm"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("dense GEMM", r"gemm|gemv|cublas|cutlass|sm90_xmma|nvjet|dot_kernel"),
    ("copies", r"^Memcpy|^Memset|copy_|CatArrayBatched"),
    ("other kernels", r"."),
)


def classify(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other kernels"


def _build(mode: str, model, device: torch.device, dtype: torch.dtype, workdir: Path, static_len: int,
           budget: float = 1.0, lookahead: int = 0, host_budget: float | None = None,
           lookahead_min_precision: float | None = None, host_reads: bool = True, cpu_experts=None,
           dense_kernels: bool = True):
    """(torch model, decoder or None, source or None, closers, daemon or None)."""
    if mode == "resident":
        from bench.e2e.resident import load_resident

        loaded, _ = load_resident(model.bundle_dir, device=device, dtype=dtype)
        return loaded.model, None, None, [loaded.close], None
    from bench.e2e.contenders import STORAGED_MODEL, budget_bytes
    from bench.storaged_runs import StoragedProcess
    from inference.engine.decode_graph import StaticDecoder, why_not
    from inference.engine.generate import _cache_keyword
    from inference.experts.storaged_source import StoragedExpertSource
    from inference.model import load_model

    # at least one layer's experts: a prefill pins a layer's demand at once
    vram = max(budget_bytes(model, budget), budget_bytes(model, 1.0) // max(1, model.moe_layers))
    daemon = StoragedProcess(model.bundle_dir, model=STORAGED_MODEL, device="cpu" if device.type == "cpu" else
                             f"cuda:{device.index or 0}", vram_bytes=vram, io_parallelism=16,
                             host_bytes=budget_bytes(model, budget if host_budget is None else host_budget)
                             if budget < 1 and device.type == "cuda" else 0,
                             staging_buffers=16, log_path=workdir / f"profile-{mode}.log")
    socket = str(daemon.socket_dir / "s.sock")
    governed = {} if lookahead_min_precision is None else {"lookahead_min_precision": lookahead_min_precision}
    loaded = load_model(model.bundle_dir, device=device, dtype=dtype, lookahead=lookahead, **governed,
                        dense_kernels=dense_kernels,
                        expert_source=lambda bundle, dev: StoragedExpertSource(socket, STORAGED_MODEL, bundle, dev,
                                                                               host_reads=host_reads))
    decoder = None
    closers = [loaded.expert_source.close, loaded.close, daemon.stop]
    if mode in GRAPH_MODES:
        decoder = StaticDecoder.create(loaded.model, loaded.expert_source, max_len=static_len,
                                       cache_keyword=_cache_keyword(loaded.model),
                                       compile_layers=mode != "storaged-graph",  # not the default
                                       cpu_experts=cpu_experts if mode in CPU_EXPERTS_MODES else None)
        if decoder is None:
            raise RuntimeError(f"no static decoder: {why_not(loaded.model, loaded.expert_source, device)}")
        closers.insert(0, decoder.close)
    return loaded.model, decoder, loaded.expert_source, closers, daemon


def _profile_steps(model, decoder, device: torch.device, vocab: int, steps: int, sample_seed: int | None = None,
                   decode_ahead: bool = True) -> dict:
    """Device time by kind over `steps` decode steps after a short prompt, and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ids = prompt_ids(vocab, 8)[0].tolist()
    ahead = None
    with torch.inference_mode():
        if decoder is not None:  # as the timed decode runs: one token ahead, picked on the device
            from inference.engine.decode_ahead import DecodeAhead

            ahead = DecodeAhead(decoder, token_sampler(device, sample_seed, ids))
            ahead.first(ids, more=decode_ahead)

            def run(count: int) -> None:
                for _ in range(count):
                    ahead.next(more=decode_ahead)
        else:
            from bench.e2e.generation import _cache_keyword, _cache_of

            keyword = _cache_keyword(model)
            out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
            state = {"cache": _cache_of(out)}

            def step(token: int) -> torch.Tensor:
                result = model(input_ids=torch.tensor([[token]], device=device), use_cache=True,
                               **{keyword: state["cache"]})
                state["cache"] = _cache_of(result)
                return result.logits[0, -1]

            # as the timed decode picks (on the device): the profiled steps are the steps timed
            pick = token_picker(device, sample_seed)
            state["logits"] = out.logits[0, -1]

            def run(count: int) -> None:
                for _ in range(count):
                    state["logits"] = step(pick(state["logits"]))
        synchronize(device)

        with profile(activities=activities) as prof:
            started = time.perf_counter()
            run(steps)
            synchronize(device)
            wall = time.perf_counter() - started
        import cProfile
        import io
        import pstats

        host = cProfile.Profile()  # where the host's time goes in as many steps again (Python functions)
        host.enable()
        run(steps)
        synchronize(device)
        host.disable()
        if ahead is not None:
            ahead.close()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
    kinds: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        if device.type == "cuda" and device_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            kind = classify(event.key)
            kinds[kind] = kinds.get(kind, 0.0) + device_us
            kernels.append((event.key[:90], device_us / steps, event.count / steps))
    kernels.sort(key=lambda k: -k[1])
    return {"wall_s": wall, "device_us_by_kind": kinds, "kernels_per_step": sum(k[2] for k in kernels),
            "top_kernels_us_per_step": [[name, round(us, 1), round(count, 1)] for name, us, count in kernels[:25]],
            "host_profile": text.getvalue()[-8000:]}


def _profile_prefill(model, decoder, device: torch.device, vocab: int, prompt_len: int) -> dict:
    """Device time by kind of one prefill of `prompt_len` tokens (after the timed runs warmed it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ids = prompt_ids(vocab, prompt_len)[0].tolist()
    with torch.inference_mode():
        synchronize(device)
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            if decoder is not None:
                decoder.start(ids)
            else:
                model(input_ids=torch.tensor([ids], device=device), use_cache=True)
            synchronize(device)
            wall = time.perf_counter() - started
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()  # where the host's time goes in a second prefill (Python functions)
    with torch.inference_mode():
        host.enable()
        if decoder is not None:
            decoder.start(ids)
        else:
            model(input_ids=torch.tensor([ids], device=device), use_cache=True)
        synchronize(device)
        host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
    kinds: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        if device.type == "cuda" and device_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            kinds[classify(event.key)] = kinds.get(classify(event.key), 0.0) + device_us
            kernels.append((event.key[:90], device_us, event.count))
    kernels.sort(key=lambda k: -k[1])
    return {"wall_ms": 1e3 * wall, "device_us_by_kind": kinds, "kernels": sum(k[2] for k in kernels),
            "top_kernels_us": [[name, round(us, 1), count] for name, us, count in kernels[:12]],
            "host_profile": text.getvalue()[-6000:]}


def _prewarm(source, bundle_dir) -> None:
    """Acquire every expert of every layer once: the all-hit regime starts with all of them resident
    (below 100%, the tiers together hold what they can: the warm partial-hit regime)."""
    from packformat.bundle import open_bundle

    with open_bundle(bundle_dir) as bundle:
        layers, experts = list(bundle.pack.layers), bundle.pack.header.expert_count
    for layer in layers:
        source.acquire_rows(layer, list(range(experts)))


def _llamacpp(gguf: Path, binary: Path | None, prompt_len: int, tokens: int) -> dict:
    if binary is None or not binary.exists():
        return {"skipped": f"no llama-bench binary ({binary})"}
    command = [str(binary), "-m", str(gguf), "-ngl", "99", "-p", str(prompt_len), "-n", str(tokens), "-r", "3",
               "-o", "jsonl", "-fa", "1"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        return {"error": run.stderr[-2000:], "command": command}
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    out = {"command": command}
    for record in records:
        key = "decode" if record.get("n_gen") else "prefill"
        out[f"{key}_tok_s"] = record.get("avg_ts")
        out[f"{key}_ns_per_token"] = record.get("avg_ns", 0) / max(1, record.get("n_gen") or record.get("n_prompt"))
    return out


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (TINY_SHAPES if args.tiny else FULL_SHAPES)[args.shape]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tuned = None
    if args.gemv_sweep and device.type == "cuda":
        from bench.gemv_sweep import gemm_report, gemm_sweep
        from bench.gemv_sweep import report as sweep_report
        from bench.gemv_sweep import sweep

        tuned = sweep(shape.expert_type)  # installs the fastest launch shape for this run
        print(sweep_report(tuned), flush=True)
        tuned["gemm"] = gemm_sweep(shape.expert_type, tokens=args.prompt_len)  # and the prefill GEMM's
        print(gemm_report(tuned["gemm"]), flush=True)
    model = prepare_model(shape, args.layers, workdir, with_bf16_checkpoint=False, balanced_routing=True)
    results = {"shape": shape.name, "layers": args.layers, "budget": args.budget, "prompt_len": args.prompt_len,
               "moe_layers": model.moe_layers, "gemv_sweep": tuned,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "modes": {}}
    results["sdpa_backend"] = args.sdpa_backend
    results["dense_kernels"] = not args.no_dense_kernels
    for mode in args.modes:
        try:
            with _sdpa_backend(args.sdpa_backend):  # graphs captured under it keep its kernels
                results["modes"][mode] = _run_mode(mode, args, model, device, dtype, workdir)
        except Exception as exc:  # one mode's failure must not lose the others' figures
            traceback.print_exc()
            results["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}"[:4000]}
        print(report({**results, "modes": {mode: results["modes"][mode]}}).splitlines()[2], flush=True)
        if args.out is not None:  # kept after every mode: a later one may exhaust the time limit
            args.out.write_text(json.dumps(results, indent=1))
    return results


def _sdpa_backend(name: str | None):
    """Only that family of torch's attention kernels (warm-up and capture included), or torch's choice."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name]))


def _run_mode(mode: str, args, model, device: torch.device, dtype: torch.dtype, workdir: Path) -> dict:
    if mode == "llamacpp":
        return _llamacpp(model.gguf_path, Path(args.llamacpp_bin) if args.llamacpp_bin else None,
                         args.prompt_len, args.tokens)
    lookahead = args.lookahead if args.lookahead is not None else (2 * model.shape.top_k if args.budget < 1 else 0)
    from inference.experts.cpu_experts import CpuExpertsConfig

    cpu_experts = CpuExpertsConfig(args.cpu_experts_threads, args.cpu_experts_share,
                                   copy_engine=mode == "storaged-graph-copy")
    built, decoder, source, closers, daemon = _build(mode, model, device, dtype, workdir,
                                                     args.prompt_len + args.tokens + 16 + 2 * args.profile_steps,
                                                     args.budget, lookahead, args.host_budget,
                                                     args.lookahead_min_precision, not args.no_host_reads,
                                                     cpu_experts, not args.no_dense_kernels)
    policy = _hint_policy(built)
    sample_seed = 1234 if args.decode == "sample" else None
    try:
        vocab = built.config.vocab_size
        if source is not None:  # below 100%: VRAM ends with the last experts acquired, the host tier the rest
            _prewarm(source, model.bundle_dir)
        started = time.perf_counter()
        warm_up(built, device, vocab, decoder, prompt_len=args.prompt_len, sample_seed=sample_seed)
        warm_up_s = time.perf_counter() - started
        wait_before = source.expert_wait_seconds() if source is not None else 0.0
        before = daemon.client.stats() if daemon is not None else None
        hints_before = policy.stats() if policy is not None else None
        timing = timed_generation(built, device, vocab_size=vocab, prompt_len=args.prompt_len,
                                  tokens=args.tokens, deadline=time.perf_counter() + 600, decoder=decoder,
                                  sample_seed=sample_seed, decode_ahead=not args.wait_each_step)
        waited = (source.expert_wait_seconds() - wait_before) if source is not None else 0.0
        hints = {} if policy is None else _hint_traffic(hints_before, policy.stats(), timing["decoded"])
        traffic = {}
        if daemon is not None:  # the timed request's lookups and bytes moved, prefill included
            after = daemon.client.stats()
            vram, vram_before = after.tiers["vram"], before.tiers["vram"]
            looked = (vram.hits - vram_before.hits) + (vram.misses - vram_before.misses)
            traffic = {"vram_hit_rate": (vram.hits - vram_before.hits) / looked if looked else None,
                       **{f"{name}_per_token": (getattr(after, name) - getattr(before, name)) / timing["decoded"]
                          for name in ("bytes_read", "h2d_bytes", "d2h_bytes", "prefetch_issued", "prefetch_used",
                                       "prefetch_wasted", "fence_waits", "reads")}}
            reads = after["read_seconds"].count - before["read_seconds"].count
            traffic["read_ms_mean"] = 1e3 * (after["read_seconds"].sum - before["read_seconds"].sum) / max(1, reads)
            acquires = after["acquire_seconds"].count - before["acquire_seconds"].count
            traffic["storaged_acquire_us_mean"] = 1e6 * (after["acquire_seconds"].sum - before["acquire_seconds"].sum
                                                         ) / max(1, acquires)
            phases_after, phases_before = after["acquire_phase_seconds_total"], before["acquire_phase_seconds_total"]
            traffic["storaged_acquire_phase_us_mean"] = {
                phase: 1e6 * (phases_after.get(phase, 0.0) - phases_before.get(phase, 0.0)) / max(1, acquires)
                for phase in ACQUIRE_PHASES}
            traffic["fence_wait_ms_per_token"] = 1e3 * (after["fence_wait_seconds_total"]
                                                        - before["fence_wait_seconds_total"]) / timing["decoded"]
        shared = decoder.cpu_experts if decoder is not None else None
        pool = shared.pool if shared is not None else None
        share_timed = shared.share_now if shared is not None else None  # where the timed decode ended
        pool_before = pool.stats() if pool is not None else None
        agent = shared.agent if shared is not None else None
        agent_before = agent.stats() if agent is not None else None
        profiled = _profile_steps(built, decoder, device, vocab, args.profile_steps, sample_seed,
                                  decode_ahead=not args.wait_each_step)
        if pool is not None:  # the CPU's time per job (two a layer) over the profiled steps
            pool_after = pool.stats()
            jobs = pool_after.jobs - pool_before.jobs
            profiled["cpu_experts"] = {
                "threads": pool.threads, "kernel": pool.kernel, "share": share_timed,
                "share_tuned": cpu_experts.share is None, "share_moves": shared.share_moves, "jobs": jobs,
                "failed_jobs": pool_after.failed_jobs - pool_before.failed_jobs,
                "us_per_job": 1e6 * (pool_after.busy_seconds - pool_before.busy_seconds) / max(1, jobs)}
        if agent is not None:  # the copy agent's jobs (one a layer with copies) over the profiled steps
            agent_after = agent.stats()
            profiled["copy_agent"] = {
                "jobs": agent_after.jobs - agent_before.jobs, "copies": agent_after.copies - agent_before.copies,
                "refused": agent_after.refused - agent_before.refused, "cuda_error": agent_after.cuda_error}
        prefill_profile = _profile_prefill(built, decoder, device, vocab, args.prompt_len)
    finally:
        for close in closers:
            close()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record = {"decode_tok_s": timing["decoded"] / timing["decode_seconds"],
              "prefill_tok_s": args.prompt_len / timing["prefill_seconds"],
              "ms_per_token": 1e3 * timing["decode_seconds"] / timing["decoded"],
              "acquire_ms_per_token": 1e3 * waited / max(1, timing["decoded"] + 1),
              "warm_up_s": warm_up_s,  # graph captures (and compilation) included
              "budget": args.budget, "host_budget": args.host_budget, "lookahead": lookahead,
              "host_reads": not args.no_host_reads,
              "lookahead_min_precision": policy.min_precision if policy is not None else None, "decode": args.decode,
              "decode_ahead": decoder is not None and not args.wait_each_step,
              **traffic, **hints,
              **profiled, "prefill_profile": prefill_profile}
    if decoder is not None:
        record.update(steps_redone=decoder.redone_steps, steps_abandoned=decoder.abandoned_steps,
                      steps_piecewise=decoder.piecewise_steps,
                      steps_through_slot_map=decoder.lookup_steps, prefills_through_slot_map=decoder.lookup_prefills,
                      prefills_redone=decoder.redone_prefills)
    busy = sum(profiled["device_us_by_kind"].values()) / 1e6
    record["device_busy_share"] = busy / profiled["wall_s"] if profiled["wall_s"] else None
    # what a timed step spends beyond its device work: host work between replays, syncs, launches
    timed = bool(profiled["device_us_by_kind"])  # device kernels are timed on CUDA only
    record["device_ms_per_step"] = 1e3 * busy / args.profile_steps if timed else None
    record["device_idle_ms_per_token"] = record["ms_per_token"] - record["device_ms_per_step"] if timed else None
    record["per_layer_us"] = {k: v / args.profile_steps / model.moe_layers
                              for k, v in profiled["device_us_by_kind"].items()}
    return record


def _hint_policy(model):
    """The lookahead's HintPolicy (inference.experts.hint_policy) of a storaged-backed model, or None."""
    from inference.experts import experts_modules
    from inference.experts.forward import BINDING_ATTRIBUTE

    for _, module in experts_modules(model).values():
        binding = getattr(module, BINDING_ATTRIBUTE, None)  # none on the resident model
        if binding is not None and binding.predict is not None:
            return binding.predict.policy
    return None


def _hint_traffic(before, after, decoded: int) -> dict:
    """The timed request's lookahead hints (prefill included) per decoded token, and each width
    bucket's precision at its end."""
    return {"hints_sent_per_token": (after.hints_sent - before.hints_sent) / decoded,
            "hinted_experts_per_token": (after.hinted_experts - before.hinted_experts) / decoded,
            "hints_withheld_per_token": (after.withheld - before.withheld) / decoded,
            "hint_precision": {bucket: b.precision for bucket, b in after.buckets.items()}}


def report(results: dict) -> str:
    lines = [f"{results['shape']}, {results['layers']} layers ({results['moe_layers']} MoE), {results['device']}, "
             f"budget {results.get('budget', 1.0):g}",
             f"{'mode':16s} {'decode tok/s':>12s} {'prefill tok/s':>13s} {'ms/token':>9s} {'idle ms':>7s} {'busy':>5s}  "
             "per MoE layer (us)"]
    for mode, r in results["modes"].items():
        if "decode_tok_s" not in r:
            lines.append(f"{mode:16s} {r.get('skipped') or r.get('error', '')[:100]}")
            continue
        busy = f"{100 * r['device_busy_share']:.0f}%" if r.get("device_busy_share") is not None else "-"
        layer = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r.get("per_layer_us", {}).items(), key=lambda kv: -kv[1]))
        ms = r.get("ms_per_token", 1e3 / r["decode_tok_s"] if r.get("decode_tok_s") else 0)
        prefill = r.get("prefill_tok_s") or 0
        idle = r.get("device_idle_ms_per_token")
        idle = f"{idle:.3f}" if idle is not None else "-"
        lines.append(f"{mode:16s} {r['decode_tok_s']:12.1f} {prefill:13.1f} {ms:9.3f} {idle:>7s} {busy:>5s}  {layer}")
    peer = results["modes"].get("llamacpp", {})
    for mode, r in results["modes"].items():
        if mode != "llamacpp" and peer.get("decode_tok_s") and r.get("decode_tok_s"):
            lines.append(f"{mode} / llama.cpp: decode {r['decode_tok_s'] / peer['decode_tok_s']:.3f}x, "
                         f"prefill {r['prefill_tok_s'] / peer['prefill_tok_s']:.3f}x")
    for mode, r in results["modes"].items():
        pre = r.get("prefill_profile")
        if pre:
            busy = sum(pre["device_us_by_kind"].values()) / 1e3
            lines.append(f"{mode} prefill of {results.get('prompt_len', '?')} tokens: {pre['wall_ms']:.2f} ms wall, "
                         f"device {busy:.2f} ms, {pre['kernels']} kernels: " + ", ".join(
                             f"{k} {v / 1e3:.2f}" for k, v in sorted(pre["device_us_by_kind"].items(),
                                                                     key=lambda kv: -kv[1])) + " (ms)")
    for mode, r in results["modes"].items():
        if "decode_tok_s" in r and r.get("vram_hit_rate") is not None:
            hit = r["vram_hit_rate"]
            lines.append(f"{mode}: VRAM hit rate {hit:.3f}, per token: acquire "
                         f"{r['acquire_ms_per_token']:.2f} ms, "
                         f"SSD {r['bytes_read_per_token'] / 1e6:.1f} MB, H2D {r['h2d_bytes_per_token'] / 1e6:.1f} MB, "
                         f"D2H {r['d2h_bytes_per_token'] / 1e6:.1f} MB, prefetches {r['prefetch_issued_per_token']:.1f} "
                         f"(used {r['prefetch_used_per_token']:.1f}, wasted {r['prefetch_wasted_per_token']:.1f}), "
                         f"storaged's Acquire {r['storaged_acquire_us_mean']:.0f} us mean ("
                         + ", ".join(f"{k} {v:.0f}" for k, v in r['storaged_acquire_phase_us_mean'].items())
                         + f"), {r['reads_per_token']:.1f} "
                         f"reads of {r['read_ms_mean']:.2f} ms mean, fence waits "
                         f"{r['fence_wait_ms_per_token']:.2f} ms; decode steps "
                         f"through the slot map {r.get('steps_through_slot_map', '-')}, piecewise "
                         f"{r.get('steps_piecewise', '-')}, redone {r.get('steps_redone', '-')}, launched ahead "
                         f"and undone {r.get('steps_abandoned', '-')}")
    for mode, r in results["modes"].items():
        if r.get("top_kernels_us_per_step"):
            lines.append(f"{mode}: {r['kernels_per_step']:.0f} kernels per step; top: " + "; ".join(
                f"{name} {us}us x{count}" for name, us, count in r["top_kernels_us_per_step"][:8]))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(FULL_SHAPES), default="qwen3")
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke-test size of the shape")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None,
                        help="default: every mode the budget allows (at 1.0 all but the CPU experts' modes, which "
                             "need a host tier; below it storaged's modes)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--workdir", default=tempfile.gettempdir() + "/expertpack-profile")
    parser.add_argument("--llamacpp-bin", default=None)
    parser.add_argument("--budget", type=float, default=1.0,
                        help="storaged's VRAM cache as a fraction of the experts' bytes, and its host tier as much "
                             "again when < 1 (then experts are not pre-loaded: the partial-hit regime)")
    parser.add_argument("--host-budget", type=float, default=None,
                        help="storaged's host tier as a fraction of the experts' bytes (default: --budget)")
    parser.add_argument("--lookahead", type=int, default=None,
                        help="experts per token predicted for the next layer (default: 2 x top-k when --budget < 1)")
    parser.add_argument("--lookahead-min-precision", type=float, default=None, metavar="F",
                        help="the lookahead's precision governor: a step width's hints go out only while at least "
                             "this share of the hinted experts is used (default: inference's, 0.5; 0: always send)")
    parser.add_argument("--decode", choices=("greedy", "sample"), default="greedy",
                        help="sample: temperature 1, seed 1234 (random weights' greedy decoding revisits few experts)")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="time the experts GEMV's launch shapes first and use the fastest (bench/gemv_sweep.py)")
    parser.add_argument("--no-host-reads", action="store_true",
                        help="copy host-tier experts up to VRAM (an Acquire) instead of reading them in place")
    parser.add_argument("--cpu-experts-threads", type=int, default=12, metavar="N",
                        help="storaged-graph-cpu: CPU threads computing host-tier experts (default 12)")
    parser.add_argument("--cpu-experts-share", type=float, default=None, metavar="F",
                        help="storaged-graph-cpu: share of each layer's host-tier experts they take, fixed "
                             "(default: tuned while decoding, from 0.35)")
    parser.add_argument("--wait-each-step", action="store_true",
                        help="static decoder modes: wait for each step before picking its token (no step "
                             "launched ahead, inference.engine.decode_ahead): the baseline of decoding ahead")
    parser.add_argument("--sdpa-backend", choices=list(SDPA_BACKENDS), default=None,
                        help="the one family of kernels torch's scaled_dot_product_attention may use in the torch "
                             "modes, captured graphs included (default: torch's choice); a mode it cannot serve "
                             "reports the error")
    parser.add_argument("--no-dense-kernels", action="store_true",
                        help="storaged modes: one-row projections, router selection and one-query attention on "
                             "cuBLAS, torch and SDPA rather than inference's dense kernels (the baseline of those)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.no_dense_kernels and not {m for m in args.modes if m.startswith("storaged")}:
        parser.error("--no-dense-kernels is for storaged's modes: resident and llama.cpp keep kernels of their own")
    if args.modes is None:
        unfit = CPU_EXPERTS_MODES if args.budget >= 1 else ("resident", "llamacpp")
        args.modes = [mode for mode in MODES if mode not in unfit]
    if args.budget >= 1 and set(CPU_EXPERTS_MODES) & set(args.modes):
        parser.error(f"{', '.join(CPU_EXPERTS_MODES)} compute host-tier experts: they need --budget < 1 (the host "
                     "tier holds --host-budget, default the budget)")
    if args.wait_each_step and not set(GRAPH_MODES) & set(args.modes):
        parser.error(f"--wait-each-step is for the static decoder's modes ({', '.join(GRAPH_MODES)})")
    if args.sdpa_backend is not None and set(args.modes) == {"llamacpp"}:
        parser.error("--sdpa-backend is for the torch modes; llama.cpp has kernels of its own")
    if not 0 < args.budget <= 1:
        parser.error(f"--budget must be in (0, 1], got {args.budget}")
    if args.host_budget is not None and not (args.budget < 1 and 0 <= args.host_budget <= 1):
        parser.error(f"--host-budget {args.host_budget}: must be in [0, 1], with --budget < 1")
    if args.lookahead_min_precision is not None:
        if not 0 <= args.lookahead_min_precision <= 1:
            parser.error(f"--lookahead-min-precision {args.lookahead_min_precision}: must be in [0, 1]")
        if args.lookahead == 0 or (args.lookahead is None and args.budget == 1):
            parser.error("--lookahead-min-precision needs lookahead on (--lookahead N, or --budget < 1)")
    if args.budget < 1 and {"resident", "llamacpp"} & set(args.modes):
        parser.error("--budget < 1 is for storaged's modes: resident and llamacpp hold every expert (llama.cpp at a "
                     "budget, with host RAM limited, is bench/e2e's matrix)")
    return args


def main(argv=None) -> int:
    results = run(parse_args(argv))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
