"""StaticDecoder: decode steps that find experts through storaged's slot map, against a real daemon.

On the CPU the step runs uncaptured (the fused kernels under triton's interpreter) with exactly
the logic the CUDA graph replays: the slot-map lookup, the miss count, the undo of a step that
met an absent expert and its rerun on the acquire path, the step fence. The captured variant is
tested on the GPU (marked gpu).
"""

from __future__ import annotations

import pytest
import torch
from test_storaged_source_fixtures import StoragedDaemon, cases_dir, qwen_case  # noqa: F401 (fixtures)

from inference.engine.decode_graph import StaticDecoder, why_not
from inference.engine.generate import ModelRunner
from inference.engine.metrics import EngineMetrics
from inference.engine.params import SamplingParams
from inference.experts import LocalPackSource
from inference.experts.storaged_source import StoragedExpertSource
from inference.model import load_model

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DAEMON_DEVICE = "cuda:0" if DEVICE == "cuda" else "cpu"  # the arena on the model's device: the map is readable
PROMPT = [3, 17, 42, 99, 7, 250, 11]
TOKENS = 8
pytestmark = pytest.mark.usefixtures("one_thread")


def _load(bundle, source_factory):
    return load_model(bundle, device=DEVICE, dtype=torch.bfloat16, expert_source=source_factory,
                      experts_compute="fused")


def _greedy(runner: ModelRunner) -> list[int]:
    finished = runner.run(PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0.0), emit=lambda _: None)
    return list(finished.token_ids)


@pytest.fixture(scope="module")
def eager_tokens(qwen_case):
    with _load(qwen_case.bundle, LocalPackSource) as loaded:
        return _greedy(ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None))


@pytest.mark.slow
@pytest.mark.parametrize("cache_bytes, expect_redone", [("64MiB", False), ("8", True)],
                         ids=["every expert fits", "one layer's experts fit"])
def test_static_decoder_greedy_tokens_equal_the_eager_decode(qwen_case, eager_tokens, cache_bytes, expect_redone):
    slots = None if cache_bytes == "64MiB" else int(cache_bytes)
    with StoragedDaemon({"m": qwen_case.bundle}, vram_cache_bytes="64MiB", device=DAEMON_DEVICE) as _probe:
        slot_bytes = _probe.info().slot_bytes
    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE,
                            vram_cache_bytes="64MiB" if slots is None else slots * slot_bytes)
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=loaded.expert_source, static_cache_len=64)
            decoder = runner.decoder
            assert isinstance(decoder, StaticDecoder) and decoder.capture == (DEVICE == "cuda")
            first = _greedy(runner)
            redone_first = decoder.redone_steps
            second = _greedy(runner)  # a second request reuses the decoder (cache reset)
        stats = daemon.stats()
    finally:
        daemon.stop()
    assert first == eager_tokens and second == eager_tokens
    assert decoder.steps == 2 * (TOKENS - 1)
    assert decoder.lookup_steps + decoder.redone_steps + decoder.skipped_steps == decoder.steps
    if expect_redone:  # experts evicted between steps: found absent, the step undone and redone,
        # and the steps after it decoded on the acquire path without trying the graph (backoff)
        assert decoder.redone_steps > 0 and decoder.skipped_steps > 0 and stats.tiers["vram"].evictions > 0
        # on CUDA those steps replay the piecewise graphs, the experts acquired between the pieces
        assert decoder.piecewise_steps == (decoder.redone_steps + decoder.skipped_steps if DEVICE == "cuda" else 0)
    else:  # the same request again: every expert it routes to is resident, every step a lookup
        assert decoder.redone_steps == redone_first


@pytest.mark.slow  # a fused decode under triton's interpreter on the CPU: minutes
def test_requests_longer_than_the_static_cache_decode_eagerly(qwen_case, eager_tokens):
    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE)
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=loaded.expert_source, static_cache_len=len(PROMPT) + TOKENS - 1)
            assert _greedy(runner) == eager_tokens
            assert runner.decoder.steps == 0
    finally:
        daemon.stop()


