"""Every per-type table of every layer derives from packformat.quant_types.QUANT_TYPES.

Each layer's table is keyed by element type and checked against the registry when its module is
built; here a fake type is registered and each module is built again, so a type added to the
registry without its entry in one of them fails, naming the type.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def test_fused_kernel_tables_cover_every_type_the_registry_marks() -> None:
    from inference.kernels import ops

    fused = {t: d.fused for t, d in DEQUANTIZERS.items() if d.fused is not None}
    assert set(ops.GEMV_TYPES) == set(fused) and fused  # the 1.0 types all run fused
    assert len({f.code for f in fused.values()}) == len(fused)
    for etype, entry in fused.items():
        code, blocks_per_step, rank = ops._TYPE_CODES[etype]
        assert (code, rank) == (entry.code, entry.tile_rank)
        assert ops.GEMM_PARTS[code] == entry.parts
        assert ops.GEMV_TUNING.get(etype) == entry.gemv_shape
        assert ops.gemm_shape(etype) == (entry.gemm_shape or ops.GEMM_TUNING)
        columns = ops.FLOAT_STEP_COLUMNS if DEQUANTIZERS[etype].float_dtype else ops.BLOCK_STEP_COLUMNS
        assert blocks_per_step * QUANT_TYPES[etype].block_elements == columns


def _fused_entry(etype: ElementType, **changes):
    """DEQUANTIZERS' entry of etype (Q8_0's for a type without one) with its fused record changed."""
    from inference.dequant.registry import FusedKernel

    entry = DEQUANTIZERS.get(etype, DEQUANTIZERS[ElementType.Q8_0])
    fused = entry.fused or FusedKernel(code=3, tile_rank=3, parts=2)
    return dataclasses.replace(entry, element_type=etype, fused=dataclasses.replace(fused, **changes))


Q8_1 = QuantType(ElementType.Q8_1, 32, 40, gguf.GGMLQuantizationType.Q8_1, gguf.LlamaFileType.GUESSED)


@pytest.mark.parametrize(("etype", "changes", "registered", "message"), [
    # a newly registered type whose kernel branch does not exist
    (ElementType.Q8_1, {"code": 14}, Q8_1, "Q8_1.*no branch for type code 14"),
    (ElementType.Q8_1, {"code": 3}, Q8_1, "Q8_1.*type code 3 is Q8_0's"),
    (ElementType.Q4_K, {"tile_rank": 5}, None, "Q4_K.*no product tile of rank 5"),
    (ElementType.UE8M0, {}, None, "UE8M0.*not a weight type that dequantizes alone"),
], ids=["unknown-code", "taken-code", "unknown-rank", "scale-type"])
def test_a_fused_entry_the_kernels_cannot_run_is_refused_on_import(etype, changes, registered, message,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from inference.dequant import registry
    from inference.dequant.errors import UnsupportedTypeError

    if registered is not None:
        monkeypatch.setattr(quant_types, "QUANT_TYPES", types.MappingProxyType({**QUANT_TYPES, etype: registered}))
    monkeypatch.setattr(registry, "DEQUANTIZERS", types.MappingProxyType(
        {**DEQUANTIZERS, etype: _fused_entry(etype, **changes)}))
    with pytest.raises(UnsupportedTypeError, match=f"element type {message}"):
        _build_again("inference.kernels.ops")


def test_a_type_without_a_fused_entry_is_refused_by_the_fused_kernels() -> None:
    from inference.dequant.errors import UnsupportedTypeError
    from inference.kernels.ops import GemvWeight

    assert DEQUANTIZERS[ElementType.UE8M0].fused is None and ElementType.F4_E2M1X2 not in DEQUANTIZERS
    for etype in (ElementType.UE8M0, ElementType.F4_E2M1X2):
        with pytest.raises(UnsupportedTypeError, match=f"{etype.name}: the fused kernels cannot read it in place"):
            GemvWeight(etype, rows=32, cols=64, row_bytes=32, first_offset=0, second_offset=0, split=32)


# The fused kernels switch on these codes, and the launch shapes were measured on the H200 with
# them (docs/benchmarks.md): the tables derived from the registry must stay these values.
_GOLDEN_TYPE_CODES = {
    "F32": (0, 64, 2), "F16": (1, 64, 2), "BF16": (2, 64, 2), "Q8_0": (3, 8, 3), "Q4_0": (4, 8, 3),
    "Q4_1": (5, 8, 3), "Q5_0": (6, 8, 3), "Q5_1": (7, 8, 3), "MXFP4": (8, 8, 3), "Q2_K": (9, 1, 4),
    "Q3_K": (10, 1, 4), "Q4_K": (11, 1, 3), "Q5_K": (12, 1, 3), "Q6_K": (13, 1, 4),
}
_GOLDEN_K_QUANT_SHAPE, _GOLDEN_BLOCK32_SHAPE = (4, 1), (8, 1)  # GEMV (output rows per program, warps)


def test_the_derived_fused_tables_are_the_kernels_golden_values() -> None:
    from inference.kernels import ops

    assert {t.name: v for t, v in ops._TYPE_CODES.items()} == _GOLDEN_TYPE_CODES
    assert ops.GEMM_PARTS == {code: 1 if code <= 2 else 4 if code in (9, 10) else 2 for code in range(14)}
    k_quant, block32 = ops.GEMV_TUNING[ElementType.Q4_K], ops.GEMV_TUNING[ElementType.Q8_0]
    assert {t.name: v for t, v in ops.GEMV_TUNING.items()} == {
        **{name: k_quant for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
        **{name: block32 for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")}}
    assert (k_quant, block32) == (_GOLDEN_K_QUANT_SHAPE, _GOLDEN_BLOCK32_SHAPE)
