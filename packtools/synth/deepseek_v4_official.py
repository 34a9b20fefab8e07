"""A random DeepSeek-V4 checkpoint in the layout DeepSeek publishes (deepseek-ai/DeepSeek-V4-Flash).

What differs from what transformers' save_pretrained writes (packtools.synth.hf):
- config.json carries DeepSeek's own keys: `compress_ratios` (one per layer plus one per MTP
  layer, 0 / 4 / 128), `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling` (YaRN, used by the
  compressed layers), the FP8 `quantization_config`; no transformers-only keys (layer_types, ...);
- tensor names have no `model.` prefix (`embed.weight`, `layers.0.attn.wq_a.weight`,
  `hc_head_fn`, `layers.0.attn.kv_norm.weight`), and MTP layers sit under `mtp.0.`;
- dtypes follow the published inventory: FP8 e4m3 attention / shared-expert / indexer-query
  projections with UE8M0 128x128 block scales (`X.scale`), routed experts as packed FP4 E2M1
  (int8 [out, in/2]) with UE8M0 scales per 32 elements, bfloat16 embeddings, norms, router and
  compressor projections, float32 hyper-connection, sink, position-bias and router-bias tensors,
  int64 `tid2eid`.
The weights are transformers' own initialization of the equivalent DeepseekV4Config, quantized;
every name is checked to map back, through transformers' official->runtime conversion table, to
the runtime parameter it came from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.core_model_loading import revert_weight_conversion

from packtools.arch import config_from_dict, get_arch, tiny_config
from packtools.arch.hf_names import RuntimeNames
from packtools.sources.dsv4_formats import quantize_fp4_groups, quantize_fp8_blocks
from packtools.synth.hf import SynthResult
from packtools.synth.seeding import randomize_routing_state
from packtools.tokenizer_synth import write_tokenizer

INDEX_FILE = "model.safetensors.index.json"
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [128, 128]}
ROPE_SCALING = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                "type": "yarn"}

FP8_WEIGHT = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.shared_experts\.w[123]|\.indexer\.wq_b|"
                        r"\.[eh]_proj)\.weight$")
FLOAT32_TENSOR = re.compile(r"(^|\.)(hc_\w+|attn_sink|ape|gate\.bias)$")
ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
# transformers' reverse conversion misses these (model. prefix, and `.norm.` -> `.kv_norm.`
# reversed one level too deep); the forward check in `official_state` pins the result
_REVERSE_FIXES = (
    (re.compile(r"^model\.embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^model\."), ""),
    (re.compile(r"\.attn\.norm\.weight$"), ".attn.kv_norm.weight"),
)


def official_config(*, hidden_size: int = 64, num_layers: int = 3, num_experts: int = 4, top_k: int = 2,
                    moe_intermediate_size: int = 32, vocab_size: int = 512, num_hash_layers: int = 1,
                    mtp_layers: int = 1) -> dict:
    """config.json of a small DeepSeek-V4 with the official repository's keys.

    Head sizes keep the real model's proportions where llama.cpp depends on them: its lightning
    indexer applies a Hadamard rotation of at least 64 elements (index_head_dim >= 64, a multiple
    of 64), and it rotates every compressed cache when head_dim == index_head_dim, which the real
    model (512 vs 128) never has; qk_rope_head_dim / head_dim is the real 64 / 512.
    """
    base = tiny_config("deepseek_v4", hidden_size=hidden_size, num_layers=num_layers, num_experts=num_experts,
                       top_k=top_k, moe_intermediate_size=moe_intermediate_size, vocab_size=vocab_size)
    # the real schedule is two sliding-window layers, then CSA (4) / HCA (128) alternating; one
    # sliding layer keeps every kind in three layers
    ratios = [0] + [4 if i % 2 else 128 for i in range(1, num_layers)]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": base.bos_token_id, "eos_token_id": base.eos_token_id,
        "hc_eps": base.hc_eps, "hc_mult": base.hc_mult, "hc_sinkhorn_iters": base.hc_sinkhorn_iters,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": hidden_size,
        "index_head_dim": 64, "index_n_heads": base.index_n_heads, "index_topk": base.index_topk,
        "initializer_range": base.initializer_range, "max_position_embeddings": 1048576,
        "moe_intermediate_size": moe_intermediate_size, "n_routed_experts": num_experts,
        "n_shared_experts": base.n_shared_experts, "norm_topk_prob": True,
        "num_attention_heads": base.num_attention_heads, "num_experts_per_tok": top_k,
        "num_hidden_layers": num_layers, "num_hash_layers": num_hash_layers, "num_key_value_heads": 1,
        "num_nextn_predict_layers": mtp_layers, "o_groups": base.o_groups, "o_lora_rank": base.o_lora_rank,
        "q_lora_rank": base.q_lora_rank, "qk_rope_head_dim": 16, "quantization_config": dict(QUANTIZATION_CONFIG),
        "rms_norm_eps": base.rms_norm_eps, "rope_scaling": dict(ROPE_SCALING), "rope_theta": 10000,
        "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": base.sliding_window,
        "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": vocab_size, "compress_rope_theta": 160000,
        "compress_ratios": ratios + [0] * mtp_layers,  # MTP layers are sliding-window only
    }


def official_name(runtime_state_name: str) -> str:
    """The official checkpoint name of a name transformers' reverse conversion produced."""
    name = runtime_state_name
    for pattern, replacement in _REVERSE_FIXES:
        name = pattern.sub(replacement, name)
    return name


