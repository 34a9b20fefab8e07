"""GGUFSource: a GGUF file or llama.cpp split set as a packtools CheckpointSource.

Opening validates everything up front (magic, bounds, shards, architecture, expert tensors and
their types, the name of every dense tensor) so a build fails before writing anything. Expert
bytes are then read lazily with pread, verbatim; dense tensors load one at a time.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from packtools.arch import get_arch
from packtools.gguf.archs import arch_for_gguf
from packtools.gguf.config_parts import TensorFacts
from packtools.gguf.config_read import expert_hidden_width, hf_config_kwargs, mtp_blocks
from packtools.gguf.dense import meta_model_state, plan_dense
from packtools.gguf.errors import ExpertLayoutError, TensorMappingError
from packtools.gguf.experts import find_expert_tensors, role_slice, validate_experts
from packtools.gguf.files import index_tensors, open_shards
from packtools.gguf.metadata import Metadata
from packtools.gguf.tensor_map import TensorMapper
from packtools.gguf.tokenizer import rebuild_tokenizer
from packtools.sources.base import DenseTensor, ExpertLayout, RoleSlice

LLM = gguf.Keys.LLM
_TOKEN_EMBD = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
_OUTPUT = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight"
_ATTN_Q_BIAS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_Q].format(bid=0) + ".bias"
_SHEXP_GATE = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_SHEXP] + ".weight"
_SELECTION_BIAS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_EXP_PROBS_B] + ".bias"
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def split_mtp_blocks(tensors: dict, first_mtp_block: int) -> tuple[dict, list[str]]:
    """(the decoder's tensors, the names of the multi-token-prediction blocks' tensors).

    transformers' models have no MTP module (their loaders drop these checkpoint keys too), so a
    bundle holds the decoder only; the names left out are recorded in the bundle's source identity."""
    kept, left_out = {}, []
    for name, location in tensors.items():
        match = _BLOCK.match(name)
        if match and int(match.group(1)) >= first_mtp_block:
            left_out.append(name)
        else:
            kept[name] = location
    return kept, sorted(left_out)


class GGUFSource:
    kind = "gguf"

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._shards = open_shards(self.path)
        fields = self._shards[0].reader.fields
        architecture = Metadata(self.path, fields).require(gguf.Keys.General.ARCHITECTURE)
        self.meta = Metadata(self.path, fields, architecture)
        block_count = self.meta.get(LLM.BLOCK_COUNT, 0) - mtp_blocks(self.meta)
        self._tensors, self._mtp_tensors = split_mtp_blocks(index_tensors(self._shards), block_count)
        self.arch = arch_for_gguf(
            self.path, architecture,
            expert_count=self.meta.get(LLM.EXPERT_COUNT, 0), gating_func=self.meta.get(LLM.EXPERT_GATING_FUNC),
            selection_bias=any(_SELECTION_BIAS.format(bid=b) in self._tensors for b in range(block_count)),
        )
        self._experts = find_expert_tensors(self._tensors)
        hidden = expert_hidden_width(self.meta)
        self._roles = validate_experts(self._experts, self.meta.require(LLM.EXPERT_COUNT), hidden)
        self._config = self._build_config()
        expected = get_arch(self._config.model_type).moe_layers(self._config)
        if expected != list(self._experts):
            raise ExpertLayoutError(f"{self.path}: expert tensors in blocks {list(self._experts)}, but the metadata "
                                    f"implies MoE layers {expected}")
        self._mapper = TensorMapper(self._config)
        self._dense, used = plan_dense(self._mapper, meta_model_state(self._config), self._tensors)
        expert_names = {t.location.name for roles in self._experts.values() for t in roles.values()}
        leftover = sorted(set(self._tensors) - used - expert_names)
        if leftover:
            more = f" and {len(leftover) - 8} more" if len(leftover) > 8 else ""
            raise TensorMappingError(
                f"{self.path}: GGUF tensors with no place in {self._config.model_type}: {leftover[:8]}{more}"
            )
        self._fds = {shard.path: os.open(shard.path, os.O_RDONLY) for shard in self._shards}

    def _build_config(self) -> PretrainedConfig:
        tensors = self._tensors
        if _TOKEN_EMBD not in tensors:
            raise TensorMappingError(f"{self.path}: no {_TOKEN_EMBD}")
        block_count = self.meta.require(LLM.BLOCK_COUNT)
        shared_names = (_SHEXP_GATE.format(bid=b) for b in range(block_count))
        shared = next((tensors[name] for name in shared_names if name in tensors), None)
        facts = TensorFacts(
            vocab_size=tensors[_TOKEN_EMBD].shape[0],
            tied_embeddings=_OUTPUT not in tensors,
            attention_bias=_ATTN_Q_BIAS in tensors,
            shared_expert_rows=shared.shape[0] if shared is not None else None,
            names=frozenset(tensors),
        )
        kwargs = hf_config_kwargs(self.meta, self.arch, facts)
        config = AutoConfig.for_model(self.arch.model_type, **kwargs)
        # model types registered at run time (inference.models) are only in the Auto class's mapping
        registered = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(self.arch.model_type)
        config.architectures = [registered or AutoModelForCausalLM._model_mapping[type(config)].__name__]
        return config

    # ---- CheckpointSource ----
    def hf_config(self) -> dict:
        return self._config.to_dict()

    def moe_layers(self) -> list[int]:
        return list(self._experts)

    def num_experts(self) -> int:
        return self.meta.require(LLM.EXPERT_COUNT)

    def expert_layout(self) -> ExpertLayout:
        return ExpertLayout(roles=self._roles, orientation="out_in", gate_up="concat")

    def expert_roles(self, layer: int, expert: int) -> list[RoleSlice]:
        by_role = self._experts.get(layer)
        if by_role is None:
            raise KeyError(f"layer {layer} has no routed experts; MoE layers are {self.moe_layers()}")
        if not 0 <= expert < self.num_experts():
            raise KeyError(f"expert {expert} out of range [0, {self.num_experts()})")
        return [role_slice(by_role[role], expert, self._open_fd) for role in self._roles]

    def _open_fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            raise ValueError(f"{self.path}: the GGUFSource is closed")
        return fd

    def dense_tensors(self) -> Iterator[DenseTensor]:
        return iter(self._dense)

    def write_tokenizer(self, out_dir: Path) -> dict:
        return rebuild_tokenizer(self.path, self.meta, Path(out_dir))

    def identity(self) -> dict:
        files = []
        for shard in self._shards:
            header = shard.reader.data[: shard.reader.data_offset]  # header, metadata, tensor infos, padding
            digest = hashlib.sha256(header).hexdigest()
            files.append({"name": shard.path.name, "size": shard.size, "header_sha256": digest})
        identity = {"files": files, "hashed": "bytes before the tensor data: header, metadata and tensor infos"}
        if self._mtp_tensors:
            identity["mtp_tensors_left_out"] = self._mtp_tensors
        return identity

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