@pytest.mark.parametrize("compute, source, reason", [
    ("exact", "storaged", "not on the fused path"),
    ("fused", "local", "publishes no slot map"),
])
def test_why_not_names_the_reason(qwen_case, compute, source, reason):
    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE) if source == "storaged" else None
    try:
        factory = (LocalPackSource if daemon is None
                   else lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d))
        with load_model(qwen_case.bundle, device=DEVICE, dtype=torch.bfloat16, expert_source=factory,
                        experts_compute=compute) as loaded:
            assert reason in why_not(loaded.model, loaded.expert_source, torch.device(DEVICE))
    finally:
        if daemon is not None:
            daemon.stop()


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["kill", "terminate"])
def test_decoder_follows_a_reconnect_to_the_new_session(qwen_case, eager_tokens, stop):
    """After storaged restarted and the source re-attached (a new arena mapping, a new fence),
    the next request's steps read the new session's slot map, not the unmapped old one."""
    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE)
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            source = loaded.expert_source
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=source, static_cache_len=64)
            decoder = runner.decoder
            assert _greedy(runner) == eager_tokens
            old_fence, lookups = decoder.fence, decoder.lookup_steps
            getattr(daemon, stop)()
            daemon.start()
            source.reconnect()
            assert _greedy(runner) == eager_tokens
            assert decoder.fence is source._session.fence and decoder.fence is not old_fence
            assert decoder.lookup_steps > lookups  # steps found experts through the new slot map
            source.close()
    finally:
        daemon.stop()


@pytest.mark.slow  # a fused decode under triton's interpreter on the CPU: minutes
def test_a_request_whose_experts_are_all_resident_makes_no_acquire(qwen_case, eager_tokens):
    """The prefill (and any step on the acquire path) reads a layer's slots from the slot map under
    the session's step fence when every expert it routes to is resident: a repeated request makes
    no Acquire at all (no hit counted by the daemon), gives the same tokens, and leaves the fence
    finished (a decode step can begin its own)."""
    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE, vram_cache_bytes="64MiB")
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=loaded.expert_source, static_cache_len=64)
            first = _greedy(runner)  # loads what it routes to
            hits = daemon.stats().tiers["vram"].hits
            second = _greedy(runner)
            stats = daemon.stats()
            fence = loaded.expert_source.device_lookup()[4]
            assert not fence.open and not fence.revoked
    finally:
        daemon.stop()
    assert first == eager_tokens and second == eager_tokens
    assert stats.tiers["vram"].hits == hits, "the second request acquired experts it found resident"


def _one_layer_in_vram_the_rest_in_the_host_tier(case, vram_experts: int | None = None) -> StoragedDaemon:
    """A daemon whose VRAM holds one layer's experts (or `vram_experts`) and whose host tier holds the rest."""
    with StoragedDaemon({"m": case.bundle}, vram_cache_bytes="64MiB", device=DAEMON_DEVICE) as probe:
        info = probe.info()
        slot_bytes, experts = info.slot_bytes, info.models["m"].expert_count
    return StoragedDaemon({"m": case.bundle}, device=DAEMON_DEVICE,
                          vram_cache_bytes=(vram_experts or experts) * slot_bytes, host_cache_bytes="64MiB")


@pytest.mark.slow  # a fused decode under triton's interpreter on the CPU: minutes
def test_host_tier_experts_are_read_in_place_without_an_acquire(qwen_case, eager_tokens):
    """VRAM holds one layer's experts, the host tier the rest: after a first request has put what
    it routes to in one tier or the other, the same request again computes every layer from the
    two maps (host-tier objects read in place, inference.experts.host_reads) with no Acquire at
    all, every decode step through the slot-map path, and the same tokens."""
    daemon = _one_layer_in_vram_the_rest_in_the_host_tier(qwen_case)
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=loaded.expert_source, static_cache_len=64)
            decoder = runner.decoder
            first = _greedy(runner)
            absent_acquires = sum(b.absent_acquires for b in decoder.bindings.values())
            before, redone = daemon.stats(), decoder.redone_steps
            lookups = decoder.lookup_steps
            second = _greedy(runner)
            after = daemon.stats()
            read_in_place = decoder._host_reads is not None
    finally:
        daemon.stop()
    assert first == eager_tokens and second == eager_tokens
    assert before.demotions > 0, "the first request did not push experts down to the host tier"
    # layers that met an expert in neither tier acquired only those, the others read in place
    assert absent_acquires > 0
    vram = (after.tiers["vram"].hits + after.tiers["vram"].misses) - (before.tiers["vram"].hits
                                                                      + before.tiers["vram"].misses)
    assert vram == 0, f"the second request made Acquires for {vram} experts"
    assert decoder.redone_steps == redone and decoder.lookup_steps - lookups == TOKENS - 1
    assert read_in_place


