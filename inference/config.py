"""The inference process's configuration, and the expert source factory.

`inference serve` reads one frozen ServeConfig (its ModelConfig inside), filled from an optional
TOML file (flat keys, the field names below) and then from command-line flags:

    config = load_serve_config(Path("inference.toml"), overrides={"port": 8001})

Every field is checked in __post_init__; a bad value raises ConfigError naming the field and the
value, so the process can say so and exit before loading anything. `inference generate` reads a
GenerateConfig (a ModelConfig, the prompt and its SamplingParams) from its flags. The flags
themselves are inference.cli's; nothing here sees an argparse.Namespace.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from inference.engine.params import SamplingParams
from inference.engine.scheduler import DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFILL_CHUNK
from inference.engine.timed_source import TimedExpertSource
from inference.experts import COMPUTE_MODES, ExpertSource, LocalPackSource
from inference.experts.hint_policy import DEFAULT_MIN_PRECISION
from inference.model import LoadedModel, load_model
from packformat.bundle import Bundle
from servicekit.toml_file import TomlFileError, read_toml

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEVICES = ("cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
GENERATION_CONFIG_CHOICES = ("auto", "none")
API_KEY_ENV = "INFERENCE_API_KEY"
DEFAULT_MAX_QUEUE = 256
MAX_NUM_SEQS_LIMIT = 256


class ConfigError(ValueError):
    """A configuration value is wrong; names the field (or file) and the offending value."""

    def __init__(self, field: str, value: Any, problem: str):
        shown = "<hidden>" if field == "api_keys" else repr(value)  # keys must not reach a log
        super().__init__(f"config field {field!r} = {shown}: {problem}")
        self.field = field


class ExpertSourceNotAvailableError(Exception):
    """The expert source chosen on the command line cannot be used: the storaged daemon is not
    reachable, does not serve the model, or serves another bundle under its name."""


def _positive_int(field: str, value, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "expected a positive integer")


def _choice(field: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(field, value, f"expected one of {', '.join(choices)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which bundle, where it runs, and where its experts come from (storaged, or the pack itself)."""

    bundle: Path
    device: str = "cpu"
    dtype: str = "bfloat16"
    torch_threads: int | None = None
    storaged: str | None = None  # storaged's Unix socket; None: read the pack directly
    storaged_model: str | None = None  # storaged's name for the bundle; default: the bundle directory's name
    experts_compute: str = "auto"  # auto | exact | fused (inference.experts.resolve_compute)
    # experts per token each MoE layer predicts for the next and hints to storaged; 0 off;
    # "auto": 2 x the model's top-k with storaged, off without
    lookahead: int | str = "auto"
    # hints of a step width (one token / batched decode / prefill chunk) go out only while the
    # share of hinted experts the next layer used stays at least this (0: always); None: the
    # default, 0.87. Refused where lookahead is off (nothing to govern).
    lookahead_min_precision: float | None = None
    # decode through a static KV cache of this many tokens, each step one CUDA graph reading
    # experts via storaged's slot map, where the model allows it; 0 off
    static_cache_len: int = 4096
    # CPU threads computing a share of each decode step's host-tier experts beside the GPU
    # (inference.experts.cpu_experts); 0 off. Needs the CUDA static decoder and storaged's host tier.
    cpu_experts_threads: int = 0
    # the share of each layer's host-tier experts they take; None: tuned on the decode steps' times,
    # starting at cpu_experts.DEFAULT_SHARE (inference.experts.share_tuner)
    cpu_experts_share: float | None = None
    # the GPU's share of the host-tier experts copied to VRAM by the copy engine (a host thread
    # aims it at each layer's experts, inference.kernels.copy_agent) rather than read in place
    cpu_experts_copy_engine: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bundle, (str, Path)) or not str(self.bundle):
            raise ConfigError("bundle", self.bundle, "expected the path of a bundle directory")
        object.__setattr__(self, "bundle", Path(self.bundle).expanduser())
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, tuple(DTYPES))
        _positive_int("torch_threads", self.torch_threads)
        for field in ("storaged", "storaged_model"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(field, value, "expected a non-empty string")
        _choice("experts_compute", self.experts_compute, COMPUTE_MODES)
        if self.lookahead != "auto" and (isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int)
                                         or self.lookahead < 0):
            raise ConfigError("lookahead", self.lookahead, "expected a number of experts per token, 0, or 'auto'")
        if self.lookahead_min_precision is not None:
            value = self.lookahead_min_precision
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ConfigError("lookahead_min_precision", value, "expected a fraction from 0 to 1")
            if self.lookahead == 0 or (self.lookahead == "auto" and not self.storaged):
                raise ConfigError("lookahead_min_precision", value,
                                  "given with lookahead off (lookahead 0, or auto without storaged): there are "
                                  "no hints to govern")
        if isinstance(self.static_cache_len, bool) or not isinstance(self.static_cache_len, int) \
                or self.static_cache_len < 0:
            raise ConfigError("static_cache_len", self.static_cache_len, "expected a number of tokens (0: off)")
        if isinstance(self.cpu_experts_threads, bool) or not isinstance(self.cpu_experts_threads, int) \
                or self.cpu_experts_threads < 0:
            raise ConfigError("cpu_experts_threads", self.cpu_experts_threads, "expected a number of threads (0: off)")
        if self.cpu_experts_threads and not self.static_cache_len:
            raise ConfigError("cpu_experts_threads", self.cpu_experts_threads,
                              "CPU experts run inside the static decoder's steps: static_cache_len is 0")
        if self.cpu_experts_threads and not self.storaged:
            raise ConfigError("cpu_experts_threads", self.cpu_experts_threads,
                              "CPU experts compute storaged's host-tier experts: no storaged socket given")
        if self.cpu_experts_share is not None:
            value = self.cpu_experts_share
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError("cpu_experts_share", value, "expected a fraction in (0, 1]")
            if not self.cpu_experts_threads:
                raise ConfigError("cpu_experts_share", value, "given with cpu_experts_threads 0: nothing to share")
        if not isinstance(self.cpu_experts_copy_engine, bool):
            raise ConfigError("cpu_experts_copy_engine", self.cpu_experts_copy_engine, "expected true or false")
        if self.cpu_experts_copy_engine and not self.cpu_experts_threads:
            raise ConfigError("cpu_experts_copy_engine", self.cpu_experts_copy_engine,
                              "the copy agent runs beside the CPU experts: cpu_experts_threads is 0")

    def lookahead_for(self, model_config) -> int:
        """Experts per token to hint for the next layer, "auto" resolved for this model."""
        if self.lookahead != "auto":
            return self.lookahead
        if not self.storaged:
            return 0
        from packtools.arch import get_arch

        return get_arch(model_config.model_type).top_k(model_config)

    def cpu_experts(self):
        """The CpuExpertsConfig of cpu_experts_threads/share/copy_engine, or None (off)."""
        if not self.cpu_experts_threads:
            return None
        from inference.experts.cpu_experts import CpuExpertsConfig

        share = None if self.cpu_experts_share is None else float(self.cpu_experts_share)
        return CpuExpertsConfig(self.cpu_experts_threads, share, self.cpu_experts_copy_engine)

    def min_precision(self) -> float:
        """lookahead_min_precision, the default resolved."""
        return DEFAULT_MIN_PRECISION if self.lookahead_min_precision is None else float(self.lookahead_min_precision)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything `inference serve` is told. Seconds are floats; None switches a limit off."""

    model: ModelConfig
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # the id clients use; default: the bundle directory's name
    shutdown_timeout: float = 30.0  # how long in-flight requests may run on after SIGTERM
    max_model_len: int | None = None  # the context the server allows (at most the model's)
    max_tokens: int | None = None  # server-side cap on a request's max_tokens, and its default
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting while the batch is full; more get 429; 0: no limit
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # choices generated together in the running batch
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # most prompt tokens of a sequence in one batch step
    request_timeout: float = 0.0  # seconds from arrival, queue wait included; 0: no limit
    stall_timeout: float = 60.0  # /health is 503 once the busy worker made no progress this long; 0: never
    generation_config: str = "auto"  # "auto": the bundle's generation_config.json sampling defaults
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)  # Bearer keys; empty: no auth
    allowed_origins: tuple[str, ...] = ()  # CORS; "*" for any origin; empty: no CORS headers
    log_level: str = "info"
    log_format: str = "text"
    access_log: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ConfigError("model", self.model, "expected a ModelConfig")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError("host", self.host, "expected a host name or address")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError("port", self.port, "expected a port number (0 picks a free one)")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name):
            raise ConfigError("model_name", self.model_name, "expected a non-empty string")
        shutdown = self.shutdown_timeout
        if isinstance(shutdown, bool) or not isinstance(shutdown, (int, float)) or not 0 <= shutdown <= 3600:
            raise ConfigError("shutdown_timeout", shutdown, "expected seconds between 0 and 3600")
        for field in ("max_model_len", "max_tokens"):
            _positive_int(field, getattr(self, field))
        for field in ("max_num_seqs", "prefill_chunk"):
            _positive_int(field, getattr(self, field), optional=False)
        if self.max_num_seqs > MAX_NUM_SEQS_LIMIT:
            raise ConfigError("max_num_seqs", self.max_num_seqs, f"expected at most {MAX_NUM_SEQS_LIMIT} (one "
                              "thread per sequence runs its forward)")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ConfigError("max_queue", self.max_queue, "expected a number of requests (0: no limit)")
        if self.max_model_len is not None and self.max_tokens is not None and self.max_tokens >= self.max_model_len:
            raise ConfigError("max_tokens", self.max_tokens, f"must be below max_model_len ({self.max_model_len})")
        for field in ("request_timeout", "stall_timeout"):
            seconds = getattr(self, field)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
                raise ConfigError(field, seconds, "expected seconds (0: no limit)")
        _choice("generation_config", self.generation_config, GENERATION_CONFIG_CHOICES)
        if not isinstance(self.api_keys, tuple) or not all(isinstance(k, str) and k.strip() == k and k
                                                           for k in self.api_keys):
            raise ConfigError("api_keys", self.api_keys, "expected non-empty keys without surrounding spaces")
        if not isinstance(self.allowed_origins, tuple) or not all(isinstance(o, str) and o
                                                                  for o in self.allowed_origins):
            raise ConfigError("allowed_origins", self.allowed_origins, "expected origins such as "
                              "'https://app.example.com', or '*'")
        _choice("log_level", self.log_level, LOG_LEVELS)
        _choice("log_format", self.log_format, LOG_FORMATS)
        if not isinstance(self.access_log, bool):
            raise ConfigError("access_log", self.access_log, "expected true or false")

    @property
    def served_model_name(self) -> str:
        return self.model_name or default_model_name(self.model.bundle)


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """Everything `inference generate` is told: the model, one prompt and how to sample it."""

    model: ModelConfig
    prompt: str
    sampling: SamplingParams  # its values are checked by SamplingParams itself
    chat: bool = False  # send the prompt as a user message through the tokenizer's chat template

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ConfigError("model", self.model, "expected a ModelConfig")
        if not isinstance(self.prompt, str):
            raise ConfigError("prompt", self.prompt, "expected text")
        if not isinstance(self.chat, bool):
            raise ConfigError("chat", self.chat, "expected true or false")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError("sampling", self.sampling, "expected SamplingParams")


MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
SERVE_FIELDS = frozenset(f.name for f in dataclasses.fields(ServeConfig)) - {"model", "api_keys"}
FILE_ONLY_FIELDS = frozenset({"api_key_file"})  # read into api_keys


def read_api_key_file(path: str | os.PathLike) -> tuple[str, ...]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("api_key_file", str(path), f"cannot read: {exc.strerror}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ConfigError("api_key_file", str(path), "holds no key")
    return keys


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        values = read_toml(path)
    except TomlFileError as exc:
        raise ConfigError("--config", str(path), exc.problem) from None
    known = MODEL_FIELDS | SERVE_FIELDS | FILE_ONLY_FIELDS
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(str(path), unknown, f"unknown key(s) {', '.join(unknown)}; known keys: "
                          f"{', '.join(sorted(known))}")
    base = Path(path).absolute().parent
    for key in ("bundle", "api_key_file"):  # relative to the file, not to the server's cwd
        if isinstance(values.get(key), str):
            values[key] = str(base / Path(values[key]).expanduser())
    return values


def load_serve_config(path: Path | None, overrides: Mapping[str, Any] | None = None, *,
                      environ: Mapping[str, str] | None = None) -> ServeConfig:
    """The TOML file's values (optional), then overrides (flags; None values are ignored).

    API keys are the union of `api_keys` overrides, the lines of `api_key_file` and $INFERENCE_API_KEY.
    """
    values = read_config_file(path) if path is not None else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    keys = list(values.pop("api_keys", None) or ())
    key_file = values.pop("api_key_file", None)
    if key_file is not None:
        keys += read_api_key_file(key_file)
    env_key = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip()
    if env_key:
        keys.append(env_key)
    if "bundle" not in values:
        raise ConfigError(str(path) if path else "command line", None, "'bundle' is required (--bundle)")
    model = ModelConfig(**{k: v for k, v in values.items() if k in MODEL_FIELDS})
    serve = {k: tuple(v) if k == "allowed_origins" and isinstance(v, list) else v
             for k, v in values.items() if k in SERVE_FIELDS}
    return ServeConfig(model=model, api_keys=tuple(dict.fromkeys(keys)), **serve)


def make_expert_source(config: ModelConfig, bundle: Bundle, device: torch.device | str | None = None) -> ExpertSource:
    """The expert source `config` asks for, on `device` (default: the config's)."""
    device = torch.device(device if device is not None else config.device)
    if config.storaged:
        return _storaged_source(config.storaged, config.storaged_model or default_model_name(bundle.path), bundle,
                                device)
    # the wrapper reports the time spent in acquire (expert_wait_seconds) for the metrics
    return TimedExpertSource(LocalPackSource(bundle, device))


def _storaged_source(socket_path: str, model_name: str, bundle: Bundle, device: torch.device) -> ExpertSource:
    # imported here: grpc and the storaged client are only needed with --storaged
    from inference.experts.errors import ExpertsError
    from inference.experts.storaged_source import StoragedExpertSource
    from storaged.client import StorageError

    try:  # no waiting for the daemon: start it first (its systemd unit notifies READY once serving)
        return StoragedExpertSource(socket_path, model_name, bundle, device)
    except (StorageError, ExpertsError) as exc:
        raise ExpertSourceNotAvailableError(f"--storaged {socket_path} (model {model_name!r}): the storaged expert "
                                            f"source is not available: {exc}") from exc


def load_from_config(config: ModelConfig) -> LoadedModel:
    """Load the bundle as `config` says."""
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    from transformers import AutoConfig

    lookahead = config.lookahead_for(AutoConfig.from_pretrained(config.bundle))
    return load_model(config.bundle, device=config.device, dtype=DTYPES[config.dtype],
                      expert_source=lambda bundle, device: make_expert_source(config, bundle, device),
                      experts_compute=config.experts_compute, lookahead=lookahead,
                      lookahead_min_precision=config.min_precision())


def default_model_name(bundle_dir: str | os.PathLike) -> str:
    return os.path.basename(os.path.normpath(os.fspath(bundle_dir)))
