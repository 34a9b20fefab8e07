"""`packtools build`: stream a checkpoint (GGUF or Hugging Face) into a pack bundle.

Memory stays bounded: one expert object and one dense tensor are in memory at a time, so
peak RSS does not grow with the model (docs/packtools.md records the measured figure).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import resource
import time
from pathlib import Path

from tqdm import tqdm

from packformat import PackWriter, Role
from packformat.bundle import CONFIG, DENSE, FORMAT_NAME, FORMAT_VERSION, MANIFEST, PACK, staged_bundle, write_json
from packformat.constants import ElementType
from packtools import __version__
from packtools.safetensors_stream import StreamingSafetensorsWriter
from packtools.sources.base import CheckpointSource


class SourceError(Exception):
    """The build source is not something packtools can read."""


def open_source(path: str | Path) -> CheckpointSource:
    """A GGUF file (or first shard) or a Hugging Face model directory."""
    src = Path(path)
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise SourceError(f"{src}: a Hugging Face model directory needs config.json")
        from packtools.sources.deepseek_v4_official import DeepseekV4OfficialSource, is_official_layout
        from packtools.sources.hf import HFSource

        # DeepSeek's own layout (original tensor names, FP8 dense with block scales) needs its
        # scales paired before the dense tensors are planned
        return DeepseekV4OfficialSource(src) if is_official_layout(src) else HFSource(src)
    if src.is_file():
        with open(src, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise SourceError(f"{src}: not a GGUF file (magic {magic!r}, expected b'GGUF') "
                              "and not a model directory")
        from packtools.gguf.source import GGUFSource

        return GGUFSource(src)
    raise SourceError(f"{src}: no such file or directory")


def top_k_of(config: dict) -> int:
    """Experts per token, read the way the architecture registry reads it (aliases resolved)."""
    from packtools.arch import config_from_dict, get_arch

    return get_arch(config.get("model_type")).top_k(config_from_dict(config))


def refuse_unrunnable_routing(config: dict) -> None:
    """Raise packtools.arch.errors.UnrunnableConfig if the model of `config` cannot route as it says."""
    from packtools.arch import config_from_dict
    from packtools.arch.routing import check_routing

    check_routing(config_from_dict(config))


@dataclasses.dataclass(frozen=True)
class BuildReport:
    bundle: Path
    objects: int
    expert_bytes: int
    dense_tensors: int
    dense_bytes: int
    seconds: float
    peak_rss_bytes: int


def build_bundle(source_path: str | Path, output: str | Path, *, force: bool = False,
                 progress: bool = True) -> BuildReport:
    start = time.monotonic()
    source = open_source(source_path)
    try:
        config, source_quantization = _without_quantization_config(source.hf_config())
        refuse_unrunnable_routing(config)  # a config whose router cannot run is refused before anything is written
        with staged_bundle(output, force=force) as staging:
            config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
            (staging / CONFIG).write_bytes(config_bytes)
            pack_header, expert_bytes, types = _write_pack(source, staging / PACK, progress)
            dense_count, dense_bytes = _write_dense(source, staging / DENSE, progress)
            tokenizer = source.write_tokenizer(staging)
            layout = source.expert_layout()
            manifest = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "created_by": f"packtools {__version__}",
                "model_type": config.get("model_type"),
                "source": {"kind": source.kind, **source.identity(), "quantization_config": source_quantization},
                "config_sha256": hashlib.sha256(config_bytes).hexdigest(),
                "pack": {"file": PACK, "size": pack_header.file_size,
                         "index_crc32": pack_header.index_crc32, "object_stride": pack_header.object_stride},
                "dense": {"file": DENSE, "size": (staging / DENSE).stat().st_size, "tensors": dense_count},
                "experts": {
                    "moe_layers": list(source.moe_layers()),
                    "num_experts": source.num_experts(),
                    "top_k": top_k_of(config),
                    "roles": [Role(r).name.lower() for r in layout.roles],
                    "orientation": layout.orientation,
                    "gate_up": layout.gate_up,
                    "element_types": sorted(types),
                    "bytes_total": expert_bytes,
                },
                "tokenizer": tokenizer,
            }
            write_json(staging / MANIFEST, manifest)
    finally:
        source.close()
    return BuildReport(Path(output), pack_header.layer_count * pack_header.expert_count, expert_bytes,
                       dense_count, dense_bytes, time.monotonic() - start, peak_rss_bytes())


def _without_quantization_config(config: dict) -> tuple[dict, dict | None]:
    """The config without the checkpoint's `quantization_config` (top level or in a multimodal
    wrapper's text_config), and that entry. The bundle holds experts verbatim in the pack and dense
    weights as plain floats, so the entry no longer describes its files; left in, it would send
    transformers' from_pretrained down a quantizer's path. The manifest keeps it as provenance."""
    config = dict(config)
    found = config.pop("quantization_config", None)
    text = config.get("text_config")
    if isinstance(text, dict) and "quantization_config" in text:
        text = dict(text)
        found = found or text.pop("quantization_config")
        text.pop("quantization_config", None)
        config["text_config"] = text
    return config, found


def peak_rss_bytes() -> int:
    """This process's peak resident set. Linux's ru_maxrss survives exec, so a build started from a
    large parent (a notebook, a test runner) would report the parent's size; VmHWM belongs to the
    current address space only."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _write_pack(source: CheckpointSource, path: Path, progress: bool):
    layers, experts = source.moe_layers(), source.num_experts()
    roles = source.expert_layout().roles
    writer = PackWriter(path, layers, experts, len(roles))
    total, types = 0, set()
    bar = tqdm(total=len(layers) * experts, unit="expert", desc="experts", disable=not progress)
    try:
        for layer in layers:
            for expert in range(experts):
                slices = source.expert_roles(layer, expert)
                got = tuple(s.role for s in slices)
                if got != tuple(roles):
                    raise SourceError(f"(layer {layer}, expert {expert}): roles {got} differ from the "
                                      f"layout's {tuple(roles)}")
                payloads = [(s.role, s.element_type, s.shape, s.read()) for s in slices]
                entry = writer.add_object(layer, expert, payloads)
                total += entry.size
                types.update(ElementType(s.element_type).name for s in slices)
                bar.update(1)
        header = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return header, total, types


def _write_dense(source: CheckpointSource, path: Path, progress: bool) -> tuple[int, int]:
    tensors = list(source.dense_tensors())
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SourceError(f"dense tensor names repeat: {dup[:5]}")
    writer = StreamingSafetensorsWriter(path, [(t.name, t.dtype, t.shape) for t in tensors])
    total = 0
    for tensor in tqdm(tensors, unit="tensor", desc="dense", disable=not progress):
        value = tensor.load()
        writer.write(tensor.name, value)
        total += value.numel() * value.element_size()
    writer.close()
    return len(tensors), total
