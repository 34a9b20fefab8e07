"""Which transformers model_type each GGUF architecture is, and what llama.cpp implies for it.

gguf-py 0.19 knows seven of our MoE architectures. Mixtral has no GGUF arch of its own:
llama.cpp's converter writes it as LLAMA with experts. DEEPSEEK2 is two transformers models, told
apart by the file's expert_gating_func: sigmoid is DeepSeek-V3 (and Kimi-K2), softmax is
DeepSeek-V2 / V2.5 / V2-Lite, whose older GGUFs carry no gating key at all (llama.cpp reads
softmax then).
"""

from __future__ import annotations

import dataclasses

import gguf

from packtools.gguf.errors import UnknownArchitectureError

MODEL_ARCH = gguf.MODEL_ARCH


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    model_type: str  # transformers model_type
    gguf_arch: gguf.MODEL_ARCH | None  # None: an arch gguf-py 0.19 does not know (named by arch_name)
    # llama.cpp renormalises the top-k weights of this arch unconditionally (True/False) when the
    # file has no expert_weights_norm key; None: the arch has no such switch in transformers.
    implied_norm_topk: bool | None
    norm_topk_attr: str | None  # transformers config attribute of that switch
    mla: bool = False  # multi-head latent attention (kv_b split into k_b / v_b)
    arch_name: str | None = None  # general.architecture, for archs newer than gguf-py 0.19

    @property
    def gguf_name(self) -> str:
        return self.arch_name or gguf.MODEL_ARCH_NAMES[self.gguf_arch]


ARCHS: dict[str, GGUFArch] = {
    "qwen3_moe": GGUFArch("qwen3_moe", MODEL_ARCH.QWEN3MOE, True, "norm_topk_prob"),
    "qwen2_moe": GGUFArch("qwen2_moe", MODEL_ARCH.QWEN2MOE, False, "norm_topk_prob"),
    "mixtral": GGUFArch("mixtral", MODEL_ARCH.LLAMA, None, None),
    "olmoe": GGUFArch("olmoe", MODEL_ARCH.OLMOE, False, "norm_topk_prob"),
    "deepseek_v3": GGUFArch("deepseek_v3", MODEL_ARCH.DEEPSEEK2, False, "norm_topk_prob", mla=True),
    "deepseek_v2": GGUFArch("deepseek_v2", MODEL_ARCH.DEEPSEEK2, False, "norm_topk_prob", mla=True),
    "gpt_oss": GGUFArch("gpt_oss", MODEL_ARCH.GPT_OSS, None, None),
    "kimi_linear": GGUFArch("kimi_linear", MODEL_ARCH.KIMI_LINEAR, True, "moe_renormalize", mla=True),
    # llama.cpp reads expert_weights_norm with default false for kimi-k3; tables: packtools.gguf.kimi_k3*
    "kimi_k3": GGUFArch("kimi_k3", None, False, "moe_renormalize", mla=True, arch_name="kimi-k3"),
    # llama.cpp requires expert_weights_norm for deepseek4; tables: packtools.gguf.deepseek4
    "deepseek_v4": GGUFArch("deepseek_v4", None, True, "norm_topk_prob", arch_name="deepseek4"),
}

# deepseek2 names two models; the gating function chooses (arch_for_gguf)
_BY_GGUF_NAME = {arch.gguf_name: arch for arch in ARCHS.values() if arch.model_type != "deepseek_v2"}
_DEEPSEEK2_BY_GATING = {gguf.ExpertGatingFuncType.SIGMOID: ARCHS["deepseek_v3"],
                        gguf.ExpertGatingFuncType.SOFTMAX: ARCHS["deepseek_v2"]}


def arch_for_model_type(model_type: str) -> GGUFArch:
    try:
        return ARCHS[model_type]
    except KeyError:
        raise UnknownArchitectureError(
            "<transformers config>", model_type, f"GGUF mapping exists for {', '.join(sorted(ARCHS))}"
        ) from None


def arch_for_gguf(path: object, gguf_name: str, *, expert_count: int, gating_func: int | None,
                  selection_bias: bool = False) -> GGUFArch:
    """The transformers architecture a GGUF file's general.architecture (plus experts) denotes.

    `selection_bias`: the file has routers' expert-selection biases (`exp_probs_b`, DeepSeek-V3's
    e_score_correction_bias)."""
    arch = _BY_GGUF_NAME.get(gguf_name)
    if arch is None:
        raise UnknownArchitectureError(path, gguf_name, f"known: {', '.join(sorted(_BY_GGUF_NAME))}")
    if expert_count <= 0:
        raise UnknownArchitectureError(path, gguf_name, "no routed experts (expert_count is 0 or absent)")
    if arch.gguf_arch == MODEL_ARCH.DEEPSEEK2:
        return _deepseek2_arch(path, gguf_name, gating_func, selection_bias)
    return arch


def _deepseek2_arch(path: object, gguf_name: str, gating_func: int | None, selection_bias: bool) -> GGUFArch:
    # llama.cpp runs a deepseek2 file without the key as softmax (DeepSeek-V2 / V2.5 GGUFs predate it)
    gating = gguf.ExpertGatingFuncType.SOFTMAX if gating_func is None else gating_func
    arch = _DEEPSEEK2_BY_GATING.get(gating)
    if arch is None:
        known = ", ".join(f"{int(g)} ({g.name.lower()})" for g in sorted(_DEEPSEEK2_BY_GATING))
        raise UnknownArchitectureError(path, gguf_name, f"expert_gating_func {gating_func} is none of {known}")
    if arch.model_type == "deepseek_v2" and selection_bias:
        given = "absent (llama.cpp reads softmax)" if gating_func is None else f"{gating_func} (softmax)"
        raise UnknownArchitectureError(
            path, gguf_name,
            f"expert_gating_func {given} with expert-selection biases (exp_probs_b): DeepSeek-V2's router has "
            "no selection bias and DeepSeek-V3's gates with sigmoid; a DeepSeek-V3 checkpoint converted from a "
            "config.json without scoring_func looks like this, and converting it again with "
            '"scoring_func": "sigmoid" in config.json writes the gating key',
        )
    return arch
