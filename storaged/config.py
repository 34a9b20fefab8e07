"""storaged's configuration: one frozen, validated dataclass filled from TOML, then CLI flags.

    config = load_config(Path("storaged.toml"), overrides={"vram_cache_bytes": "8GiB"})

Every field is checked in __post_init__; a bad value raises ConfigError naming the field and
the value, so the daemon can print it and exit before touching any device or file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from servicekit.toml_file import TomlFileError, read_toml

DEFAULT_SOCKET = "/run/expertpack/storaged.sock"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9464"
METRICS_OFF = ("", "off")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DEVICE_PATTERN = re.compile(r"^(cpu|cuda:(\d+))$")


class ConfigError(ValueError):
    """A configuration value is wrong; names the field (or file) and the offending value."""

    def __init__(self, field: str, value: Any, problem: str):
        super().__init__(f"config field {field!r} = {value!r}: {problem}")
        self.field = field
        self.value = value


def _kind(value: Any) -> str:
    """What a TOML value is, in TOML's words, for a message about a value of the wrong type."""
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
             (list, "an array"), (Mapping, "a table"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def parse_size(value: int | str, field: str = "size") -> int:
    """Bytes from an int or a string such as "8GiB", "512 MiB", "1.5G" (decimal) or "4096"."""
    if isinstance(value, bool):
        raise ConfigError(field, value, "expected a byte count, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, value, "a size cannot be negative")
        return value
    if not isinstance(value, str):
        raise ConfigError(field, value, "expected a byte count or a string such as '8GiB'")
    match = _SIZE_PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(field, value, "not a size; use a byte count or a number with a unit "
                          "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    nbytes = float(match.group(1)) * _SIZE_UNITS[unit]
    if nbytes != int(nbytes):
        raise ConfigError(field, value, "not a whole number of bytes")
    return int(nbytes)


FLAG = "flag"  # the key of a field's Flag in its dataclasses metadata


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a config field is given on the command line (storaged.cli builds its parser from
    these): `--<field name with - for _>`, overriding the TOML file's value. `type` converts the
    flag's text; None takes the field's type (bool: a --x/--no-x pair; Path: text). Sizes stay
    text, for parse_size."""

    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None


def _flag(help: str, *, default: Any = dataclasses.MISSING, type: Callable[[str], Any] | None = None,
          metavar: str | None = None) -> Any:
    return dataclasses.field(default=default, metadata={FLAG: Flag(help, type, metavar)})


@dataclasses.dataclass(frozen=True)
class StoragedConfig:
    """Everything the daemon is told. Sizes are in bytes; paths are absolute after validation.
    A field with a Flag is also a command-line flag; `models` has its own (--model NAME=DIR), and
    the peer allow-lists are set in the TOML file only."""

    models: Mapping[str, Path]  # model name → bundle directory
    vram_cache_bytes: int = _flag("arena byte budget, e.g. 8GiB (slot count = this // slot size)", type=str,
                                  metavar="SIZE")
    socket: Path = _flag("Unix socket path", default=Path(DEFAULT_SOCKET), metavar="PATH")
    host_cache_bytes: int = _flag("pinned host-RAM tier byte budget, e.g. 16GiB; 0 = off", default=0, type=str,
                                  metavar="SIZE")
    staging_buffers: int = _flag("aligned host buffers pack reads land in", default=8)
    io_parallelism: int = _flag("pack reads in flight", default=4)
    direct_io: bool = _flag("O_DIRECT pack reads (bypass the page cache)", default=True)
    verify_checksums: bool = _flag("crc32 of every object read, before its slot is published", default=True)
    # A restarted daemon otherwise serves its first requests from the disk, expert by expert.
    preload: bool = _flag("at start, fill the VRAM arena and then the host tier with each model's experts (its "
                          "layers in turn, expert ids in order) at prefetch priority, while serving", default=False)
    # For a CUDA arena, which every client that maps it can write (server/hit_verify.py).
    verify_hits: float = _flag("share of cache hits re-checked against their checksum before they are served: "
                               "0 off, 1.0 every hit, between: a random sample", default=0.0, metavar="FRACTION")
    metrics_address: str = _flag("host:port of the Prometheus endpoint, or 'off'",
                                 default=DEFAULT_METRICS_ADDRESS, metavar="HOST:PORT")
    device: str = _flag("'cpu' (shared-memory arena) or 'cuda:N'", default="cpu")
    shutdown_grace_seconds: float = _flag("time in-flight RPCs get to finish on SIGTERM", default=5.0)
    # One stuck client must not stall everyone's misses (server/fences.py).
    fence_timeout_seconds: float = _flag("how long a session may stay mid-step (reading the slot map on the "
                                         "device) while a slot it may read waits for reuse; then its step "
                                         "fence is revoked", default=10.0)
    max_ids_per_acquire: int = _flag("most expert ids in one Acquire or Prefetch (Kimi-K2: 384 a layer)",
                                     default=1024)
    # Peer-credential allow-lists (SO_PEERCRED): when either is set, a client is served only if
    # its uid is in allowed_uids or its gid or a supplementary group is in allowed_gids; the
    # others get PERMISSION_DENIED. Unset (None): whoever the socket's mode and group let in.
    allowed_uids: tuple[int, ...] | None = None
    allowed_gids: tuple[int, ...] | None = None
    # Attached and never streamed, or its client died before streaming.
    session_idle_seconds: float = _flag("close a session without an Acquire stream or data plane connection "
                                        "after this long", default=60.0)
    max_sessions_per_peer: int = _flag("most live sessions one uid may hold (Attach beyond it: "
                                       "RESOURCE_EXHAUSTED); 0 = no bound", default=256)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once, here only
        if not isinstance(self.models, Mapping):
            raise ConfigError("models", self.models, f"expected a table of name = bundle directory (TOML "
                              f"[models] section), got {_kind(self.models)}")
        if not self.models:
            raise ConfigError("models", self.models, "at least one model (name = bundle directory) is needed")
        models = {}
        for name, path in self.models.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
                raise ConfigError("models", name, "a model name is letters, digits, '.', '_' or '-'")
            if not isinstance(path, (str, Path)) or not str(path):
                raise ConfigError(f"models.{name}", path, "expected the path of a bundle directory")
            models[name] = Path(path).expanduser().absolute()
        set_(self, "models", models)
        if not isinstance(self.socket, (str, Path)) or not str(self.socket):
            raise ConfigError("socket", self.socket, "expected a filesystem path")
        set_(self, "socket", Path(self.socket).expanduser().absolute())
        set_(self, "vram_cache_bytes", parse_size(self.vram_cache_bytes, "vram_cache_bytes"))
        if self.vram_cache_bytes == 0:
            raise ConfigError("vram_cache_bytes", 0, "the arena needs at least one slot")
        set_(self, "host_cache_bytes", parse_size(self.host_cache_bytes, "host_cache_bytes"))
        for field in ("staging_buffers", "io_parallelism", "max_ids_per_acquire"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(field, value, "expected a positive integer")
        for field in ("direct_io", "verify_checksums", "preload"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(field, getattr(self, field), "expected true or false")
        set_(self, "verify_hits", self._checked_verify_hits())
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.match(self.device):
            raise ConfigError("device", self.device, "expected 'cpu' or 'cuda:N'")
        grace = self.shutdown_grace_seconds
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace <= 3600:
            raise ConfigError("shutdown_grace_seconds", grace, "expected seconds between 0 and 3600")
        set_(self, "shutdown_grace_seconds", float(grace))
        fence = self.fence_timeout_seconds
        if isinstance(fence, bool) or not isinstance(fence, (int, float)) or not 0.01 <= fence <= 3600:
            raise ConfigError("fence_timeout_seconds", fence, "expected seconds between 0.01 and 3600")
        set_(self, "fence_timeout_seconds", float(fence))
        idle = self.session_idle_seconds
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not 0.1 <= idle <= 86400:
            raise ConfigError("session_idle_seconds", idle, "expected seconds between 0.1 and 86400")
        set_(self, "session_idle_seconds", float(idle))
        bound = self.max_sessions_per_peer
        if isinstance(bound, bool) or not isinstance(bound, int) or not 0 <= bound <= 1_000_000:
            raise ConfigError("max_sessions_per_peer", bound, "expected an integer between 0 (no bound) and 1000000")
        set_(self, "metrics_address", self._checked_metrics_address())
        for field in ("allowed_uids", "allowed_gids"):
            set_(self, field, self._checked_ids(field))

    def _checked_verify_hits(self) -> float:
        rate = self.verify_hits
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:  # NaN fails too
            raise ConfigError("verify_hits", rate, "expected the share of hits to verify, from 0 (off) to 1.0 "
                              "(every hit)")
        if rate and not self.verify_checksums:
            raise ConfigError("verify_hits", rate, "needs verify_checksums = true: a hit is checked against the "
                              "checksum its load was verified with, and one that fails is reloaded from the pack, "
                              "which must then be verified too")
        return float(rate)

    def _checked_metrics_address(self) -> str:
        address = self.metrics_address
        if not isinstance(address, str):
            raise ConfigError("metrics_address", address, "expected 'host:port', '' or 'off'")
        if address.strip().lower() in METRICS_OFF:
            return ""
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("metrics_address", address, "expected 'host:port' (port 1-65535), '' or 'off'")
        return address

    def _checked_ids(self, field: str) -> tuple[int, ...] | None:
        ids = getattr(self, field)
        if ids is None:
            return None
        if isinstance(ids, (str, bytes)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(field, ids, "expected a list of non-negative integer ids")
        if not ids:
            # Most likely a template left half-filled; admitting nobody is never what was meant.
            raise ConfigError(field, list(ids), "an empty list admits nobody; list ids or leave the key out")
        return tuple(ids)

    @property
    def peer_checks_enabled(self) -> bool:
        return self.allowed_uids is not None or self.allowed_gids is not None

    @property
    def identifies_peers(self) -> bool:
        """Whether each connection's peer credentials must be known: for an allow-list, or to count
        sessions per peer."""
        return self.peer_checks_enabled or self.max_sessions_per_peer > 0

    @property
    def metrics_enabled(self) -> bool:
        return bool(self.metrics_address)

    @property
    def cuda_device_index(self) -> int | None:
        match = _DEVICE_PATTERN.match(self.device)
        assert match is not None  # validated in __post_init__
        return int(match.group(2)) if match.group(2) is not None else None


FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(StoragedConfig))


def config_from_mapping(values: Mapping[str, Any], *, source: str = "config") -> StoragedConfig:
    """Build a config from a flat mapping (a parsed TOML table); unknown keys are an error."""
    unknown = sorted(set(values) - FIELD_NAMES)
    if unknown:
        raise ConfigError(source, unknown, f"unknown key(s) {', '.join(unknown)}; "
                          f"known keys: {', '.join(sorted(FIELD_NAMES))}")
    missing = [name for name in ("models", "vram_cache_bytes") if name not in values]
    if missing:
        raise ConfigError(source, None, f"required key(s) missing: {', '.join(missing)}")
    return StoragedConfig(**values)


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML file's table, with relative bundle paths made relative to the file's directory."""
    try:
        values = read_toml(path)
    except TomlFileError as exc:
        raise ConfigError("--config", str(path), exc.problem) from None
    if isinstance(values.get("models"), Mapping):
        # Relative bundle paths are relative to the config file, not to the daemon's cwd.
        base = Path(path).absolute().parent
        values["models"] = {name: base / Path(p).expanduser() if isinstance(p, str) else p
                            for name, p in values["models"].items()}
    return values


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None, *,
                extra_models: Mapping[str, str | Path] | None = None) -> StoragedConfig:
    """Read a TOML file (optional), then apply overrides (CLI flags; None values are ignored).

    `extra_models` are added to the file's models, replacing any of the same name.
    """
    values = read_config_file(path) if path is not None else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    if extra_models:
        file_models = values.get("models", {})
        if not isinstance(file_models, Mapping):  # never dropped silently in favour of the flags
            raise ConfigError("models", file_models, f"expected a table of name = bundle directory (TOML "
                              f"[models] section), got {_kind(file_models)}")
        values["models"] = {**file_models, **extra_models}
    return config_from_mapping(values, source=str(path) if path is not None else "command line")
