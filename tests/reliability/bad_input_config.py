"""Bad-input rows for storaged's TOML file and its command-line flags.

Each row is one mistake an operator can make, starting from a good configuration (the BASE file,
or the BASE file plus flags), and what storaged must answer: its exit status, and words that name
the offending key, flag or value, on one line of stderr, with no traceback. `{bundle}` and
`{socket}` in a row stand for a good bundle directory and a socket path.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_STARTUP = 1  # storaged.cli: a bundle or the device cannot be opened
EXIT_CONFIG = 2  # a bad configuration (also argparse's status for a bad flag)


@dataclass(frozen=True)
class Row:
    surface: str  # "TOML", "CLI flags" or "bundles"
    id: str
    status: int  # the exit status storaged must give
    needles: tuple[str, ...]  # each must appear in stderr


BASE = '''vram_cache_bytes = "1MiB"
socket = "{socket}"
metrics_address = "off"
[models]
tiny = "{bundle}"
'''


@dataclass(frozen=True)
class TomlRow(Row):
    text: str | bytes = ""  # the whole file (bytes: not UTF-8)


@dataclass(frozen=True)
class CliRow(Row):
    args: tuple[str, ...] = ()  # after `storaged`
    with_base: bool = True  # `--config BASE` comes first


def _set(key: str, value: str) -> str:
    """BASE with `key = value` added (before the [models] table) or replacing the key's line."""
    lines = [line for line in BASE.splitlines() if not line.startswith(f"{key} =")]
    at = lines.index("[models]")
    return "\n".join([*lines[:at], f"{key} = {value}", *lines[at:]]) + "\n"


def _toml(id_: str, text: str | bytes, *needles: str, status: int = EXIT_CONFIG) -> TomlRow:
    prefix = ("storaged: configuration error",) if status == EXIT_CONFIG else ()
    return TomlRow("TOML", id_, status, (*prefix, *needles), text)


def _field(key: str, value: str, *needles: str) -> TomlRow:
    return _toml(f"{key}={value}", _set(key, value), f"'{key}'", *needles)