@pytest.mark.slow  # a fused decode under triton's interpreter on the CPU: minutes
@pytest.mark.parametrize("share, copy_engine", [(0.5, False), (None, False), (0.25, True)],
                         ids=["half", "tuned", "quarter, the rest copied"])
def test_cpu_experts_compute_a_share_of_the_host_tier_with_the_same_tokens(qwen_case, eager_tokens, share,
                                                                           copy_engine):
    """The host-tier test above with CPU threads taking half of each layer's host-tier experts
    (inference.experts.cpu_experts), or a share the tuner moves at every step, or a quarter with
    the copy agent bringing the GPU's share into scratch slots (memcpy without CUDA): the same
    tokens, the second request still all through the slot map, the pool serving one job a MoE
    layer a step where it takes an expert, and refusing none."""
    from inference.experts.cpu_experts import CpuExpertsConfig
    from inference.kernels.host_experts import W_TICKET

    # the copy agent's share is what the CPU leaves of a layer's host-tier experts: with one layer's
    # experts in VRAM a step of this model (top-2) often routes to one host-tier expert only, all
    # the CPU's (seen on an H100: no copy in a whole run), so its variant holds 6 experts in VRAM
    # (the prompt pins 5 of a layer at once)
    daemon = _one_layer_in_vram_the_rest_in_the_host_tier(qwen_case, vram_experts=6 if copy_engine else None)
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=loaded.expert_source, static_cache_len=64,
                                 cpu_experts=CpuExpertsConfig(2, share, copy_engine=copy_engine))
            decoder = runner.decoder
            pool = decoder.cpu_experts.pool
            agent = decoder.cpu_experts.agent
            assert (agent is not None) == copy_engine
            tuner = decoder.cpu_experts.tuner
            assert (tuner is None) == (share is not None)
            metrics = EngineMetrics("m")
            metrics.watch_cpu_experts(decoder)
            if tuner is not None:  # a window of one step: the share moves at every step (or returns)
                tuner.window, tuner.settle = 1, 1
            first = _greedy(runner)
            redone, lookups, jobs = decoder.redone_steps, decoder.lookup_steps, pool.stats().jobs
            posted = int(pool.words[W_TICKET])
            second = _greedy(runner)
            stats = pool.stats()
            posted = int(pool.words[W_TICKET]) - posted
            shared_layers = len(decoder.cpu_experts.layers)
            moves = decoder.cpu_experts.share_moves
            scraped = {name: metrics.registry.get_sample_value(f"expertpack_inference_cpu_experts_{name}", {"model": "m"})
                       for name in ("jobs_total", "failed_jobs_total", "share_moves_total", "share")}
            share_now = decoder.cpu_experts.share_now
            copied = agent.stats() if agent is not None else None
            scraped_copies = {name: metrics.registry.get_sample_value(f"expertpack_inference_copy_agent_{name}",
                                                                      {"model": "m"})
                              for name in ("jobs_total", "copies_total", "refused_jobs_total")}
            decoder.close()
            assert metrics.registry.get_sample_value("expertpack_inference_cpu_experts_jobs_total",
                                                     {"model": "m"}) is None  # closed: nothing to read
    finally:
        daemon.stop()
    assert shared_layers == len(decoder.bindings), (shared_layers, len(decoder.bindings))
    assert (decoder.redone_steps, decoder.lookup_steps - lookups) == (redone, TOKENS - 1)
    # a job a MoE layer a step where the CPU takes an expert (a layer-step whose experts are all in
    # VRAM posts none), each posted job served once
    assert (stats.jobs - jobs, stats.failed_jobs) == (posted, 0)
    assert shared_layers * (TOKENS - 1) // 2 < posted <= shared_layers * (TOKENS - 1), posted
    assert (first, second) == (eager_tokens, eager_tokens)
    assert (moves > 0) == (share is None)
    assert scraped == {"jobs_total": stats.jobs, "failed_jobs_total": 0, "share_moves_total": moves,
                       "share": share_now}
    if copy_engine:  # the self-check's job, then copies in the steps, none refused
        assert copied.jobs > 1 and copied.copies >= copied.jobs and copied.refused == 0, copied
        assert scraped_copies == {"jobs_total": copied.jobs, "copies_total": copied.copies,
                                  "refused_jobs_total": 0}
    else:
        assert scraped_copies == dict.fromkeys(scraped_copies)  # no agent: no series


