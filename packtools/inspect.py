"""`packtools inspect` and `packtools validate`: read a bundle back and describe or check it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from packformat import ElementType, ObjectChecksumError, Role
from packformat.bundle import DENSE, Bundle, open_bundle


def summarize(bundle: Bundle) -> dict:
    """A JSON-ready summary of a bundle's model, experts and files."""
    config, experts, pack = bundle.config, bundle.experts, bundle.pack
    text = config.get("text_config") or config  # multimodal wrappers (Kimi-K3) nest the text model's keys
    sizes = [obj.size for obj in pack]
    first = pack.objects[0]
    return {
        "bundle": str(bundle.path),
        "model_type": bundle.manifest.get("model_type"),
        "architectures": config.get("architectures"),
        "source": {k: bundle.manifest["source"].get(k) for k in ("kind",)},
        "hidden_size": text.get("hidden_size"),
        "num_layers": text.get("num_hidden_layers"),
        "moe_layers": list(pack.layers),
        "num_experts": pack.header.expert_count,
        "top_k": experts.get("top_k"),
        "roles": [
            {"role": Role(r.role).name.lower(), "type": ElementType(r.element_type).name,
             "shape": list(r.shape), "bytes": r.nbytes}
            for r in first.roles
        ],
        "element_types": experts.get("element_types"),
        "orientation": experts.get("orientation"),
        "gate_up": experts.get("gate_up"),
        "bytes_per_expert": {"min": min(sizes), "max": max(sizes),
                             "padded_max": max(o.padded_size for o in pack)},
        "expert_bytes_total": sum(sizes),
        "pack_file_bytes": pack.header.file_size,
        "dense_bytes": (bundle.path / DENSE).stat().st_size,
        "dense_tensors": bundle.manifest["dense"].get("tensors"),
        "tokenizer": bundle.manifest.get("tokenizer", {}).get("origin"),
        "pack_format": f"{pack.header.version_major}.{pack.header.version_minor}",
    }


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_summary(s: dict) -> str:
    roles = ", ".join(f"{r['role']} {r['type']} {'x'.join(map(str, r['shape']))}" for r in s["roles"])
    per = s["bytes_per_expert"]
    per_text = human_bytes(per["max"]) if per["min"] == per["max"] else \
        f"{human_bytes(per['min'])} .. {human_bytes(per['max'])}"
    lines = [
        f"bundle        {s['bundle']}",
        f"architecture  {s['model_type']} ({', '.join(s['architectures'] or [])}), from {s['source']['kind']}",
        f"layers        {s['num_layers']} ({len(s['moe_layers'])} with routed experts: {s['moe_layers']})",
        f"experts       {s['num_experts']} per layer, top-{s['top_k']}, hidden {s['hidden_size']}",
        f"roles         {roles}",
        f"types         {', '.join(s['element_types'] or [])}  ({s['orientation']}, gate_up {s['gate_up']})",
        f"per expert    {per_text} (padded {human_bytes(per['padded_max'])})",
        f"experts total {human_bytes(s['expert_bytes_total'])} in a {human_bytes(s['pack_file_bytes'])} pack",
        f"dense         {human_bytes(s['dense_bytes'])} in {s['dense_tensors']} tensors",
        f"tokenizer     {s['tokenizer']}",
        f"pack format   {s['pack_format']}",
    ]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ValidationResult:
    bundle: Path
    objects: int
    checked_checksums: bool
    bad_objects: list[ObjectChecksumError]

    @property
    def ok(self) -> bool:
        return not self.bad_objects


def validate(path: str | Path, *, full: bool) -> ValidationResult:
    """Structure always (open_bundle raises on the first problem); every checksum with full."""
    with open_bundle(path) as bundle:
        bad = bundle.pack.verify_all() if full else []
        return ValidationResult(bundle.path, len(bundle.pack.objects), full, bad)
