"""The model's own sampling defaults: the keys of the bundle's generation_config.json that vLLM applies.

A request that omits one of these fields gets the model's value (e.g. Qwen3's temperature 0.6,
top_p 0.95, top_k 20); what the request sets always wins. Only keys written in the file count:
transformers' GenerationConfig fills unset ones with its own defaults (top_k 50), which are not
the model's.
"""

from __future__ import annotations

import json
from pathlib import Path

from inference.engine.errors import EngineError, InvalidRequestError
from inference.engine.params import SamplingParams

FILE = "generation_config.json"
# generation_config.json key -> request field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class GenerationConfigError(EngineError):
    """The bundle's generation_config.json holds a value no request could ask for."""


def read_generation_defaults(bundle_dir: str | Path) -> dict[str, float | int]:
    """{request field: value} from `bundle_dir`/generation_config.json; {} when there is none."""
    path = Path(bundle_dir) / FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"{path}: cannot read: {exc}") from exc
    defaults = {field: raw[key] for key, field in FIELDS.items() if raw.get(key) is not None}
    max_tokens = defaults.get("max_tokens", 1)
    try:  # checked now, not in every request that would inherit a bad value
        SamplingParams(**{"max_tokens": max_tokens, **{k: v for k, v in defaults.items() if k != "max_tokens"}})
    except InvalidRequestError as exc:
        raise GenerationConfigError(f"{path}: {exc} (start with --generation-config none to ignore the file)") from exc
    return defaults
