"""StoragedConfig: TOML + CLI overrides, sizes, and a typed error naming each bad field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from storaged.cli import build_parser, config_from_args, flag_fields, flag_name
from storaged.config import (DEFAULT_METRICS_ADDRESS, DEFAULT_SOCKET, ConfigError, StoragedConfig,
                             load_config, parse_size)


@pytest.mark.parametrize("text, expected", [
    (4096, 4096), ("4096", 4096), ("0", 0), ("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("1.5GiB", 3 << 29),
    ("2kib", 2048), ("1G", 10**9), ("3MB", 3 * 10**6), ("7B", 7), ("1TiB", 1 << 40),
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8 GiBs", "-1", -1, "1.5B", "8 XB", True, 2.5, "0x10"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError) as info:
        parse_size(text, "vram_cache_bytes")
    assert info.value.field == "vram_cache_bytes"
    assert repr(text) in str(info.value)


def test_defaults(tmp_path):
    config = StoragedConfig(models={"m": tmp_path}, vram_cache_bytes="1GiB")
    assert config.socket == Path(DEFAULT_SOCKET)
    assert config.metrics_address == DEFAULT_METRICS_ADDRESS
    assert config.direct_io and config.verify_checksums
    assert config.host_cache_bytes == 0 and config.device == "cpu"
    assert config.vram_cache_bytes == 1 << 30
    assert config.models == {"m": tmp_path.absolute()}
    assert config.cuda_device_index is None
    assert config.max_ids_per_acquire == 1024  # a prompt may touch every expert (Kimi-K2: 384)


@pytest.mark.parametrize("field, value", [
    ("device", "gpu"), ("device", "cuda"), ("device", "cuda:x"), ("device", 0),
    ("vram_cache_bytes", "lots"), ("vram_cache_bytes", 0), ("host_cache_bytes", "-3GiB"),
    ("staging_buffers", 0), ("io_parallelism", -2), ("io_parallelism", True), ("max_ids_per_acquire", "8"),
    ("direct_io", "yes"), ("verify_checksums", 1), ("preload", "on"), ("metrics_address", "9464"),
    ("metrics_address", "localhost:99999"), ("metrics_address", 9464), ("shutdown_grace_seconds", -1),
    ("allowed_uids", "1000"), ("allowed_gids", [-1]), ("socket", ""), ("models", {}),
    ("allowed_uids", []), ("allowed_gids", ()),  # an empty allow-list would admit nobody
    ("models", {"bad name": "/x"}),
    ("fence_timeout_seconds", 0), ("fence_timeout_seconds", "10"), ("fence_timeout_seconds", True),
    ("fence_timeout_seconds", 7200),
])
def test_bad_field_raises_config_error_naming_it(tmp_path, field, value):
    fields = {"models": {"m": tmp_path}, "vram_cache_bytes": 1 << 20, field: value}
    with pytest.raises(ConfigError) as info:
        StoragedConfig(**fields)
    assert field in info.value.field or info.value.field.startswith("models")
    assert field in str(info.value)


@pytest.mark.parametrize("address, expected", [("", ""), ("off", ""), ("OFF", ""),
                                               ("0.0.0.0:9000", "0.0.0.0:9000"), ("[::1]:80", "[::1]:80")])
def test_metrics_address_off_and_on(tmp_path, address, expected):
    config = StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1, metrics_address=address)
    assert config.metrics_address == expected
    assert config.metrics_enabled == bool(expected)


def test_config_is_frozen(tmp_path):
    config = StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1)
    with pytest.raises(AttributeError):
        config.device = "cuda:0"  # type: ignore[misc]


@pytest.mark.parametrize("field, value", [
    ("session_idle_seconds", 0), ("session_idle_seconds", 0.05), ("session_idle_seconds", -1),
    ("session_idle_seconds", 86401), ("session_idle_seconds", "60"), ("session_idle_seconds", True),
    ("max_sessions_per_peer", -1), ("max_sessions_per_peer", 2.5), ("max_sessions_per_peer", "256"),
    ("max_sessions_per_peer", True), ("max_sessions_per_peer", 1_000_001),
])
def test_session_bounds_refused(tmp_path, field, value):
    with pytest.raises(ConfigError) as info:
        StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1, **{field: value})
    assert info.value.field == field and repr(value) in str(info.value)


@pytest.mark.parametrize("fields, idle, bound, identifies", [
    ({}, 60.0, 256, True),  # bounded by default: peers are identified
    ({"max_sessions_per_peer": 0}, 60.0, 0, False),  # no bound and no allow-list: nothing to identify
    ({"max_sessions_per_peer": 0, "allowed_uids": [0]}, 60.0, 0, True),
    ({"session_idle_seconds": 0.1, "max_sessions_per_peer": 1}, 0.1, 1, True),
    ({"session_idle_seconds": 86400}, 86400.0, 256, True),
])
def test_session_bounds(tmp_path, fields, idle, bound, identifies):
    config = StoragedConfig(models={"m": tmp_path}, vram_cache_bytes=1, **fields)
    assert (config.session_idle_seconds, config.max_sessions_per_peer, config.identifies_peers) == (
        idle, bound, identifies)
    assert isinstance(config.session_idle_seconds, float)


def test_session_bounds_from_toml_and_flags(tmp_path):
    toml = _write(tmp_path / "s.toml", "vram_cache_bytes = 1\nsession_idle_seconds = 30\n"
                  "max_sessions_per_peer = 8\n[models]\nm = '/x'\n")
    assert (load_config(toml).session_idle_seconds, load_config(toml).max_sessions_per_peer) == (30.0, 8)
    args = build_parser().parse_args(["--config", str(toml), "--session-idle-seconds", "2.5",
                                      "--max-sessions-per-peer", "0"])
    config = config_from_args(args)
    assert (config.session_idle_seconds, config.max_sessions_per_peer) == (2.5, 0)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_toml_then_cli_overrides(tmp_path):
    toml = _write(tmp_path / "s.toml", """
