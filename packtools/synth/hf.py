"""Random-weight Hugging Face checkpoints of every supported MoE architecture.

Two ways, same directory layout (config.json, generation_config.json, safetensors, tokenizer):
- materialized: the whole model is built with torch.manual_seed(seed) and saved with
  save_pretrained, exactly what transformers writes (per-expert tensors; gpt_oss fused);
- streamed (expert bytes above `stream_threshold_bytes`): the model is built on the meta device,
  only dense weights are materialized, and experts are generated one at a time and streamed
  into sharded safetensors (packtools.synth.hf_stream), so a full-width model never has to fit
  in memory. Both are deterministic functions of their arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from inference.models import OFFICIAL_CONFIG_LAYOUTS
from packtools.arch import get_arch, tiny_config
from packtools.arch.spec import ArchSpec
from packtools.synth.hf_stream import write_streamed
from packtools.synth.seeding import randomize_routing_state
from packtools.tokenizer_synth import write_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_STREAM_THRESHOLD = 2 * 1024**3  # bytes of routed expert weights
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


@dataclasses.dataclass(frozen=True)
class SynthResult:
    out_dir: Path
    arch: str
    mode: str  # "materialized" | "streamed"
    expert_bytes: int  # routed expert weight bytes in the checkpoint
    files: list[str]  # files written into out_dir
    tokenizer_files: list[str]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} not supported; use one of {sorted(DTYPES)}")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {sorted(DTYPES)}") from None


def expert_bytes(spec: ArchSpec, config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of all routed expert weights of `config` in `dtype`."""
    per_expert = sum(math.prod(shape) for shape in spec.role_shapes(config).values())
    element_size = torch.empty((), dtype=dtype).element_size()
    return len(spec.moe_layers(config)) * spec.num_experts(config) * per_expert * element_size


def synth_hf(
    arch: str,
    out_dir: Path | str,
    *,
    seed: int = 0,
    dtype: str | torch.dtype = "bfloat16",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    vocab_size: int = 512,
    stream_threshold_bytes: int = DEFAULT_STREAM_THRESHOLD,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> SynthResult:
    """Write a random-weight HF checkpoint of `arch` with a synthetic tokenizer into out_dir
    (which must be empty or absent). Size options are those of packtools.arch.tiny_config."""
    spec = get_arch(arch)
    torch_dtype = parse_dtype(dtype)
    config = tiny_config(
        arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_intermediate_size,
        vocab_size=vocab_size,
    )
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        # stale shards or an index from an earlier run would be read as part of this checkpoint
        raise FileExistsError(f"synth output directory {out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    total_expert_bytes = expert_bytes(spec, config, torch_dtype)
    if total_expert_bytes > stream_threshold_bytes:
        write_streamed(spec, config, out_dir, seed=seed, dtype=torch_dtype, max_shard_bytes=max_shard_bytes)
        mode = "streamed"
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        randomize_routing_state(model, spec, config, seed)
        model.save_pretrained(out_dir)
        mode = "materialized"
    if not (out_dir / "generation_config.json").exists():
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    if arch in OFFICIAL_CONFIG_LAYOUTS:
        # the official repository's config.json layout (e.g. Kimi-K3's multimodal wrapper), which
        # is what converters and packtools must read; the weights already carry its names
        written = AutoConfig.from_pretrained(out_dir)
        (out_dir / "config.json").write_text(json.dumps(OFFICIAL_CONFIG_LAYOUTS[arch](written), indent=2) + "\n")
    tokenizer_files = write_tokenizer(out_dir, config.vocab_size)
    return SynthResult(out_dir, arch, mode, total_expert_bytes, sorted(p.name for p in out_dir.iterdir()),
                       tokenizer_files)
