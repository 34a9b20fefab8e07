"""`packtools synth --format gguf`: a random-weight GGUF of any supported arch, any size.

Small models are built in full (tiny_random_model) and written through synth_gguf; above
`stream_threshold_bytes` of experts only the dense tensors are materialized and every expert
role is generated on demand as random valid blocks, so multi-GB benchmark files need little RAM.
Both carry the synthetic tokenizer. Deterministic in its arguments.
"""

from __future__ import annotations

from pathlib import Path

from packtools.synth.gguf_models import (
    balance_routing,
    expert_bytes,
    random_dense_state,
    random_expert_values,
    tiny_config_with,
    tiny_random_model,
)
from packtools.synth.gguf_writer import element_type, synth_gguf
from packtools.tokenizer_synth import build_tokenizer

DEFAULT_STREAM_THRESHOLD = 2 * 1024**3  # bytes of routed expert tensors


def synth_gguf_model(
    arch: str,
    out_path: Path | str,
    *,
    seed: int = 0,
    expert_type: str | int = "F32",
    dense_type: str | int = "F32",
    split_max_tensors: int | None = None,
    num_layers: int | None = None,
    stream_threshold_bytes: int = DEFAULT_STREAM_THRESHOLD,
    balanced_routing: bool = False,
    **sizes,
) -> list[Path]:
    """Write a random `arch` model (sizes as packtools.arch.tiny_config's) as GGUF; returns its file(s).

    balanced_routing: route like a trained model (gguf_models.balance_routing), for benchmarks."""
    config = tiny_config_with(arch, num_layers=num_layers, **sizes)
    tokenizer = build_tokenizer(config.vocab_size)
    kind = element_type(expert_type)
    common = dict(expert_type=kind, dense_type=dense_type, split_max_tensors=split_max_tensors, tokenizer=tokenizer)
    if expert_bytes(config, kind) <= stream_threshold_bytes:
        model = tiny_random_model(arch, seed=seed, num_layers=num_layers, **sizes)
        if balanced_routing:
            state = dict(model.state_dict())
            balance_routing(state, config, seed)
            model.load_state_dict(state)
        return synth_gguf(arch, out_path, model=model, **common)
    state = random_dense_state(config, seed)
    if balanced_routing:
        balance_routing(state, config, seed)
    return synth_gguf(
        arch, out_path, config=config, state_dict=state,
        expert_values=random_expert_values(config, kind, seed), **common,
    )
