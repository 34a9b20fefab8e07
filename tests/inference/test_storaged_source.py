"""StoragedExpertSource against a real storaged daemon: exactness, cache stats, capacity, attach checks.

Every bundle is built by packtools from a synthetic checkpoint; the references are plain
transformers models (from_pretrained, or the GGUF's experts dequantized by gguf-py).
"""

from __future__ import annotations

import argparse

import pytest
import torch
from test_storaged_source_fixtures import (
    LONG_PROMPT,
    StoragedDaemon,
    build_case,
    greedy,
    qwen_case,  # noqa: F401  (the fixture)
    cases_dir,  # noqa: F401  (the fixture)
)

from inference.cli import add_model_arguments, model_config_from_args
from inference.config import ExpertSourceNotAvailableError, ModelConfig, make_expert_source
from inference.experts import LocalPackSource
from inference.experts.storaged_source import ExpertCapacityError, StoragedBundleMismatchError, StoragedExpertSource
from inference.model import load_model
from packformat.bundle import open_bundle
from storaged.client import NotFound

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [("qwen3_moe", "gguf"), ("gpt_oss", "hf"), ("deepseek_v3", "hf"), ("kimi_k3", "hf")]


@pytest.fixture(scope="module")
def cases(cases_dir, qwen_case):
    built = {("qwen3_moe", "gguf"): qwen_case}
    for arch, fmt in CASES[1:]:
        built[(arch, fmt)] = build_case(cases_dir, f"{arch}-{fmt}", arch, fmt)
    return built


@pytest.fixture(scope="module")
def daemon(cases, qwen_case):
    # one daemon for every model; "qwen-stats" is the qwen bundle again under a name (and so cache
    # keys) no other test touches
    models = {case.name: case.bundle for case in cases.values()} | {"qwen-stats": qwen_case.bundle}
    daemon = StoragedDaemon(models)
    yield daemon
    daemon.stop()


def storaged_model(bundle_dir, socket, name):
    return load_model(bundle_dir, device="cpu", dtype=torch.float32,
                      expert_source=lambda bundle, device: StoragedExpertSource(str(socket), name, bundle, device))