def _official_dtype_tensors(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One checkpoint tensor in the official format: FP8 or FP4 pairs, or a plain cast."""
    if ROUTED_EXPERT.search(name):
        packed, scale = quantize_fp4_groups(value)
        return {name: packed, name.removesuffix(".weight") + ".scale": scale.view(torch.float8_e8m0fnu)}
    if FP8_WEIGHT.search(name):
        weight, scale = quantize_fp8_blocks(value)
        return {name: weight, name.removesuffix(".weight") + ".scale": scale.view(torch.float8_e8m0fnu)}
    if name.endswith(".tid2eid"):
        return {name: value.to(torch.int64)}
    dtype = torch.float32 if FLOAT32_TENSOR.search(name) else torch.bfloat16
    return {name: value.to(dtype).contiguous()}


def official_state(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the official checkpoint of `config`, MTP layers included."""
    hf_config = config_from_dict(config)
    spec = get_arch("deepseek_v4")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize_routing_state(model, spec, hf_config, seed)
    names = RuntimeNames(hf_config, spec)
    runtime_state = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for reverted, value in revert_weight_conversion(model, dict(runtime_state)).items():
        name = official_name(reverted)
        if not ROUTED_EXPERT.search(name):
            runtime, _ = names.runtime_name(name)
            # the official name must lead back to a runtime parameter of the same shape
            assert runtime in runtime_state and runtime_state[runtime].shape == value.shape, (name, runtime)
        state.update(_official_dtype_tensors(name, value.detach()))
    state.update(_mtp_tensors(state, config, seed))
    return state


def _mtp_tensors(state: dict[str, torch.Tensor], config: dict, seed: int) -> dict[str, torch.Tensor]:
    """MTP layers as DeepSeek ships them (`mtp.N.*`): a block like the last layer, without compressor,
    plus e_proj / h_proj / enorm / hnorm / norm / hc_head_*. Readers must skip all of them."""
    hidden, last = config["hidden_size"], config["num_hidden_layers"] - 1
    generator = torch.Generator().manual_seed(seed + 0x3A7)
    out: dict[str, torch.Tensor] = {}
    for mtp in range(config["num_nextn_predict_layers"]):
        prefix = f"mtp.{mtp}."
        for name, value in state.items():
            if name.startswith(f"layers.{last}.") and ".compressor." not in name and ".indexer." not in name:
                out[prefix + name.removeprefix(f"layers.{last}.")] = value.clone()
        for part in ("e_proj", "h_proj"):
            weight = torch.randn(hidden, hidden, generator=generator) * config["initializer_range"]
            out.update(_official_dtype_tensors(f"{prefix}{part}.weight", weight))
        for norm in ("enorm", "hnorm", "norm"):
            out[f"{prefix}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for part in ("fn", "base", "scale"):
            out[f"{prefix}hc_head_{part}"] = state[f"hc_head_{part}"].clone()
    return out


def synth_official(out_dir: Path | str, *, seed: int = 0, **sizes) -> SynthResult:
    """Write the checkpoint (two shards + index, config.json, generation config, tokenizer) into
    out_dir, which must be absent or empty. `sizes` are those of official_config."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"synth output directory {out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = official_config(**sizes)
    state = official_state(config, seed)
    # like the real shards: the trunk first, MTP layers in a shard of their own
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in state.items() if not k.startswith("mtp.")},
              "model-00002-of-00002.safetensors": {k: v for k, v in state.items() if k.startswith("mtp.")}}
    weight_map, total = {}, 0
    for file_name, tensors in shards.items():
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    GenerationConfig(bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"]).save_pretrained(out_dir)
    tokenizer_files = write_tokenizer(out_dir, config["vocab_size"])
    expert_bytes = sum(t.numel() * t.element_size() for k, t in state.items()
                       if ".ffn.experts." in k and not k.startswith("mtp."))
    return SynthResult(out_dir, "deepseek_v4", "official", expert_bytes, sorted(p.name for p in out_dir.iterdir()),
                       tokenizer_files)
