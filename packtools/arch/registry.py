"""The MoE architectures packtools supports, keyed by transformers `model_type`."""

from __future__ import annotations

import copy
import dataclasses

from transformers import AutoConfig, PretrainedConfig

import inference.models  # noqa: F401  (registers model types transformers lacks, e.g. kimi_k3)
from packformat.constants import Role
from packtools.arch.errors import UnknownArchitectureError
from packtools.arch.spec import ArchSpec, BlockScaledParts, FusedPart
from packtools.arch.tiny import TinySize, tiny_config_kwargs
from packtools.sources.base import ExpertLayout


def _every_layer(config: PretrainedConfig) -> list[int]:
    return list(range(config.num_hidden_layers))


def _qwen_sparse_layers(config: PretrainedConfig) -> list[int]:
    # mirrors Qwen2Moe/Qwen3MoeDecoderLayer.__init__
    if config.num_experts <= 0:
        return []
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
    ]


def _after_first_k_dense(config: PretrainedConfig) -> list[int]:
    # mirrors DeepseekV2/V3DecoderLayer.__init__
    return list(range(config.first_k_dense_replace or 0, config.num_hidden_layers))


def _kimi_sparse_layers(config: PretrainedConfig) -> list[int]:
    return [i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]


_SWIGLU_LAYOUT = ExpertLayout(roles=(Role.GATE, Role.UP, Role.DOWN), orientation="out_in", gate_up="concat")
# object role order shared with the GGUF source (packtools.gguf.expert_map.ROLE_ORDER):
# weights (gate, up | fused gate_up), down, then the biases in the same order
_GPT_OSS_LAYOUT = ExpertLayout(
    roles=(Role.GATE_UP, Role.DOWN, Role.GATE_UP_BIAS, Role.DOWN_BIAS), orientation="in_out", gate_up="interleaved"
)

_NAMED_PROJ = {"gate_proj": Role.GATE, "up_proj": Role.UP, "down_proj": Role.DOWN}
# mixtral-style checkpoints: w1 = gate, w3 = up, w2 = down
_W_PROJ = {"w1": Role.GATE, "w3": Role.UP, "w2": Role.DOWN}
# transformers 5 runtime: gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]
_SWIGLU_FUSED = {"gate_up_proj": FusedPart((Role.GATE, Role.UP)), "down_proj": FusedPart((Role.DOWN,))}
# gpt_oss: gate_up_proj [E, H, 2I] interleaved (not splittable into contiguous gate/up), biases
_GPT_OSS_FUSED = {
    "gate_up_proj": FusedPart((Role.GATE_UP,)),
    "gate_up_proj_bias": FusedPart((Role.GATE_UP_BIAS,)),
    "down_proj": FusedPart((Role.DOWN,)),
    "down_proj_bias": FusedPart((Role.DOWN_BIAS,)),
}


def _swiglu(model_type: str, num_experts_attr: str, inter_attr: str, rule, containers, per_expert, notes=""):
    return ArchSpec(
        model_type=model_type,
        layout=_SWIGLU_LAYOUT,
        num_experts_attr=num_experts_attr,
        moe_intermediate_attr=inter_attr,
        moe_layer_rule=rule,
        containers=containers,
        per_expert_parts=per_expert,
        fused_parts=_SWIGLU_FUSED,
        notes=notes,
    )


@dataclasses.dataclass(frozen=True)
class LatentExpertsArchSpec(ArchSpec):
    """An architecture whose routed experts run at `config.expert_hidden_size`, a latent width
    narrower than hidden_size (Kimi-K3's latent MoE), instead of at hidden_size."""

    def role_shapes(self, config: PretrainedConfig) -> dict[Role, tuple[int, ...]]:
        width, inter = int(config.expert_hidden_size), self.moe_intermediate_size(config)
        return {Role.GATE: (inter, width), Role.UP: (inter, width), Role.DOWN: (width, inter)}