def test_cpu_experts_are_refused_without_a_host_tier(qwen_case):
    from inference.experts.cpu_experts import CpuExpertsConfig

    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE, vram_cache_bytes="64MiB")
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            with pytest.raises(ValueError, match="cpu_experts_threads: storaged shares no host tier"):
                ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                            expert_source=loaded.expert_source, static_cache_len=64,
                            cpu_experts=CpuExpertsConfig(2))
            with pytest.raises(ValueError, match="static_cache_len is 0"):
                ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                            expert_source=loaded.expert_source, static_cache_len=0, cpu_experts=CpuExpertsConfig(2))
    finally:
        daemon.stop()


LONG_PROMPT = [(7 * i + 3) % 250 + 1 for i in range(40)]  # pads to 64 tokens: the grouped GEMM's size


@pytest.mark.slow  # a fused prefill and decode under triton's interpreter on the CPU: minutes
@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["pads to 16, per-pair GEMVs", "pads to 64, grouped"])
def test_prefill_through_the_slot_map_equals_the_eager_prefill(qwen_case, prompt):
    """With every expert resident the prefill is padded to its bucket and reads experts through
    the slot map (the CUDA-graph prefill's logic, uncaptured): the same greedy tokens as the
    eager prefill of the unpadded prompt. While experts are missing from the slot map the
    prefill is eager, on the acquire path."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    with _load(qwen_case.bundle, LocalPackSource) as loaded:
        runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None)
        expected = list(runner.run(prompt, params, emit=lambda _: None).token_ids)
    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE, vram_cache_bytes="64MiB")
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=loaded.expert_source, static_cache_len=128)
            decoder = runner.decoder
            decoder.lookup_prefill = True
            source = loaded.expert_source
            first = list(runner.run(prompt, params, emit=lambda _: None).token_ids)  # nothing resident: eager
            assert (decoder.lookup_prefills, decoder.redone_prefills) == (0, 0)
            pack = source.bundle.pack
            for layer in pack.layers:  # every expert resident, the padding's too
                source.acquire(layer, list(range(pack.header.expert_count)))
            source.finish_resident_step()
            hits = daemon.stats().tiers["vram"].hits
            second = list(runner.run(prompt, params, emit=lambda _: None).token_ids)
            assert (decoder.lookup_prefills, decoder.redone_prefills) == (1, 0)
            assert daemon.stats().tiers["vram"].hits == hits  # nothing acquired: every expert was found resident
            fence = loaded.expert_source.device_lookup()[4]
            assert not fence.open and not fence.revoked
    finally:
        daemon.stop()
    assert first == expected and second == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prepare_captures_the_step_before_the_first_request(qwen_case, eager_tokens):
    """Engine.from_loaded calls prepare(): the decode step (compiled layers) is captured before the
    server reports ready, and the first request replays it."""
    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE)
    try:
        with _load(qwen_case.bundle, lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=loaded.expert_source, static_cache_len=64)
            decoder = runner.decoder
            decoder.prepare()
            graph = decoder._graph
            assert graph is not None and decoder.compile_layers
            assert _greedy(runner) == eager_tokens
            assert decoder._graph is graph and decoder.lookup_steps > 0
    finally:
        daemon.stop()
