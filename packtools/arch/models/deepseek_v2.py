"""DeepSeek-V2 / V2.5 / V2-Lite: DeepSeek-V3's layers with softmax routing (greedy or
group_limited_greedy, a group scored by its best expert), top-k weights never renormalised, no
selection biases. Same GGUF arch as DeepSeek-V3 (DEEPSEEK2), chosen by softmax gating, which
llama.cpp also reads when the file has no gating key (V2 GGUFs predate it).
"""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.errors import UnrunnableConfig
from packtools.arch.group_routing import check_groups
from packtools.arch.models.deepseek_v3 import read_deepseek2, tiny_deepseek, write_deepseek2
from packtools.arch.parts import NAMED_PROJ, after_first_k_dense, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.spec import ArchSpec
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import LLM, TensorFacts, write_expert_groups
from packtools.gguf.errors import InvalidMetadataError
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata
from packtools.gguf.routing import expert_groups as gguf_expert_groups

TOPK_METHODS = ("greedy", "group_limited_greedy")


def _tiny(size: TinySize) -> dict:
    # DeepSeek-V2 / V2.5's routing: softmax, best-expert group scores, top-k weights not renormalised
    return {**tiny_deepseek(size), "topk_method": "group_limited_greedy", "norm_topk_prob": False}


def _check_routing(config: PretrainedConfig, spec: ArchSpec) -> None:
    if config.topk_method not in TOPK_METHODS:
        raise UnrunnableConfig(config.model_type, "topk_method", config.topk_method,
                               f"transformers' DeepseekV2 router implements only {', '.join(TOPK_METHODS)}")
    if config.norm_topk_prob:
        raise UnrunnableConfig(config.model_type, "norm_topk_prob", config.norm_topk_prob,
                               "transformers' DeepseekV2 router never renormalises the top-k weights")
    if config.topk_method == "group_limited_greedy":
        # a group's score is its best expert (max), so a group may hold a single expert
        check_groups(config, spec, group_key="n_group", min_group_size=1)


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    if kwargs["norm_topk_prob"]:
        raise InvalidMetadataError(meta.path, meta.key(LLM.EXPERT_WEIGHTS_NORM), True,
                                   "transformers' DeepseekV2 router never renormalises the top-k weights")
    n_group, topk_group = gguf_expert_groups(meta)
    # DeepSeek-V2 and V2.5 keep the best groups by their best expert (group_limited_greedy); llama.cpp
    # scores a group by its two best experts instead (DeepSeek-V3's rule), which changes the choice
    # only when groups are limited. The file does not say which: the checkpoint's rule is the model.
    return {
        **read_deepseek2(meta, kwargs),
        "n_group": n_group,
        "topk_group": topk_group,
        "topk_method": "group_limited_greedy" if n_group > 1 else "greedy",
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    write_deepseek2(writer, config, gguf.ExpertGatingFuncType.SOFTMAX)
    if config.topk_method == "group_limited_greedy":  # "greedy" ignores the groups
        write_expert_groups(writer, config.n_group, config.topk_group)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("deepseek_v2", "n_routed_experts", "moe_intermediate_size", after_first_k_dense, ("mlp",),
                     NAMED_PROJ, notes="softmax routing (greedy or group_limited_greedy), never renormalised; "
                                       "first_k_dense_replace dense layers; covers DeepSeek-V2, V2.5 and V2-Lite"),
    tiny=_tiny,
    gguf=GGUFArch(
        "deepseek_v2", MODEL_ARCH.DEEPSEEK2, False, "norm_topk_prob", read_config=_read, write_config=_write,
        mla=True, yarn_log_mul=True, gating_func=gguf.ExpertGatingFuncType.SOFTMAX, gating_when_absent=True,
        selection_bias=False,
        selection_bias_hint="DeepSeek-V2's router has no selection bias and DeepSeek-V3's gates with sigmoid; a "
                            "DeepSeek-V3 checkpoint converted from a config.json without scoring_func looks like "
                            'this, and converting it again with "scoring_func": "sigmoid" in config.json writes '
                            "the gating key",
    ),
    check_routing=_check_routing,
)