ARCHITECTURES: dict[str, ArchSpec] = {
    "qwen3_moe": _swiglu(
        "qwen3_moe", "num_experts", "moe_intermediate_size", _qwen_sparse_layers, ("mlp",), _NAMED_PROJ
    ),
    "qwen2_moe": _swiglu(
        "qwen2_moe",
        "num_experts",
        "moe_intermediate_size",
        _qwen_sparse_layers,
        ("mlp",),
        _NAMED_PROJ,
        notes="shared_expert + shared_expert_gate are dense",
    ),
    "mixtral": _swiglu(
        "mixtral",
        "num_local_experts",
        "intermediate_size",
        _every_layer,
        ("block_sparse_moe", "mlp"),
        _W_PROJ,
        notes="checkpoint container block_sparse_moe, runtime mlp",
    ),
    "olmoe": _swiglu("olmoe", "num_experts", "intermediate_size", _every_layer, ("mlp",), _NAMED_PROJ),
    "deepseek_v3": _swiglu(
        "deepseek_v3",
        "n_routed_experts",
        "moe_intermediate_size",
        _after_first_k_dense,
        ("mlp",),
        _NAMED_PROJ,
        notes="first_k_dense_replace dense layers; gate.e_score_correction_bias is dense; covers Kimi-K2",
    ),
    "deepseek_v2": _swiglu(
        "deepseek_v2",
        "n_routed_experts",
        "moe_intermediate_size",
        _after_first_k_dense,
        ("mlp",),
        _NAMED_PROJ,
        notes="softmax routing (greedy or group_limited_greedy), never renormalised; first_k_dense_replace "
              "dense layers; covers DeepSeek-V2, V2.5 and V2-Lite",
    ),
    "deepseek_v4": dataclasses.replace(
        _swiglu(
            "deepseek_v4",
            "n_routed_experts",
            "moe_intermediate_size",
            _every_layer,
            ("ffn", "mlp"),
            _W_PROJ,
            notes="hash_moe layers route by the persistent gate.tid2eid buffer (dense); checkpoint names renamed; "
                  "the official checkpoint's experts are packed FP4 `.weight` + UE8M0 `.scale`",
        ),
        block_scaled=BlockScaledParts("weight", "scale"),
    ),
    "kimi_linear": _swiglu(
        "kimi_linear",
        "num_experts",
        "moe_intermediate_size",
        _kimi_sparse_layers,
        ("block_sparse_moe", "mlp"),
        _W_PROJ,
        notes="mlp_layer_types dense/sparse; q/k/v conv1d are concatenated at load",
    ),
    "kimi_k3": LatentExpertsArchSpec(
        model_type="kimi_k3",
        layout=_SWIGLU_LAYOUT,
        num_experts_attr="num_experts",
        moe_intermediate_attr="moe_intermediate_size",
        moe_layer_rule=_kimi_sparse_layers,
        containers=("block_sparse_moe", "mlp"),
        per_expert_parts=_W_PROJ,
        fused_parts=_SWIGLU_FUSED,
        top_k_attr="num_experts_per_token",
        # the official (multimodal) checkpoint nests the text model under "language_model."
        checkpoint_prefixes=("language_model.model.", "model.", ""),
        # Moonshot's release: compressed-tensors "mxfp4-pack-quantized" routed experts
        block_scaled=BlockScaledParts("weight_packed", "weight_scale"),
        notes="inference.models.kimi_k3; experts at routed_expert_hidden_size (latent), SiTU activation; "
              "official checkpoint under language_model. with a multimodal config.json wrapper",
    ),
    "gpt_oss": ArchSpec(
        model_type="gpt_oss",
        layout=_GPT_OSS_LAYOUT,
        num_experts_attr="num_local_experts",
        moe_intermediate_attr="intermediate_size",
        moe_layer_rule=_every_layer,
        containers=("mlp",),
        per_expert_parts={},
        fused_parts=_GPT_OSS_FUSED,
        notes="fused in_out interleaved gate_up with biases; router is mlp.router",
    ),
}


def get_arch(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnknownArchitectureError(None, model_type, known=ARCHITECTURES) from None


def config_from_dict(config: dict) -> PretrainedConfig:
    """A transformers config object from config.json contents (aliases and defaults resolved)."""
    model_type = config.get("model_type")
    get_arch(model_type)
    # a deep copy: configs may edit the nested dicts they are given (transformers 5.17's
    # DeepseekV4Config adds rope_theta and partial_rotary_factor to rope_parameters), which would
    # change the caller's config.json contents, e.g. the bundle's copy of it
    kwargs = copy.deepcopy({k: v for k, v in config.items() if k != "model_type"})
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_config(
    arch: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    vocab_size: int = 512,
) -> PretrainedConfig:
    """A small, real config of `arch` (deterministic: it depends on the arguments only).

    Routed experts sit in every layer the architecture allows (deepseek_v2/v3 keep their first layer
    dense when num_layers >= 2; deepseek_v4's first layer is hash-routed). Builds with
    AutoModelForCausalLM.from_config and runs on CPU in float32; hidden_size=4096,
    num_experts=256, moe_intermediate_size=2048 give full-width layers.
    """
    get_arch(arch)
    size = TinySize(hidden_size, num_layers, num_experts, top_k, moe_intermediate_size, vocab_size)
    return AutoConfig.for_model(arch, **tiny_config_kwargs(arch, size))
