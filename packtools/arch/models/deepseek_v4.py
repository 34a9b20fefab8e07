"""DeepSeek-V4: compressed sparse / heavily compressed attention, hyper-connections, every FFN
MoE; the first layers route by a token-id hash (`hash_moe`, the persistent gate.tid2eid buffer,
dense). transformers renames nearly every checkpoint tensor; the official checkpoint's experts are
packed FP4 `.weight` + UE8M0 `.scale`. gguf-py 0.19 has no deepseek4 arch: keys and tensor names
are packtools.gguf.deepseek4.
"""

from __future__ import annotations

import dataclasses

from packtools.arch.parts import W_PROJ, every_layer, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.spec import BlockScaledParts
from packtools.arch.tiny import MAX_POSITIONS, TinySize
from packtools.gguf import deepseek4
from packtools.gguf.gguf_arch import GGUFArch


def _tiny(size: TinySize) -> dict:
    attention_cycle = ("heavily_compressed_attention", "compressed_sparse_attention")
    return {
        "num_key_value_heads": 1,
        "head_dim": 32,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 8,
        "sliding_window": 16,
        # small compression rates so short test prompts reach the compressed branches
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "layer_types": [attention_cycle[i % 2] for i in range(size.num_layers)],
        "n_routed_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "n_shared_experts": 1,
        # one hash-routed layer (tid2eid lookup) first, top-k routed layers after it
        "mlp_layer_types": ["hash_moe"] + ["moe"] * (size.num_layers - 1),
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": MAX_POSITIONS,
    }


ARCHITECTURE = Architecture(
    spec=dataclasses.replace(
        swiglu_spec("deepseek_v4", "n_routed_experts", "moe_intermediate_size", every_layer, ("ffn", "mlp"), W_PROJ,
                    notes="hash_moe layers route by the persistent gate.tid2eid buffer (dense); checkpoint names "
                          "renamed; the official checkpoint's experts are packed FP4 `.weight` + UE8M0 `.scale`"),
        block_scaled=BlockScaledParts("weight", "scale"),
    ),
    tiny=_tiny,
    # llama.cpp requires expert_weights_norm for deepseek4; packtools reads these GGUFs (llama.cpp's
    # converter writes them) and does not write them
    gguf=GGUFArch("deepseek_v4", None, True, "norm_topk_prob", read_config=deepseek4.config_kwargs,
                  arch_name=deepseek4.GGUF_ARCH_NAME, dense_ffn=False, own_dense_rule=deepseek4.dense_rule),
)
