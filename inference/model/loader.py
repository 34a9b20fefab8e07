"""load_model: a bundle becomes a transformers model whose routed experts come from an expert source.

Five steps: build the model from config.json on the meta device (routed expert weights are never
allocated), load dense.safetensors onto the device (strictly), load the tokenizer, bind every
experts module to its layer and the expert source, select the "expertpack" experts implementation.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel

import inference.models  # noqa: F401  (registers model types transformers lacks, e.g. kimi_k3)
from inference.experts import (ExpertSource, attach_lookahead, bind_experts, resolve_compute,
                               routed_parameter_names, select_expertpack)
from inference.experts.hint_policy import DEFAULT_MIN_PRECISION, HintPolicy
from inference.model.dense import build_meta_model, initialize_non_persistent_buffers, load_dense
from inference.model.errors import TokenizerLoadError
from packformat.bundle import DENSE, Bundle, open_bundle
from packtools.arch.routing import check_routing

# A source, or something that makes one from the open bundle and the device (LocalPackSource is one).
ExpertSourceFactory = Callable[[Bundle, torch.device], ExpertSource]


@dataclasses.dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object | None  # a transformers tokenizer, or None when the bundle has none
    config: PretrainedConfig
    bundle: Bundle
    expert_source: ExpertSource
    hint_policy: HintPolicy | None = None  # the lookahead's precision governor; None without lookahead

    def close(self) -> None:
        # A storaged-backed source holds a session (and its pins) until closed.
        close_source = getattr(self.expert_source, "close", None)
        if callable(close_source):
            close_source()
        self.bundle.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # safetensors and IPC handles want a concrete ordinal
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve_source(expert_source: ExpertSource | ExpertSourceFactory, bundle: Bundle,
                    device: torch.device) -> ExpertSource:
    # a class (LocalPackSource) has the protocol's attributes too: it is a factory, not a source
    if isinstance(expert_source, type) or not isinstance(expert_source, ExpertSource):
        if not callable(expert_source):
            raise TypeError(f"expert_source must be an ExpertSource or a factory (bundle, device) -> "
                            f"ExpertSource, got {type(expert_source).__name__}")
        return expert_source(bundle, device)
    return expert_source


def _load_tokenizer(bundle: Bundle):
    files = bundle.manifest.get("tokenizer", {}).get("files") or []
    if not files:
        return None
    try:
        return AutoTokenizer.from_pretrained(bundle.path)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"{bundle.path}: tokenizer files {files} do not load: {exc}") from exc


def load_model(bundle_dir: str | os.PathLike, *, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
               expert_source: ExpertSource | ExpertSourceFactory, experts_compute: str = "auto",
               lookahead: int = 0, lookahead_min_precision: float = DEFAULT_MIN_PRECISION,
               dense_kernels: bool = True) -> LoadedModel:
    """Open the bundle and return a model ready for forward/generate on `device`.

    Non-routed weights are cast to `dtype` (float32 where the model keeps them in float32);
    routed experts stay on the meta device and are computed from `expert_source`'s objects, by the
    fused kernels or the exact path (`experts_compute`: see inference.experts.resolve_compute).
    `lookahead` > 0: each MoE layer hints the next layer's likely experts (that many per token)
    to the source (inference.experts.lookahead); the source must take prefetch hints. A width of
    step whose hints' running precision (hinted experts the next layer used) falls below
    `lookahead_min_precision` stops sending them until it recovers (inference.experts.hint_policy;
    0: always send); the model's HintPolicy is `LoadedModel.hint_policy`.
    With the fused kernels on CUDA, RMSNorms take one Triton kernel each (inference.model.fast_norms)
    and, with `dense_kernels`, one-row projections the GEMV kernel (fast_linears), softmax top-k
    routers one GEMV and one selection kernel (fast_routers) and one-query attention the
    split-softmax kernel (fast_attention); without, those stay cuBLAS's, torch's and SDPA's.
    """
    if not isinstance(dense_kernels, bool):
        raise ValueError(f"dense_kernels must be True or False, got {dense_kernels!r}")
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(f"lookahead must be a non-negative number of experts per token, got {lookahead!r}")
    if isinstance(lookahead_min_precision, bool) or not isinstance(lookahead_min_precision, (int, float)) \
            or not 0 <= lookahead_min_precision <= 1:
        raise ValueError(f"lookahead_min_precision must be a fraction in [0, 1], got {lookahead_min_precision!r}")
    hint_policy = HintPolicy(lookahead_min_precision) if lookahead else None
    device = _resolve_device(device)
    fused_kernels = resolve_compute(experts_compute, device, dtype)
    bundle = open_bundle(bundle_dir)
    try:
        config = AutoConfig.from_pretrained(bundle.path)
        check_routing(config)  # bundles built before packtools refused such configs fail here, not mid-generate
        model = build_meta_model(config, dtype)
        load_dense(model, bundle.path / DENSE, device, dtype, routed_parameter_names(model))
        initialize_non_persistent_buffers(model, device)
        tokenizer = _load_tokenizer(bundle)
        source = _resolve_source(expert_source, bundle, device)
        experts = bundle.experts
        bindings = bind_experts(model, source, moe_layers=list(experts["moe_layers"]), num_experts=int(experts["num_experts"]),
                     orientation=experts.get("orientation", "out_in"), gate_up_layout=experts.get("gate_up", "concat"),
                     fused_kernels=fused_kernels)
        if lookahead:
            attach_lookahead(model, bindings, source, per_token=lookahead, policy=hint_policy)
        if fused_kernels and device.type == "cuda":
            from inference.model.fast_attention import use_decode_attention
            from inference.model.fast_linears import fuse_linears
            from inference.model.fast_norms import fuse_rms_norms
            from inference.model.fast_routers import fuse_routers

            fuse_rms_norms(model, dtype)
            if dense_kernels:
                fuse_linears(model, dtype)
                fuse_routers(model, dtype)
                use_decode_attention(model)
        select_expertpack(model)
    except BaseException:
        bundle.close()
        raise
    return LoadedModel(model, tokenizer, model.config, bundle, source, hint_policy)