socket = "/tmp/x.sock"
vram_cache_bytes = "2GiB"
direct_io = true
device = "cuda:1"
[models]
qwen = "bundles/qwen"
""")
    args = build_parser().parse_args(["--config", str(toml), "--vram-cache-bytes", "8GiB", "--no-direct-io",
                                      "--socket", str(tmp_path / "s.sock"), "--model", "mix=/data/mix"])
    config = config_from_args(args)
    assert config.vram_cache_bytes == 8 << 30
    assert config.direct_io is False
    assert config.device == "cuda:1"
    assert config.socket == tmp_path / "s.sock"
    # Relative bundle paths are relative to the config file; --model adds to the file's models.
    assert config.models == {"qwen": tmp_path / "bundles" / "qwen", "mix": Path("/data/mix")}
    assert config.cuda_device_index == 1


def test_unknown_toml_key_is_named(tmp_path):
    toml = _write(tmp_path / "s.toml", 'vram_cache_bytes = 1\nvram_cache = 2\ncolour = "red"\n[models]\nm = "/x"\n')
    with pytest.raises(ConfigError) as info:
        load_config(toml)
    assert "colour" in str(info.value) and "vram_cache" in str(info.value)


@pytest.mark.parametrize("text, needle", [
    ("vram_cache_bytes = 1\n", "models"),
    ("[models]\nm = '/x'\n", "vram_cache_bytes"),
    ("vram_cache_bytes = \n", "not valid TOML"),
])
def test_incomplete_or_malformed_file(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(_write(tmp_path / "s.toml", text))


@pytest.mark.parametrize("models, kind", [('"x"', "a string"), ("3", "an integer"), ('["/a", "/b"]', "an array")])
def test_models_that_is_not_a_table_is_named_with_its_type(tmp_path, models, kind):
    toml = _write(tmp_path / "s.toml", f"vram_cache_bytes = 1\nmodels = {models}\n")
    with pytest.raises(ConfigError, match=f"'models' = .*: expected a table of name = bundle directory .*, got {kind}"):
        load_config(toml)
    # a --model flag does not make the file's wrong value disappear
    with pytest.raises(ConfigError, match=f"got {kind}"):
        config_from_args(build_parser().parse_args(["--config", str(toml), "--model", "m=/x"]))


def test_a_model_flag_given_twice_is_refused_naming_it():
    args = build_parser().parse_args(["--model", "m=/a", "--model", "other=/c", "--model", "m=/b",
                                      "--vram-cache-bytes", "1"])
    with pytest.raises(ConfigError, match=r"model 'm' is given twice \(also as m=/a\)"):
        config_from_args(args)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.toml")


def test_model_flag_must_be_name_equals_dir():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "nodir"])


# The flags storaged has always had; a config field with a Flag adds one, never renames these.
_FLAGS = {"--socket", "--vram-cache-bytes", "--host-cache-bytes", "--staging-buffers", "--io-parallelism",
          "--direct-io", "--verify-checksums", "--verify-hits", "--metrics-address", "--device",
          "--shutdown-grace-seconds", "--fence-timeout-seconds", "--max-ids-per-acquire",
          "--session-idle-seconds", "--max-sessions-per-peer"}


def test_the_flags_are_the_config_fields():
    options = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    generated = {flag_name(field) for field, _, _ in flag_fields()}
    assert _FLAGS <= generated and generated <= options
    assert options - generated == {"--help", "--version", "--config", "--model"} | {
        "--no-" + name.removeprefix("--") for name in ("--direct-io", "--verify-checksums", "--preload")}
    # the fields that are no flag: models has --model, the peer allow-lists are TOML only
    assert {f.name for f in dataclasses.fields(StoragedConfig)} - {f.name for f, _, _ in flag_fields()} == {
        "models", "allowed_uids", "allowed_gids"}


def _every_flag(tmp_path) -> tuple[list[str], dict]:
    """A command line setting every generated flag to a value other than its default, and the values."""
    given = {"socket": (str(tmp_path / "a.sock"), tmp_path / "a.sock"), "vram_cache_bytes": ("3MiB", 3 << 20),
             "host_cache_bytes": ("1KiB", 1024), "staging_buffers": ("3", 3), "io_parallelism": ("5", 5),
             "direct_io": (None, False), "verify_checksums": (None, True), "preload": (None, True),
             "verify_hits": ("0.25", 0.25),
             "metrics_address": ("127.0.0.1:9999", "127.0.0.1:9999"), "device": ("cuda:2", "cuda:2"),
             "shutdown_grace_seconds": ("1.5", 1.5), "fence_timeout_seconds": ("0.5", 0.5),
             "max_ids_per_acquire": ("7", 7), "session_idle_seconds": ("9", 9.0), "max_sessions_per_peer": ("3", 3)}
    argv = ["--model", "m=/x", "--no-direct-io", "--verify-checksums", "--preload"]
    for name, (text, _) in given.items():
        if text is not None:
            argv += ["--" + name.replace("_", "-"), text]
    return argv, {name: value for name, (_, value) in given.items()}


def test_every_flag_sets_its_field(tmp_path):
    argv, expected = _every_flag(tmp_path)
    assert set(expected) == {f.name for f, _, _ in flag_fields()}, "a flag this test does not set"
    config = config_from_args(build_parser().parse_args(argv))
    assert {name: getattr(config, name) for name in expected} == expected


def test_flags_left_out_keep_the_files_values(tmp_path):
    toml = _write(tmp_path / "s.toml", "vram_cache_bytes = 1\nio_parallelism = 6\ndirect_io = false\n"
                  "[models]\nm = '/x'\n")
    config = config_from_args(build_parser().parse_args(["--config", str(toml)]))
    assert (config.io_parallelism, config.direct_io, config.staging_buffers) == (6, False, 8)


@pytest.mark.parametrize("argv", [["--io-parallelism", "two"], ["--verify-hits", "lots"], ["--direct-io", "x"]])
def test_a_flag_value_of_the_wrong_type_is_refused(argv):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m=/x", *argv])


def test_the_help_names_each_flags_default():
    text = build_parser().format_help()
    assert "(default 1024)" in text and "(default 127.0.0.1:9464)" in text
