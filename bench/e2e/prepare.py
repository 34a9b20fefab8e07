"""Model preparation: a synthetic GGUF of a shape, its pack bundle, and (for the accelerate
contender) a Hugging Face bf16 checkpoint of the very same weights.

The checkpoint is made by dequantizing the bundle's experts (bench.e2e.resident: the bit-exact
device dequantizers) and saving the resulting transformers model: every contender computes with
the same numbers, the accelerate one from bf16 copies of them (4x the bytes of MXFP4, 3.6x Q4_K).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from bench.e2e.shapes import ModelShape

SEED = 0


@dataclasses.dataclass(frozen=True)
class PreparedModel:
    shape: ModelShape
    layers: int
    gguf_path: Path
    bundle_dir: Path
    hf_dir: Path | None  # None: no bf16 checkpoint (the accelerate contender is skipped)
    expert_bytes_total: int  # bytes of every routed expert in the pack (unpadded objects)
    bf16_bytes_total: int  # bytes of the bf16 checkpoint's files, 0 without one
    seconds: dict  # per step

    @property
    def moe_layers(self) -> int:
        return self.shape.moe_layers(self.layers)

    def as_dict(self) -> dict:
        return {"shape": self.shape.as_dict(), "layers": self.layers, "moe_layers": self.moe_layers,
                "gguf": str(self.gguf_path), "bundle": str(self.bundle_dir),
                "hf_checkpoint": str(self.hf_dir) if self.hf_dir else None,
                "expert_bytes_total": self.expert_bytes_total, "bf16_bytes_total": self.bf16_bytes_total,
                "prepare_seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: dict) -> PreparedModel:
        shape_fields = {f.name for f in dataclasses.fields(ModelShape)}
        shape = ModelShape(**{k: v for k, v in data["shape"].items() if k in shape_fields})
        return cls(shape, data["layers"], Path(data["gguf"]), Path(data["bundle"]),
                   Path(data["hf_checkpoint"]) if data["hf_checkpoint"] else None,
                   data["expert_bytes_total"], data["bf16_bytes_total"], data["prepare_seconds"])


def _directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_bf16_checkpoint(bundle_dir: Path, out_dir: Path, device: str) -> None:
    """The bundle's model with every expert dequantized (bench.e2e.resident, on `device`), saved by
    transformers' save_pretrained in bf16. Dequantizing on the GPU takes seconds where gguf-py's
    numpy K-quant dequantizers took 5 minutes for 4 GB of Q4_K experts (first GPU run)."""
    import torch

    from bench.e2e.resident import load_resident

    loaded, _ = load_resident(bundle_dir, device=torch.device(device), dtype=torch.bfloat16)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        loaded.model.save_pretrained(staging)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(staging)
    finally:
        loaded.close()
        del loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    staging.rename(out_dir)  # complete or absent: a killed run never leaves half a checkpoint


def prepare_model(shape: ModelShape, layers: int, workdir: Path, *, with_bf16_checkpoint: bool,
                  device: str = "cpu", balanced_routing: bool = False) -> PreparedModel:
    """Synthesize, build and (optionally) dequantize `shape` with `layers` layers under workdir/<arch>-<layers>;
    reuses what an earlier call with the same arguments completed."""
    from packtools.build import build_bundle
    from packtools.synth.gguf_cli import synth_gguf_model

    routing = "-balanced" if balanced_routing else ""
    root = workdir / (f"{shape.arch}-{shape.hidden}-{shape.experts}x{shape.moe_intermediate}-{shape.expert_type}"
                      f"-{layers}L{routing}")
    root.mkdir(parents=True, exist_ok=True)
    gguf_path, bundle_dir, hf_dir = root / "model.gguf", root / "bundle", root / "hf-bf16"
    seconds = {}
    started = time.perf_counter()
    if not gguf_path.exists():
        partial = root / "model.partial.gguf"
        partial.unlink(missing_ok=True)
        synth_gguf_model(shape.arch, partial, seed=SEED, expert_type=shape.expert_type,
                         balanced_routing=balanced_routing, **shape.synth_sizes(layers))
        partial.rename(gguf_path)
    seconds["synth_gguf"] = time.perf_counter() - started
    started = time.perf_counter()
    if not (bundle_dir / "manifest.json").exists():
        build_bundle(gguf_path, bundle_dir, force=True, progress=False)
    seconds["build_bundle"] = time.perf_counter() - started
    started = time.perf_counter()
    if with_bf16_checkpoint and not hf_dir.exists():
        write_bf16_checkpoint(bundle_dir, hf_dir, device)
    seconds["bf16_checkpoint"] = time.perf_counter() - started
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    return PreparedModel(shape, layers, gguf_path, bundle_dir, hf_dir if with_bf16_checkpoint else None,
                         int(manifest["experts"]["bytes_total"]),
                         _directory_bytes(hf_dir) if with_bf16_checkpoint else 0, seconds)


def remove_model(model: PreparedModel) -> None:
    """Free the disk for the next shape."""
    shutil.rmtree(model.gguf_path.parent, ignore_errors=True)
