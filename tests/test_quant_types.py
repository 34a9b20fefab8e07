"""Every per-type table of every layer derives from packformat.quant_types.QUANT_TYPES.

Each layer's table is keyed by element type and checked against the registry when its module is
built; here a fake type is registered and each module is built again, so a type added to the
registry without its entry in one of them fails, naming the type.
"""

from __future__ import annotations

import argparse
import importlib.util
import types

import gguf
import pytest

from packformat import quant_types
from packformat.quant_types import QUANT_TYPES, ElementType, QuantType
from packtools.quants import QUANTIZABLE_TYPES, RANDOM_BLOCK_TYPES
from packtools.quants.registry import SYNTH_CODECS
from packtools.synth.cli import add_synth_arguments
from packtools.synth.gguf_writer import file_type

torch = pytest.importorskip("torch")
from inference.dequant import TORCH_DEQUANTIZERS  # noqa: E402
from inference.dequant.registry import DEQUANTIZERS  # noqa: E402

SELF_CONTAINED = {t for t, q in QUANT_TYPES.items() if q.self_contained}
PER_TYPE_MODULES = ("inference.dequant.registry", "packtools.quants.registry")


def test_dequantizers_cover_every_type_that_dequantizes_alone() -> None:
    expected = {t for t, q in QUANT_TYPES.items() if q.scale_rule is None}
    assert set(DEQUANTIZERS) == set(TORCH_DEQUANTIZERS) == expected
    for etype, entry in DEQUANTIZERS.items():
        assert entry.element_type is etype
        if entry.float_dtype is not None:  # the cast path reads one element per block of its width
            assert QUANT_TYPES[etype].block_bytes == entry.float_dtype.itemsize


def test_triton_kernels_are_the_registry_s() -> None:
    triton_kernels = pytest.importorskip("inference.dequant.triton_kernels")
    named = {t: d.triton for t, d in DEQUANTIZERS.items() if d.triton is not None}
    assert set(triton_kernels.KERNELS) == triton_kernels.TRITON_TYPES == set(named)
    for etype, spec in triton_kernels.KERNELS.items():
        assert spec.kernel.fn.__name__ == named[etype].name
        assert (spec.blocks_per_program, spec.num_warps) == (named[etype].blocks_per_program, named[etype].num_warps)


def test_synth_tables_are_the_registry_s() -> None:
    assert set(SYNTH_CODECS) == set(QUANTIZABLE_TYPES) == set(RANDOM_BLOCK_TYPES) == SELF_CONTAINED
    for etype in SELF_CONTAINED:
        assert file_type(etype) == QUANT_TYPES[etype].file_type
    assert file_type(ElementType.F4_E2M1X2) == gguf.LlamaFileType.GUESSED


def test_synth_cli_lists_every_gguf_expert_type() -> None:
    parser = argparse.ArgumentParser()
    add_synth_arguments(parser)
    help_text = next(a.help for a in parser._actions if a.dest == "expert_type")
    listed = help_text.split(":", 1)[1].split("(gguf", 1)[0].split()
    assert listed == [t.name for t in QUANT_TYPES if t in SELF_CONTAINED]


def _build_again(name: str) -> types.ModuleType:
    """Execute a module's source into a fresh module object (sys.modules keeps the real one)."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("module", PER_TYPE_MODULES)
def test_per_type_tables_build_against_the_registry(module: str) -> None:
    _build_again(module)  # the check that a registered fake fails below passes on the real registry


@pytest.mark.parametrize("module", PER_TYPE_MODULES)
def test_a_registered_type_without_its_entry_fails(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = QuantType(ElementType.Q8_1, 32, 40, gguf.GGMLQuantizationType.Q8_1, gguf.LlamaFileType.GUESSED)
    monkeypatch.setattr(quant_types, "QUANT_TYPES", types.MappingProxyType({**QUANT_TYPES, fake.element_type: fake}))
    with pytest.raises(LookupError, match=r"does not match .*QUANT_TYPES: missing Q8_1"):
        _build_again(module)


def test_fused_kernel_types_are_registered() -> None:
    ops = pytest.importorskip("inference.kernels.ops")
    assert set(ops.GEMV_TYPES) <= set(DEQUANTIZERS)
