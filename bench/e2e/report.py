"""results.json and results.md of the end-to-end benchmark, including the I/O efficiency of every
SSD-bound run: decode tok/s x SSD bytes per token / raw O_DIRECT GB/s (1.0 = the disk's limit)."""

from __future__ import annotations

import json
from pathlib import Path

SSD_BOUND_MIN_BYTES_PER_TOKEN = 1  # a run that read nothing during decode is not SSD-bound


def add_io_efficiency(results: dict) -> None:
    """io_efficiency on every e2e run that read from the disk, against results['machine']['raw_odirect_gbps']."""
    raw = (results.get("machine") or {}).get("raw_odirect_gbps")
    for run in results.get("e2e", {}).get("runs", []):
        per_token = run.get("ssd_bytes_per_token")
        if raw and per_token and per_token >= SSD_BOUND_MIN_BYTES_PER_TOKEN and run.get("decode_tok_s"):
            run["ssd_gbps"] = run["decode_tok_s"] * per_token / 1e9
            run["io_efficiency"] = run["ssd_gbps"] / raw


def _number(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _megabytes(value) -> str:
    return "–" if value is None else f"{value / 1e6:.1f}"


def markdown(results: dict) -> str:
    lines = ["# expertpack end-to-end benchmark", ""]
    machine = results.get("machine") or {}
    if machine:
        lines += ["## Machine limits and storaged alone", "", "| figure | value |", "|---|---|"]
        lines += [f"| {key} | {_number(value, 3)} |" for key, value in machine.items()]
        lines.append("")
    e2e = results.get("e2e", {})
    for model in e2e.get("models", []):
        shape = model["shape"]
        lines.append(f"- **{shape['name']}**: {model['layers']} layers ({model['moe_layers']} MoE), {shape['experts']} "
                     f"experts, top-{shape['top_k']}, hidden {shape['hidden']}, moe_intermediate "
                     f"{shape['moe_intermediate']}, {shape['expert_type']} experts; {model['expert_bytes_total'] / 1e9:.2f} "
                     f"GB of experts{'; ' + shape['note'] if shape.get('note') else ''}")
    if e2e.get("runs"):
        lines += ["", "## End to end", "",
                  "| shape | contender | VRAM budget | prefill tok/s | decode tok/s | tokens | experts from memory | "
                  "SSD MB/token | I/O efficiency | notes |", "|---|---|---|---|---|---|---|---|---|---|"]
        for run in e2e["runs"]:
            status = run.get("skipped") and f"skipped: {run['skipped']}" or run.get("error") and \
                f"ERROR: {run['error'].splitlines()[0]}"
            notes = "; ".join(([status] if status else []) + run.get("notes", []))
            lines.append(f"| {run['shape']} | {run['contender']} | {run['budget_fraction']:.0%} | "
                         f"{_number(run.get('prefill_tok_s'))} | {_number(run.get('decode_tok_s'))} | "
                         f"{_number(run.get('tokens'))} | {_number(run.get('from_memory'), 3)} | "
                         f"{_megabytes(run.get('ssd_bytes_per_token'))} | {_number(run.get('io_efficiency'), 3)} | "
                         f"{notes.replace('|', '/')} |")
    lines += ratio_lines(e2e.get("runs", []))
    for title, key in (("Statements", "statements"), ("Warnings", "warnings"), ("Errors", "errors")):
        if results.get(key):
            lines += ["", f"## {title}", ""] + [f"- {line}" for line in results[key]]
    return "\n".join(lines) + "\n"


BASELINES = ("storaged_serial", "gguf_mmap", "accelerate", "llamacpp")


# the storaged variants each baseline is compared with: as started cold, as an operator's
# restarted daemon with preload = true serves (timed once its preload ended), and with the
# daemon's default reads in flight (4, not 16)
RATIO_VARIANTS = ("storaged", "storaged_preload", "storaged_preload_cpu", "storaged_io4")


def ratio_lines(runs: list[dict]) -> list[str]:
    """Each of RATIO_VARIANTS' decode tok/s over each baseline's at the same shape and budget, and
    over the fully resident model's (the upper bound, run at 100% only)."""
    speed = {(r["shape"], r["contender"], r["budget_fraction"]): r["decode_tok_s"]
             for r in runs if r.get("decode_tok_s")}
    resident = {shape: tok_s for (shape, name, _), tok_s in speed.items() if name == "resident"}
    rows = []
    for (shape, name, fraction), tok_s in sorted(speed.items()):
        if name not in RATIO_VARIANTS:
            continue
        cells = [_ratio(tok_s, speed.get((shape, base, fraction))) for base in BASELINES]
        rows.append(f"| {shape} | {name} | {fraction:.0%} | {' | '.join(cells)} | {_ratio(tok_s, resident.get(shape))} |")
    if not rows:
        return []
    return ["", "## Decode speed ratios (storaged ÷ contender, same shape and budget)", "",
            "| shape | storaged | VRAM budget | ÷ storaged_serial | ÷ gguf_mmap | ÷ accelerate | ÷ llamacpp | "
            "÷ resident (100%) |",
            "|---|---|---|---|---|---|---|---|", *rows, *llamacpp_ratio_lines(runs), *lookahead_lines(runs)]


LOOKAHEAD_MAX_EXTRA_BYTES = 0.15  # hints may add at most this share of SSD bytes per token


def lookahead_lines(runs: list[dict]) -> list[str]:
    """storaged (lookahead hints) against storaged_no_lookahead at the same shape and budget: SSD
    bytes per token with ÷ without, and decode tok/s with ÷ without."""
    by_key = {(r["shape"], r["contender"], r["budget_fraction"]): r for r in runs if r.get("decode_tok_s")}
    rows = []
    for (shape, name, fraction), hinted in sorted(by_key.items()):
        plain = by_key.get((shape, "storaged_no_lookahead", fraction))
        if name != "storaged" or plain is None:
            continue
        with_bytes, without = hinted.get("ssd_bytes_per_token"), plain.get("ssd_bytes_per_token")
        extra = "–" if not without or with_bytes is None else \
            ("within" if with_bytes / without <= 1 + LOOKAHEAD_MAX_EXTRA_BYTES else "over")
        rows.append(f"| {shape} | {fraction:.0%} | {_megabytes(with_bytes)} | {_megabytes(without)} | "
                    f"{_ratio(with_bytes, without)} ({extra}) | {_ratio(hinted['decode_tok_s'], plain['decode_tok_s'])} |")
    if not rows:
        return []
    return ["", f"### Lookahead hints: with ÷ without (at most +{LOOKAHEAD_MAX_EXTRA_BYTES:.0%} SSD bytes)", "",
            "| shape | VRAM budget | SSD MB/token with | without | bytes ratio | decode ratio |",
            "|---|---|---|---|---|---|", *rows]


def llamacpp_ratio_lines(runs: list[dict]) -> list[str]:
    """Each of RATIO_VARIANTS ÷ llama.cpp, decode and prefill, per shape and budget (same GGUF, same RAM
    limit rules), with llama.cpp's placement of the experts at that budget."""
    by_key = {(r["shape"], r["contender"], r["budget_fraction"]): r for r in runs if r.get("decode_tok_s")}
    rows = []
    for (shape, name, fraction), ours in sorted(by_key.items()):
        peer = by_key.get((shape, "llamacpp", fraction))
        if name not in RATIO_VARIANTS or peer is None:
            continue
        placement = peer.get("llamacpp", {})
        rows.append(f"| {shape} | {name} | {fraction:.0%} | {_ratio(ours['decode_tok_s'], peer['decode_tok_s'])} | "
                    f"{_ratio(ours.get('prefill_tok_s'), peer.get('prefill_tok_s'))} | "
                    f"{_number(peer['decode_tok_s'])} | {_number(peer.get('prefill_tok_s'))} | "
                    f"{placement.get('n_cpu_moe', '–')} | {placement.get('moe_layers_in_vram', '–')} |")
    if not rows:
        return []
    return ["", "### storaged ÷ llama.cpp (same GGUF, same budget)", "",
            "| shape | storaged | VRAM budget | decode ratio | prefill ratio | llama.cpp decode tok/s | "
            "llama.cpp prefill tok/s | --n-cpu-moe | MoE layers in VRAM |", "|---|---|---|---|---|---|---|---|---|", *rows]


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if not base or value is None else f"{value / base:.2f}×"


def write_results(results: dict, out_dir: Path) -> tuple[Path, Path]:
    """results.json and results.md in out_dir (written again at every checkpoint)."""
    add_io_efficiency(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    json_path.write_text(json.dumps(results, indent=1, default=str))
    md_path.write_text(markdown(results))
    return json_path, md_path
