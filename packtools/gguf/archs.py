"""Which transformers model_type each GGUF architecture is, from the architecture records.

Each record's GGUFArch (packtools.arch.models) names its llama.cpp arch. Mixtral has no GGUF arch
of its own: llama.cpp's converter writes it as LLAMA with experts. Where one GGUF arch is several
transformers models (DEEPSEEK2: DeepSeek-V3 and Kimi-K2 with sigmoid gating, DeepSeek-V2 / V2.5 /
V2-Lite with softmax, whose older GGUFs carry no gating key at all: llama.cpp reads softmax then),
the file's expert_gating_func chooses.
"""

from __future__ import annotations

import gguf

from packtools.arch.registry import ARCHITECTURES
from packtools.gguf.errors import UnknownArchitectureError
from packtools.gguf.gguf_arch import GGUFArch


def gguf_archs() -> dict[str, GGUFArch]:
    """model_type -> GGUF mapping, for every registered architecture that has one."""
    return {name: record.gguf for name, record in ARCHITECTURES.items() if record.gguf is not None}


def arch_for_model_type(model_type: str) -> GGUFArch:
    archs = gguf_archs()
    try:
        return archs[model_type]
    except KeyError:
        raise UnknownArchitectureError(
            "<transformers config>", model_type, f"GGUF mapping exists for {', '.join(sorted(archs))}"
        ) from None


def arch_for_gguf(path: object, gguf_name: str, *, expert_count: int, gating_func: int | None,
                  selection_bias: bool = False) -> GGUFArch:
    """The transformers architecture a GGUF file's general.architecture (plus experts) denotes.

    `selection_bias`: the file has routers' expert-selection biases (`exp_probs_b`, DeepSeek-V3's
    e_score_correction_bias)."""
    archs = gguf_archs().values()
    candidates = [arch for arch in archs if arch.gguf_name == gguf_name]
    if not candidates:
        known = sorted({arch.gguf_name for arch in archs})
        raise UnknownArchitectureError(path, gguf_name, f"known: {', '.join(known)}")
    if expert_count <= 0:
        raise UnknownArchitectureError(path, gguf_name, "no routed experts (expert_count is 0 or absent)")
    if len(candidates) == 1:
        return candidates[0]
    return _by_gating(path, gguf_name, candidates, gating_func, selection_bias)


def _by_gating(path: object, gguf_name: str, candidates: list[GGUFArch], gating_func: int | None,
               selection_bias: bool) -> GGUFArch:
    by_gating = {arch.gating_func: arch for arch in candidates}
    if None in by_gating or len(by_gating) != len(candidates):
        names = ", ".join(arch.model_type for arch in candidates)
        raise AssertionError(f"GGUF arch {gguf_name} is {names}, which no distinct expert_gating_func tells apart")
    absent = next((arch for arch in candidates if arch.gating_when_absent), None)
    gating = absent.gating_func if gating_func is None and absent is not None else gating_func
    arch = by_gating.get(gating)
    if arch is None:
        known = ", ".join(f"{int(g)} ({gguf.ExpertGatingFuncType(g).name.lower()})" for g in sorted(by_gating))
        raise UnknownArchitectureError(path, gguf_name, f"expert_gating_func {gating_func} is none of {known}")
    if selection_bias and not arch.selection_bias:
        name = gguf.ExpertGatingFuncType(gating).name.lower()
        given = f"absent (llama.cpp reads {name})" if gating_func is None else f"{gating_func} ({name})"
        raise UnknownArchitectureError(
            path, gguf_name,
            f"expert_gating_func {given} with expert-selection biases (exp_probs_b): {arch.selection_bias_hint}",
        )
    return arch