TOML_ROWS: list[TomlRow] = [
    _toml("not-toml", BASE + "vram_cache_bytes = \n", "not valid TOML"),
    _toml("unterminated-string", 'vram_cache_bytes = "1MiB\n', "not valid TOML"),
    _toml("not-utf8", BASE.encode() + b'device = "\xff\xfe"\n', "UTF-8"),
    _toml("duplicate-key", BASE.replace('metrics_address = "off"', 'metrics_address = "off"\nsocket = "/x"'),
          "not valid TOML"),
    _toml("empty-file", "", "required key(s) missing: models, vram_cache_bytes"),
    _toml("no-models", BASE.split("[models]")[0], "required key(s) missing: models"),
    _toml("no-vram-cache-bytes", BASE.replace('vram_cache_bytes = "1MiB"\n', ""), "vram_cache_bytes"),
    _toml("unknown-key-typo", _set("verify_checksum", "true"), "unknown key(s) verify_checksum"),
    _toml("unknown-key-cased", _set("Device", '"cpu"'), "unknown key(s) Device"),
    _toml("unknown-table", BASE + "[server]\nport = 1\n", "unknown key(s) server"),
    _toml("models-empty", BASE.split("[models]")[0] + "[models]\n", "'models'", "at least one model"),
    _toml("models-a-string", BASE.split("[models]")[0] + 'models = "x"\n', "models"),
    _toml("models-a-number", BASE.split("[models]")[0] + "models = 3\n", "models"),
    _toml("models-array-of-tables", BASE.split("[models]")[0] + '[[models]]\ntiny = "{bundle}"\n', "models"),
    _toml("model-name-space", BASE.replace("tiny =", '"bad name" ='), "'bad name'", "a model name is"),
    _toml("model-name-dot", BASE.replace("tiny =", '".hidden" ='), "'.hidden'", "a model name is"),
    _toml("model-name-slash", BASE.replace("tiny =", '"a/b" ='), "'a/b'", "a model name is"),
    # an empty path is relative to the file's directory, like any relative one: not a bundle there
    _toml("model-path-empty", BASE.replace('tiny = "{bundle}"', 'tiny = ""'), "storaged: error: model 'tiny'",
          "manifest.json: missing", status=EXIT_STARTUP),
    _toml("model-path-number", BASE.replace('tiny = "{bundle}"', "tiny = 3"), "models.tiny"),
    _toml("model-path-table", BASE.replace('tiny = "{bundle}"', "tiny = { path = 1 }"), "models.tiny"),
    _field("vram_cache_bytes", "-1", "cannot be negative"),
    _field("vram_cache_bytes", "0", "at least one slot"),
    _field("vram_cache_bytes", '"1.5B"', "not a whole number"),
    _field("vram_cache_bytes", "true", "boolean"),
    _field("vram_cache_bytes", "1.5", "expected a byte count"),
    _field("vram_cache_bytes", '"8 XB"', "not a size"),
    _field("vram_cache_bytes", "[1]", "expected a byte count"),
    _field("vram_cache_bytes", '"0x10"', "not a size"),
    _field("host_cache_bytes", '"-1GiB"', "not a size"),
    _field("host_cache_bytes", '"lots"', "not a size"),
    _field("staging_buffers", "0", "positive integer"),
    _field("staging_buffers", '"8"', "positive integer"),
    _field("staging_buffers", "true", "positive integer"),
    _field("io_parallelism", "-3", "positive integer"),
    _field("io_parallelism", "2.5", "positive integer"),
    _field("max_ids_per_acquire", "0", "positive integer"),
    _field("direct_io", '"yes"', "true or false"),
    _field("direct_io", "1", "true or false"),
    _field("verify_checksums", '"false"', "true or false"),
    _field("verify_hits", "1.5", "from 0 (off) to 1.0"),
    _field("verify_hits", "-0.1", "from 0 (off) to 1.0"),
    _field("verify_hits", "nan", "from 0 (off) to 1.0"),
    _field("verify_hits", "true", "from 0 (off) to 1.0"),
    _toml("verify_hits-without-checksums", _set("verify_hits", "0.5").replace(
        "[models]", "verify_checksums = false\n[models]"), "'verify_hits'", "needs verify_checksums = true"),
    _field("metrics_address", '"localhost"', "host:port"),
    _field("metrics_address", '"127.0.0.1:0"', "port 1-65535"),
    _field("metrics_address", '"127.0.0.1:70000"', "port 1-65535"),
    _field("metrics_address", "9464", "host:port"),
    _field("device", '"cuda"', "'cpu' or 'cuda:N'"),
    _field("device", '"gpu:0"', "'cpu' or 'cuda:N'"),
    _field("device", '"cuda:-1"', "'cpu' or 'cuda:N'"),
    _field("device", "0", "'cpu' or 'cuda:N'"),
    _field("shutdown_grace_seconds", "-1", "between 0 and 3600"),
    _field("shutdown_grace_seconds", "7200", "between 0 and 3600"),
    _field("shutdown_grace_seconds", '"5s"', "between 0 and 3600"),
    _field("shutdown_grace_seconds", "inf", "between 0 and 3600"),
    _field("fence_timeout_seconds", "0", "between 0.01 and 3600"),
    _field("fence_timeout_seconds", '"10"', "between 0.01 and 3600"),
    _field("allowed_uids", "[]", "admits nobody"),
    _field("allowed_uids", "[-1]", "non-negative integer ids"),
    _field("allowed_uids", '"1000"', "non-negative integer ids"),
    _field("allowed_gids", "[true]", "non-negative integer ids"),
    _field("allowed_gids", "[1.5]", "non-negative integer ids"),
    _field("socket", '""', "expected a filesystem path"),
    _field("socket", "5", "expected a filesystem path"),
]


def _cli(id_: str, args: tuple[str, ...], *needles: str, status: int = EXIT_CONFIG, with_base: bool = True) -> CliRow:
    return CliRow("CLI flags", id_, status, needles, args, with_base)


