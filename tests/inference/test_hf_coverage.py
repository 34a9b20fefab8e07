"""Every MoE model type packtools serves, through a Hugging Face checkpoint: `packtools build`
packs it and its greedy tokens equal plain transformers' (float32 on CPU; bfloat16 on CUDA with
the gpu mark). The types are every written module's plus every type whose transformers model marks
its experts with @use_experts_implementation; one the generic path refuses must be refused by a
typed error naming it. scripts/moe_coverage.py runs the same checks to write docs/inference.md's
table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_coverage import ReferenceFails, build, greedy_identical

from packtools.arch import ARCHITECTURES
from packtools.arch.errors import UnsupportedArchitecture
from packtools.arch.generic import experts_interface_model_types
from packtools.arch.registry import get_architecture

CANDIDATES = sorted(set(ARCHITECTURES) | set(experts_interface_model_types()))
pytestmark = pytest.mark.usefixtures("one_thread")


def _served_or_refused(model_type: str) -> bool:
    """True when served; for a refused type, checks the refusal names it and says why."""
    try:
        get_architecture(model_type)
    except UnsupportedArchitecture as exc:
        assert exc.model_type == model_type and repr(model_type) in str(exc) and exc.reason
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("model_type", CANDIDATES)
def test_hf_checkpoint_builds_and_float32_greedy_tokens_equal_transformers(model_type, tmp_path):
    if not _served_or_refused(model_type):
        return
    try:
        greedy_identical(model_type, tmp_path)
    except ReferenceFails as exc:
        pytest.skip(f"{model_type}: {exc}")


def test_the_docs_table_lists_every_candidate_and_each_module_as_such():
    """docs/inference.md's table is generated (scripts/moe_coverage.py): a type added or given a
    module of its own since the last run means running it again."""
    results = json.loads((Path(__file__).resolve().parents[2] / "docs" / "moe_coverage.json").read_text())
    rows = results["rows"]
    assert set(CANDIDATES) <= set(rows), f"not in the table: {sorted(set(CANDIDATES) - set(rows))}"
    stale = [t for t in ARCHITECTURES if rows[t].get("record") != "module"]
    assert not stale, f"have a module now, the table says otherwise: {stale}; run scripts/moe_coverage.py"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe_lite", "granitemoe", "nemotron_h"])
def test_hf_checkpoint_builds(model_type, tmp_path):
    """The fast loop's sample: a written module, the generic path, fused tensors renamed on load
    (granitemoe), experts without a gate under a renamed root (nemotron_h)."""
    bundle = build(model_type, tmp_path)
    assert (bundle / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", CANDIDATES)
def test_continuous_batching_gives_each_request_its_tokens_alone(model_type, tmp_path):
    """test_engine_batch's check over every type served, generic ones included (hybrid caches too)."""
    from test_engine_batch import CHUNK, MAX_TOKENS, CountingSource, greedy, prompts, run_together

    from inference.engine import Engine
    from inference.model import load_model

    if not _served_or_refused(model_type):
        return
    bundle = build(model_type, tmp_path)
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=CountingSource) as model:
        engine = Engine.from_loaded(model, max_num_seqs=8, prefill_chunk=CHUNK)
        try:
            requests = prompts(engine.runner.vocab_size)
            alone = [engine.runner.run(p, greedy(m), emit=lambda e: None) for p, m in zip(requests, MAX_TOKENS)]
            together = run_together(engine, requests)
        finally:
            engine.close()
    assert [f.token_ids for f in together] == [f.token_ids for f in alone]


def test_a_multimodal_checkpoint_builds_its_text_model(tmp_path):
    """The official Qwen3.5-MoE layout: a composite config.json, the text model under
    model.language_model., a vision tower transformers' causal LM ignores."""
    from safetensors.torch import load_file, save_file
    from test_model_fixtures import compare
    from transformers import AutoModelForCausalLM

    from inference.experts import LocalPackSource
    from inference.model import load_model
    from packtools.build import build_bundle

    from hf_coverage import write_checkpoint

    hf_dir = write_checkpoint("qwen3_5_moe", tmp_path)
    state = load_file(hf_dir / "model.safetensors")
    official = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
                for k, v in state.items()}
    official["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    save_file(official, hf_dir / "model.safetensors", metadata={"format": "pt"})
    build_bundle(hf_dir, tmp_path / "bundle", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with load_model(tmp_path / "bundle", device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        assert compare(reference, loaded.model, "qwen3_5_moe official layout") < 1e-4


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("model_type", CANDIDATES)
def test_bfloat16_greedy_tokens_on_cuda_equal_transformers(model_type, tmp_path):
    if not _served_or_refused(model_type):
        return
    try:
        greedy_identical(model_type, tmp_path, device="cuda", dtype=torch.bfloat16)
    except ReferenceFails as exc:
        pytest.skip(f"{model_type}: {exc}")
