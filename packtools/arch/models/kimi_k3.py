"""Kimi-K3 (inference.models.kimi_k3, registered with transformers by packtools.arch.registry's
import of inference.models): Kimi-Linear's layers with latent routed experts (at
routed_expert_hidden_size), SiTU activation and cross-layer residuals. The official checkpoint
nests the text model under "language_model." with a multimodal config.json wrapper, and ships its
routed experts as compressed-tensors "mxfp4-pack-quantized". gguf-py 0.19 has no kimi-k3 arch:
keys and tensor names are packtools.gguf.kimi_k3 and kimi_k3_tensors.
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from packformat.constants import Role
from packtools.arch.group_routing import top2_group_score
from packtools.arch.models.kimi_linear import kimi_sparse_layers, tiny_kimi_moe
from packtools.arch.parts import SWIGLU_FUSED, SWIGLU_LAYOUT, W_PROJ
from packtools.arch.record import Architecture
from packtools.arch.spec import ArchSpec, BlockScaledParts
from packtools.arch.tiny import NUM_ATTENTION_HEADS, TinySize, mla_attention
from packtools.gguf import kimi_k3 as gguf_kimi_k3
from packtools.gguf import kimi_k3_tensors
from packtools.gguf.gguf_arch import GGUFArch


@dataclasses.dataclass(frozen=True)
class LatentExpertsArchSpec(ArchSpec):
    """An architecture whose routed experts run at `config.expert_hidden_size`, a latent width
    narrower than hidden_size (Kimi-K3's latent MoE), instead of at hidden_size."""

    def role_shapes(self, config: PretrainedConfig) -> dict[Role, tuple[int, ...]]:
        width, inter = int(config.expert_hidden_size), self.moe_intermediate_size(config)
        return {Role.GATE: (inter, width), Role.UP: (inter, width), Role.DOWN: (width, inter)}


def _tiny(size: TinySize) -> dict:
    # every fourth layer MLA as in Kimi-Linear, at least one; Moonshot numbers layers from 1
    full = [i + 1 for i in range(size.num_layers) if i % 4 == 3] or [size.num_layers]
    return {
        **mla_attention(),
        "q_lora_rank": 32,
        "linear_attn_config": {"num_heads": NUM_ATTENTION_HEADS, "head_dim": 16, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True, "full_attn_layers": full},
        **tiny_kimi_moe(size),
        "first_k_dense_replace": 1 if size.num_layers >= 2 else 0,
        "routed_expert_hidden_size": size.hidden_size // 2,  # the real model's latent ratio (3584 / 7168)
        "latent_moe_use_norm": True,
        "attn_res_block_size": 2,  # banks at layers 0, 2, ...: a 2-layer model already mixes two blocks
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        # Moonshot's MLA low-rank norms and KDA q/k l2 norms use 1e-6 whatever rms_norm_eps is, and
        # llama.cpp uses rms_norm_eps for both: 1e-6 everywhere makes them compute the same function
        "rms_norm_eps": 1e-6,
    }


ARCHITECTURE = Architecture(
    spec=LatentExpertsArchSpec(
        model_type="kimi_k3",
        layout=SWIGLU_LAYOUT,
        num_experts_attr="num_experts",
        moe_intermediate_attr="moe_intermediate_size",
        moe_layer_rule=kimi_sparse_layers,
        containers=("block_sparse_moe", "mlp"),
        per_expert_parts=W_PROJ,
        fused_parts=SWIGLU_FUSED,
        top_k_attr="num_experts_per_token",
        # the official (multimodal) checkpoint nests the text model under "language_model."
        checkpoint_prefixes=("language_model.model.", "model.", ""),
        # Moonshot's release: compressed-tensors "mxfp4-pack-quantized" routed experts
        block_scaled=BlockScaledParts("weight_packed", "weight_scale"),
        notes="inference.models.kimi_k3; experts at routed_expert_hidden_size (latent), SiTU activation; "
              "official checkpoint under language_model. with a multimodal config.json wrapper",
    ),
    tiny=_tiny,
    # llama.cpp reads expert_weights_norm with default false for kimi-k3; packtools reads these GGUFs
    # (llama.cpp's converter writes them) and does not write them
    gguf=GGUFArch("kimi_k3", None, False, "moe_renormalize", read_config=gguf_kimi_k3.config_kwargs, mla=True,
                  arch_name=gguf_kimi_k3.GGUF_ARCH_NAME, rope=False, ffn_act=None,
                  own_dense_rule=kimi_k3_tensors.dense_rule),
    check_routing=top2_group_score("num_expert_group"),
)
