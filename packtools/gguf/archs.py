"""Which transformers model_type each GGUF architecture is, and what llama.cpp implies for it.

gguf-py 0.19 knows seven of our MoE architectures. Mixtral has no GGUF arch of its own:
llama.cpp's converter writes it as LLAMA with experts. DeepSeek-V3 and Kimi-K2 are DEEPSEEK2
with sigmoid gating (DeepSeek-V2 is DEEPSEEK2 with softmax gating, which we do not map).
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
    "gpt_oss": GGUFArch("gpt_oss", MODEL_ARCH.GPT_OSS, None, None),
    "kimi_linear": GGUFArch("kimi_linear", MODEL_ARCH.KIMI_LINEAR, True, "moe_renormalize", mla=True),
    # llama.cpp reads expert_weights_norm with default false for kimi-k3; tables: packtools.gguf.kimi_k3*
    "kimi_k3": GGUFArch("kimi_k3", None, False, "moe_renormalize", mla=True, arch_name="kimi-k3"),
    # llama.cpp requires expert_weights_norm for deepseek4; tables: packtools.gguf.deepseek4
    "deepseek_v4": GGUFArch("deepseek_v4", None, True, "norm_topk_prob", arch_name="deepseek4"),
}

_BY_GGUF_NAME = {arch.gguf_name: arch for arch in ARCHS.values()}


def arch_for_model_type(model_type: str) -> GGUFArch:
    try:
        return ARCHS[model_type]
    except KeyError:
        raise UnknownArchitectureError(
            "<transformers config>", model_type, f"GGUF mapping exists for {', '.join(sorted(ARCHS))}"
        ) from None


def arch_for_gguf(path: object, gguf_name: str, *, expert_count: int, gating_func: int | None) -> GGUFArch:
    """The transformers architecture a GGUF file's general.architecture (plus experts) denotes."""
    arch = _BY_GGUF_NAME.get(gguf_name)
    if arch is None:
        raise UnknownArchitectureError(path, gguf_name, f"known: {', '.join(sorted(_BY_GGUF_NAME))}")
    if expert_count <= 0:
        raise UnknownArchitectureError(path, gguf_name, "no routed experts (expert_count is 0 or absent)")
    if arch.gguf_arch == MODEL_ARCH.DEEPSEEK2 and gating_func != gguf.ExpertGatingFuncType.SIGMOID:
        raise UnknownArchitectureError(
            path, gguf_name, f"expert_gating_func {gating_func} is not sigmoid: DeepSeek-V2 routing, not V3"
        )
    return arch