@pytest.mark.parametrize(("arch", "fmt"), CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_greedy_tokens_equal_local_pack_and_transformers(cases, daemon, arch, fmt):
    case = cases[(arch, fmt)]
    expected = greedy(case.reference())
    with load_model(case.bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as local:
        assert greedy(local.model) == expected
    with storaged_model(case.bundle, daemon.socket, case.name) as loaded:
        try:
            refused = daemon.stats().capacity_exhausted
            assert greedy(loaded.model) == expected
            assert loaded.expert_source.expert_wait_seconds() > 0
            assert daemon.stats().capacity_exhausted == refused
        finally:
            loaded.expert_source.close()


def test_stats_show_misses_then_hits(daemon, qwen_case):
    with storaged_model(qwen_case.bundle, daemon.socket, "qwen-stats") as loaded:
        try:
            before = daemon.stats()
            first = greedy(loaded.model, new_tokens=8)
            middle = daemon.stats()
            assert greedy(loaded.model, new_tokens=8) == first
            after = daemon.stats()
        finally:
            loaded.expert_source.close()
    vram = {name: stats.tiers["vram"] for name, stats in (("before", before), ("middle", middle), ("after", after))}
    assert vram["middle"].misses > vram["before"].misses  # the first pass reads from the pack
    assert middle.bytes_read > before.bytes_read
    assert vram["after"].misses == vram["middle"].misses  # the second finds every expert resident
    assert vram["after"].hits > vram["middle"].hits
    assert after.bytes_read == middle.bytes_read
    assert vram["after"].resident_experts >= vram["middle"].resident_experts > 0


SHORT_CACHE_SLOTS = 3


@pytest.fixture(scope="module")
def three_slot_daemon(qwen_case):
    """Room for one decode step's experts of one layer (top-2) plus one: not for every layer's
    pins at once, nor for one layer of a long prefill (all 8 experts)."""
    with open_bundle(qwen_case.bundle) as bundle:
        slot = bundle.pack.max_object_size
    daemon = StoragedDaemon({qwen_case.name: qwen_case.bundle}, vram_cache_bytes=SHORT_CACHE_SLOTS * slot)
    yield daemon
    daemon.stop()


def test_a_cache_short_of_every_layers_pins_decodes_without_a_refusal(qwen_case, three_slot_daemon):
    with open_bundle(qwen_case.bundle) as bundle:
        layers, top_k = len(bundle.pack.layers), bundle.config["num_experts_per_tok"]
    assert SHORT_CACHE_SLOTS < layers * top_k  # holding every layer's pins would not fit
    with load_model(qwen_case.bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as local:
        expected = greedy(local.model, prompt=[[9]], new_tokens=8)
    with storaged_model(qwen_case.bundle, three_slot_daemon.socket, qwen_case.name) as loaded:
        try:
            before = three_slot_daemon.stats()
            assert greedy(loaded.model, prompt=[[9]], new_tokens=8) == expected
            after = three_slot_daemon.stats()
        finally:
            loaded.expert_source.close()
    assert after.capacity_exhausted == before.capacity_exhausted == 0
    assert after.acquires - before.acquires == 8 * layers  # one per layer per token, none retried
    assert 0 < after.pins <= top_k  # only the last layer computed stays pinned
    vram_before, vram_after = before.tiers["vram"], after.tiers["vram"]
    misses = vram_after.misses - vram_before.misses
    # Each miss takes a free slot while there is one and evicts an expert once the cache is full.
    free_before = SHORT_CACHE_SLOTS - vram_before.resident_experts
    assert misses > SHORT_CACHE_SLOTS
    assert vram_after.evictions - vram_before.evictions == misses - free_before
    assert vram_after.resident_experts == SHORT_CACHE_SLOTS


def test_a_prompt_touching_more_experts_than_the_cache_holds_runs_in_groups(qwen_case, three_slot_daemon):
    """A long prompt routes to all 8 experts of a layer; the cache holds 3: each layer is computed
    in groups of at most 3 experts, ascending, and the tokens equal a cache that holds them all."""
    with load_model(qwen_case.bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as local:
        expected = greedy(local.model, prompt=LONG_PROMPT, new_tokens=4)
    with storaged_model(qwen_case.bundle, three_slot_daemon.socket, qwen_case.name) as loaded:
        try:
            before = three_slot_daemon.stats()
            assert greedy(loaded.model, prompt=LONG_PROMPT, new_tokens=4) == expected
            after = three_slot_daemon.stats()
        finally:
            loaded.expert_source.close()
    assert after.capacity_exhausted == before.capacity_exhausted  # nothing refused
    with open_bundle(qwen_case.bundle) as bundle:
        layers = len(bundle.pack.layers)
    assert after.acquires - before.acquires > (4 + 1) * layers  # the prefill took several per layer


@pytest.fixture(scope="module")
def impostor_daemon(cases_dir):
    """Serves, under names the qwen bundle's source will ask for, bundles that are not it."""
    models = {"same-shape": build_case(cases_dir, "qwen-seed1", "qwen3_moe", "gguf", seed=1).bundle,
              "other-arch": build_case(cases_dir, "olmoe-hf", "olmoe", "hf").bundle}
    daemon = StoragedDaemon(models)
    yield daemon
    daemon.stop()


@pytest.mark.parametrize(("impostor", "hidden_manifest", "message"), [
    ("other-arch", False, r"model_type is 'olmoe' there, 'qwen3_moe' here"),
    ("same-shape", False, r"pack index crc32 of .*qwen-seed1 is \d+, of .*qwen-q4k \d+"),
    # the daemon's bundle directory is out of sight (moved): one object read through the arena tells
    ("same-shape", True, r"layer 0 expert 0 has crc32 0x[0-9a-f]{8} there, 0x[0-9a-f]{8} here"),
])
def test_attach_refuses_a_daemon_serving_another_bundle(qwen_case, impostor_daemon, impostor, hidden_manifest,
                                                         message):
    served = impostor_daemon.models[impostor]
    moved = served.with_name(served.name + "-moved")
    try:
        if hidden_manifest:
            served.rename(moved)  # the daemon keeps its open pack file
        with open_bundle(qwen_case.bundle) as bundle:
            with pytest.raises(StoragedBundleMismatchError, match=message) as error:
                StoragedExpertSource(str(impostor_daemon.socket), impostor, bundle, "cpu")
        assert f"serves {served}, not the bundle loaded here ({qwen_case.bundle})" in str(error.value)
        assert impostor_daemon.stats().sessions == 0  # the refused session was closed
    finally:
        if moved.exists():
            moved.rename(served)


def parse_model_args(*argv: str) -> ModelConfig:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return model_config_from_args(parser.parse_args(list(argv)))


def test_make_expert_source_names_the_model_after_the_bundle_directory(qwen_case, daemon):
    with open_bundle(qwen_case.bundle) as bundle:
        args = parse_model_args("--bundle", str(qwen_case.bundle), "--storaged", str(daemon.socket))
        source = make_expert_source(args, bundle)  # the daemon serves it as "qwen-q4k", the directory's name
        assert isinstance(source, StoragedExpertSource) and source.model_name == qwen_case.name
        source.close()
        args = parse_model_args("--bundle", str(qwen_case.bundle), "--storaged", str(daemon.socket),
                                "--storaged-model", "qwen-stats")
        source = make_expert_source(args, bundle)
        assert source.model_name == "qwen-stats"
        source.close()


@pytest.mark.parametrize(("socket", "model", "message"), [
    ("daemon", "nope", r"model 'nope' is not served by .* \(served: .*qwen-q4k.*\); name the daemon's model "
                       "with --storaged-model"),
    ("/nonexistent/sd.sock", "qwen-q4k", r"the storaged expert source is not available: .*UNAVAILABLE"),
])
def test_make_expert_source_reports_why_it_cannot_attach(qwen_case, daemon, socket, model, message):
    socket = str(daemon.socket) if socket == "daemon" else socket
    with open_bundle(qwen_case.bundle) as bundle:
        args = parse_model_args("--bundle", str(qwen_case.bundle), "--storaged", socket, "--storaged-model", model)
        with pytest.raises(ExpertSourceNotAvailableError, match=message) as error:
            make_expert_source(args, bundle)
    if model == "nope":
        assert isinstance(error.value.__cause__, NotFound)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arena_views_are_zero_copy_and_match_the_local_pack(qwen_case):
    daemon = StoragedDaemon({qwen_case.name: qwen_case.bundle}, device="cuda:0")
    try:
        with load_model(qwen_case.bundle, device="cuda", dtype=torch.float32, expert_source=LocalPackSource) as local:
            expected = greedy(local.model)
        with load_model(qwen_case.bundle, device="cuda", dtype=torch.float32,
                        expert_source=lambda bundle, device: StoragedExpertSource(str(daemon.socket), qwen_case.name,
                                                                                  bundle, device)) as loaded:
            source = loaded.expert_source
            try:
                assert greedy(loaded.model) == expected
                arena = source._session.arena.slot_view(0)  # uint8 [slot bytes] at the arena's start
                (view,) = source.acquire(0, [3])
                start, end = arena.data_ptr(), arena.data_ptr() + source._session.slot_count * source._session.slot_size
                assert view.device.type == "cuda" and start <= view.data_ptr() < end  # in the arena: no copy
            finally:
                source.close()
    finally:
        daemon.stop()
