"""A Hugging Face model directory (config.json + safetensors) as a CheckpointSource.

Memory stays bounded: opening reads only config.json, the index and the safetensors headers;
an expert role is read with one pread of exactly its byte range (a fused [E, ...] tensor gives
the expert's slice), and a dense tensor is materialized only when its `load` is called.
Dense tensors come out under the transformers 5 runtime names (packtools.arch.hf_names).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from packtools.arch import config_from_dict, get_arch
from packtools.arch.errors import HFCheckpointError, MissingCheckpointFile, UnexpectedTensor
from packtools.arch.hf_experts import ExpertIndex, LocatedTensor, RoleRange
from packtools.arch.hf_names import RuntimeNames
from packtools.safetensors_stream import DTYPES, SafetensorsFormatError, read_header
from packtools.sources.base import DenseTensor, ExpertLayout, RoleSlice
from packtools.tokenizers_kimi import (
    TiktokenConfigError,
    TiktokenFormatError,
    convert_tiktoken_checkpoint,
    is_tiktoken_checkpoint,
)

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "tiktoken.model",
    "generation_config.json",
)


class HFSource:
    """CheckpointSource over a Hugging Face directory; validates everything at open."""

    kind = "hf"

    def __init__(self, path: Path | str):
        self.path = Path(path)
        config_path = self.path / CONFIG_FILE
        if not config_path.is_file():
            raise MissingCheckpointFile(config_path, "the Hugging Face config")
        self._config_dict = json.loads(config_path.read_text())
        self.spec = get_arch(self._config_dict.get("model_type"))
        self.config = config_from_dict(self._config_dict)
        self._files = self._shard_files()
        located = self._read_headers()
        self._handles: dict[Path, object] = {}
        # opened up front so concurrent expert reads (os.pread is thread-safe) share them race-free;
        # indexing may already read small tensors (DeepSeek's FP8 scales)
        self._fds: dict[Path, int] = {file: os.open(file, os.O_RDONLY) for file in self._files}
        try:
            self._index(located)
        except BaseException:
            self.close()
            raise

    def _index(self, located: dict[str, LocatedTensor]) -> None:
        """Split the checkpoint's tensors into routed experts and planned dense weights."""
        self._names = RuntimeNames(self.config, self.spec)
        kept = {n: loc for n, loc in located.items() if not self._names.is_ignored(n)}
        self.ignored_tensors = sorted(set(located) - set(kept))  # e.g. MTP layers transformers drops
        self._experts = ExpertIndex(self.spec, self.config, kept)
        self._dense_plans = self._names.plan(self._dense_tensor_names(kept))
        missing = self._names.missing(self._dense_plans)
        if missing:
            raise UnexpectedTensor(f"the checkpoint lacks dense weights the model needs: {missing[:8]}"
                                   + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

    def _dense_tensor_names(self, kept: dict[str, LocatedTensor]) -> list[str]:
        """The checkpoint tensors that are dense weights (a layout with companion tensors, such as
        block scales, leaves those out)."""
        return [n for n in kept if n not in self._experts.expert_tensor_names]

    # ---- files ----
    def _read_headers(self) -> dict[str, LocatedTensor]:
        """Every shard's safetensors header (kept in self._headers); tensor name -> where it lies.
        Checked: no tensor in two shards, and the index file (if any) agrees."""
        self._headers = {}
        located: dict[str, LocatedTensor] = {}
        for file in self._files:
            try:
                header = read_header(file)
            except SafetensorsFormatError as exc:
                raise HFCheckpointError(str(exc)) from None
            self._headers[file] = header
            for name, entry in header.tensors.items():
                if name in located:
                    raise HFCheckpointError(f"tensor {name!r} is in both {located[name].file.name} and {file.name}")
                located[name] = LocatedTensor(file, header.data_start, entry)
        self._check_index_agrees(located)
        self._located = located
        return located

    def _shard_files(self) -> list[Path]:
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map") or {}
            if not weight_map:
                raise HFCheckpointError(f"{index_path} has no weight_map")
            self._weight_map = weight_map
            files = [self.path / shard for shard in dict.fromkeys(weight_map.values())]
            for file in files:
                if not file.is_file():
                    raise MissingCheckpointFile(file, f"listed in {INDEX_FILE}")
            return files
        single = self.path / SINGLE_FILE
        if not single.is_file():
            raise MissingCheckpointFile(single, f"and no {INDEX_FILE}")
        self._weight_map = None
        return [single]

    def _check_index_agrees(self, located: dict[str, LocatedTensor]) -> None:
        if self._weight_map is None:
            return
        for name, shard in self._weight_map.items():
            if name not in located or located[name].file.name != Path(shard).name:
                raise HFCheckpointError(f"{INDEX_FILE} puts {name!r} in {shard}, which does not hold it")

    def _read_range(self, rng: RoleRange) -> bytes:
        data = os.pread(self._fds[rng.file], rng.nbytes, rng.offset)
        if len(data) != rng.nbytes:
            raise HFCheckpointError(
                f"{rng.file}: short read of {rng.tensor!r} at offset {rng.offset}: {len(data)} of {rng.nbytes} bytes"
            )
        return data

    def _get_tensor(self, name: str) -> torch.Tensor:
        # pread, not safe_open: pages read through a memory map that stays open stay resident,
        # so RSS would grow with the dense bytes (tests/packtools/test_build.py)
        located = self._located[name]
        entry = located.entry
        buffer = bytearray(entry.nbytes)
        view, got = memoryview(buffer), 0
        while got < entry.nbytes:  # one pread returns at most ~2 GiB
            n = os.preadv(self._fds[located.file], [view[got:]], located.data_start + entry.begin + got)
            if n == 0:
                raise HFCheckpointError(f"{located.file}: {name!r} needs bytes up to "
                                        f"{located.data_start + entry.end}; the file ends first (truncated?)")
            got += n
        dtype = DTYPES[entry.dtype][0]
        if not buffer:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(entry.shape)

    # ---- CheckpointSource ----
    def hf_config(self) -> dict:
        return dict(self._config_dict)

    def moe_layers(self) -> list[int]:
        return list(self._experts.layers)

    def num_experts(self) -> int:
        return self._experts.num_experts

    def expert_layout(self) -> ExpertLayout:
        """The arch's layout; block-scaled checkpoints add each weight's scale role after the weights."""
        return self._experts.layout

    def expert_form(self, layer: int) -> str:
        """'per_expert' or 'fused': how the checkpoint stores this layer's experts."""
        return self._experts.forms[layer]

    def expert_roles(self, layer: int, expert: int) -> list[RoleSlice]:
        return [
            RoleSlice(rng.role, int(rng.element_type), rng.shape, rng.nbytes, lambda rng=rng: self._read_range(rng))
            for rng in self._experts.roles(layer, expert)
        ]

    def dense_tensors(self) -> Iterator[DenseTensor]:
        for plan in self._dense_plans:
            dtype = DTYPES[self._located[plan.sources[0]].entry.dtype][0]
            shape = self._names.dense[plan.runtime_name]
            yield DenseTensor(plan.runtime_name, dtype, shape,
                              lambda plan=plan: self._names.load(plan, self._get_tensor))

    def write_tokenizer(self, out_dir: Path) -> dict:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        copied = []
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, out_dir / name)
                copied.append(name)
        if not copied:
            return {"files": [], "origin": "none", "note": f"{self.path} has no tokenizer files"}
        if is_tiktoken_checkpoint(self.path):  # Kimi: remote code only; AutoTokenizer needs tokenizer.json
            try:
                converted = convert_tiktoken_checkpoint(self.path, out_dir)
            except (TiktokenFormatError, TiktokenConfigError) as exc:
                log.warning("tiktoken.model not converted: %s", exc)
                return {"files": copied, "origin": "copied",
                        "note": f"copied from {self.path}; tiktoken.model not converted: {exc}"}
            return {"files": sorted(set(copied) | set(converted)), "origin": "converted",
                    "note": f"copied from {self.path}; {', '.join(converted)} converted from tiktoken.model"}
        return {"files": copied, "origin": "copied", "note": f"copied from {self.path}"}

    def identity(self) -> dict:
        """Every checkpoint file with its size; safetensors files also with the sha256 of their
        header. Hashing headers instead of whole files keeps identity O(MB) for a TB checkpoint;
        the header pins every tensor's name, dtype, shape and byte range, and the size pins the
        length. Tensor bytes themselves are covered by the pack's per-object checksums."""
        files = []
        for name in (CONFIG_FILE, INDEX_FILE):
            if (self.path / name).is_file():
                data = (self.path / name).read_bytes()
                files.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        for file in self._files:
            header = self._headers[file]
            files.append({
                "name": file.name,
                "size": file.stat().st_size,
                "header_sha256": hashlib.sha256(header.raw).hexdigest(),
            })
        return {"kind": self.kind, "path": str(self.path), "model_type": self.spec.model_type, "files": files,
                "hash_scope": "config and index: whole file; safetensors: header bytes only"}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._handles.clear()

    def __enter__(self) -> HFSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
