"""A made-up architecture, registered the way an architecture module registers a real one.

"expertpack_fake_moe" is Qwen3-MoE under another model_type and another GGUF arch name: its
transformers classes are registered with the Auto classes (as inference.models registers
kimi_k3), and its record, a copy of qwen3_moe's, goes into packtools.arch.ARCHITECTURES for the
duration of one test. The registry-parametrized tests (test_build, test_gguf_roundtrip,
test_exactness) run their checks on it to show that a new architecture module is all they need.
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

from packtools.arch import ARCHITECTURES, Architecture

FAKE_MODEL_TYPE = "expertpack_fake_moe"
FAKE_GGUF_ARCH = "expertpack-fake-moe"


class FakeMoeConfig(Qwen3MoeConfig):
    model_type = FAKE_MODEL_TYPE


class FakeMoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = FakeMoeConfig
    # its experts are Qwen3-MoE's, which take transformers' experts interface; transformers tells
    # that by finding the decorator in the source of the model class's module, which here is this file
    _can_set_experts_implementation_cached_value = True


def fake_record() -> Architecture:
    """qwen3_moe's record, renamed: its spec, tiny config and GGUF mapping (gguf-py's QWEN3MOE
    tensor names under another general.architecture)."""
    base = ARCHITECTURES["qwen3_moe"]
    return dataclasses.replace(
        base,
        spec=dataclasses.replace(base.spec, model_type=FAKE_MODEL_TYPE),
        gguf=dataclasses.replace(base.gguf, model_type=FAKE_MODEL_TYPE, arch_name=FAKE_GGUF_ARCH),
    )


def register_fake_architecture(monkeypatch: pytest.MonkeyPatch) -> str:
    """Make the fake known to transformers (for good: the Auto classes cannot forget a type) and to
    packtools' registry (until the test ends); returns its model_type."""
    AutoConfig.register(FAKE_MODEL_TYPE, FakeMoeConfig, exist_ok=True)
    AutoModelForCausalLM.register(FakeMoeConfig, FakeMoeForCausalLM, exist_ok=True)
    if get_checkpoint_conversion_mapping(FAKE_MODEL_TYPE) is None:  # save_pretrained's per-expert names
        register_checkpoint_conversion_mapping(FAKE_MODEL_TYPE, get_checkpoint_conversion_mapping("qwen3_moe"))
    monkeypatch.setitem(ARCHITECTURES, FAKE_MODEL_TYPE, fake_record())
    return FAKE_MODEL_TYPE