def _flag(flag: str, value: str, *needles: str) -> CliRow:
    field = flag.removeprefix("--").replace("-", "_")
    return _cli(f"{flag}={value}", (flag, value), "storaged: configuration error", f"'{field}'", *needles)


def _usage(flag: str, value: str, *needles: str) -> CliRow:
    """A value argparse itself refuses (exit 2 with the usage line naming the flag)."""
    return _cli(f"{flag}={value}", (f"{flag}={value}",), "usage: storaged", f"argument {flag}", *needles)


CLI_ROWS: list[CliRow] = [
    _flag("--vram-cache-bytes", "lots", "not a size"),
    _flag("--vram-cache-bytes", "-5", "not a size"),
    _flag("--vram-cache-bytes", "0", "at least one slot"),
    _flag("--host-cache-bytes", "1.5B", "not a whole number"),
    _usage("--staging-buffers", "x", "invalid int value: 'x'"),
    _flag("--staging-buffers", "0", "positive integer"),
    _usage("--io-parallelism", "2.5", "invalid int value: '2.5'"),
    _flag("--io-parallelism", "-1", "positive integer"),
    _flag("--max-ids-per-acquire", "0", "positive integer"),
    _flag("--verify-hits", "2", "from 0 (off) to 1.0"),
    _usage("--verify-hits", "abc", "invalid float value: 'abc'"),
    _flag("--verify-hits", "nan", "from 0 (off) to 1.0"),
    _cli("--verify-hits-without-checksums", ("--verify-hits", "0.5", "--no-verify-checksums"),
         "'verify_hits'", "needs verify_checksums = true"),
    _flag("--metrics-address", "nowhere", "host:port"),
    _flag("--metrics-address", "127.0.0.1:99999", "port 1-65535"),
    _flag("--device", "tpu", "'cpu' or 'cuda:N'"),
    _flag("--device", "cuda:x", "'cpu' or 'cuda:N'"),
    _flag("--shutdown-grace-seconds", "-1", "between 0 and 3600"),
    _flag("--shutdown-grace-seconds", "inf", "between 0 and 3600"),
    _usage("--shutdown-grace-seconds", "soon", "invalid float value: 'soon'"),
    _flag("--fence-timeout-seconds", "0", "between 0.01 and 3600"),
    _flag("--socket", "", "expected a filesystem path"),
    _usage("--model", "tiny", "expected NAME=BUNDLE_DIR, got 'tiny'"),
    _usage("--model", "=/srv/x", "expected NAME=BUNDLE_DIR"),
    _usage("--model", "tiny=", "expected NAME=BUNDLE_DIR"),
    _cli("--model-bad-name", ("--model", "bad name={bundle}"), "'bad name'", "a model name is"),
    _cli("unknown-flag", ("--cache-size", "1GiB"), "usage: storaged", "unrecognized arguments: --cache-size"),
    _cli("ambiguous-abbreviation", ("--verify", "1"), "usage: storaged", "ambiguous option: --verify could match"),
    _cli("positional-argument", ("storaged.toml",), "usage: storaged", "unrecognized arguments: storaged.toml"),
    _cli("flag-without-value", ("--vram-cache-bytes",), "usage: storaged", "argument --vram-cache-bytes",
         "expected one argument"),
    _cli("boolean-flag-with-value", ("--direct-io=yes",), "usage: storaged", "argument --direct-io",
         "ignored explicit argument 'yes'"),
    _cli("config-missing", ("--config", "/nonexistent/storaged.toml"), "'--config'",
         "/nonexistent/storaged.toml", "file not found", with_base=False),
    _cli("config-a-directory", ("--config", "/"), "'--config'", "cannot read", with_base=False),
    _cli("nothing-given", (), "command line", "required key(s) missing: models, vram_cache_bytes", with_base=False),
    _cli("no-cache-size", ("--model", "tiny={bundle}"), "required key(s) missing: vram_cache_bytes",
         with_base=False),
    _cli("second-model-missing-bundle", ("--model", "other={socket}.none"), "storaged: error: model 'other'",
         "not a bundle directory", status=EXIT_STARTUP),
]
