"""ops/systemd: the units pass `systemd-analyze verify` without a single diagnostic, keep their
hardening, and the sysusers file creates the accounts they run as."""

from __future__ import annotations

import pytest

from ops_testkit import UNITS, require_binary, run_tool, unit_settings

UNIT_FILES = [UNITS / "storaged.service", UNITS / "inference.service"]


def _verify(*units) -> str:
    """systemd-analyze's diagnostics: it exits 0 on parse warnings, so its output is the verdict."""
    result = run_tool(require_binary("systemd-analyze"), "verify", "--man=no", *map(str, units))
    return (result.stdout + result.stderr).strip() + ("" if result.returncode == 0 else f"\n(exit {result.returncode})")


def test_units_verify_cleanly():
    assert _verify(*UNIT_FILES) == ""


@pytest.mark.parametrize("unit, original, broken, diagnostic", [
    ("storaged.service", "Type=notify", "Type=notifyy", "Failed to parse service type"),
    ("storaged.service", "WatchdogSec=30s", "WatchdogSec=half a minute", "Failed to parse"),
    ("storaged.service", "ExecStart=/usr/bin/env storaged", "ExecStart=/opt/nowhere/storaged", "not executable"),
    ("storaged.service", "ProtectSystem=strict", "ProtectSystem=sternly", "Failed to parse"),
    ("inference.service", "Wants=storaged.service", "Wantss=storaged.service", "Unknown key"),
    ("inference.service", "Type=notify", "Type=notifyy", "Failed to parse service type"),
    ("inference.service", "WatchdogSec=120s", "WatchdogSec=two minutes", "Failed to parse"),
])
def test_verify_reports_broken_units(tmp_path, unit, original, broken, diagnostic):
    """The check above can fail: the same verify run flags each of these mistakes."""
    text = (UNITS / unit).read_text()
    assert original in text
    (tmp_path / unit).write_text(text.replace(original, broken, 1))
    assert diagnostic in _verify(tmp_path / unit)


def test_storaged_unit_settings():
    service = unit_settings(UNITS / "storaged.service")["Service"]
    expected = {
        "Type": ["notify"], "NotifyAccess": ["main"], "Restart": ["on-failure"], "WatchdogSec": ["30s"],
        "User": ["expertpack-storaged"], "Group": ["expertpack"], "RuntimeDirectory": ["expertpack"],
        "LimitMEMLOCK": ["infinity"], "NoNewPrivileges": ["yes"], "ProtectSystem": ["strict"],
        "ProtectHome": ["yes"], "PrivateTmp": ["yes"], "ReadOnlyPaths": ["/var/lib/expertpack/bundles"],
        "DevicePolicy": ["closed"],
    }
    for key, values in expected.items():
        assert service.get(key) == values, key
    assert service["ExecStart"] == ["/usr/bin/env storaged --config /etc/expertpack/storaged.toml"]
    assert {"char-nvidia-frontend rw", "char-nvidia-uvm rw", "/dev/nvidiactl rw"} <= set(service["DeviceAllow"])


def _listed(unit: dict, key: str) -> set[str]:
    return {name for value in unit["Unit"].get(key, []) for name in value.split()}


def test_inference_unit_starts_after_storaged_but_survives_its_restarts():
    """systemd.unit(5): Wants= pulls storaged in when inference starts and After= orders it first;
    Requires= (and BindsTo=, PartOf=) would also stop or restart inference whenever storaged is
    stopped or restarted, reloading the model: none of them may name storaged."""
    unit = unit_settings(UNITS / "inference.service")
    assert "storaged.service" in _listed(unit, "Wants") and "storaged.service" in _listed(unit, "After")
    for key in ("Requires", "Requisite", "BindsTo", "PartOf"):
        assert "storaged.service" not in _listed(unit, key), key
    assert unit["Service"]["Group"] == ["expertpack"]  # the group storaged's socket admits


def test_inference_unit_is_notify_with_a_watchdog():
    service = unit_settings(UNITS / "inference.service")["Service"]
    expected = {"Type": ["notify"], "NotifyAccess": ["main"], "WatchdogSec": ["120s"], "Restart": ["on-failure"],
                "TimeoutStartSec": ["30min"]}
    for key, values in expected.items():
        assert service.get(key) == values, key
    assert service["ExecStart"] == ["/usr/bin/env inference serve $INFERENCE_ARGS"]


@pytest.mark.parametrize("unit", UNIT_FILES, ids=lambda p: p.name)
def test_hardening_exposure_stays_low(unit):
    """systemd's own exposure score (0 safest .. 10): over 4.0 means hardening was dropped."""
    result = run_tool(require_binary("systemd-analyze"), "security", "--offline=yes", "--man=no",
                      "--threshold=40", str(unit))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr


def test_sysusers_creates_the_accounts(tmp_path):
    sysusers = require_binary("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    result = run_tool(sysusers, f"--root={tmp_path}", str(UNITS / "expertpack.sysusers.conf"))
    assert result.returncode == 0, result.stderr
    groups = {line.split(":")[0]: line.split(":")[2] for line in (tmp_path / "etc/group").read_text().splitlines()}
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    for user in ("expertpack-storaged", "expertpack-inference"):
        assert users[user][3] == groups["expertpack"]  # primary group: the socket's group
        assert users[user][6] == "/usr/sbin/nologin"
    units_users = {unit_settings(u)["Service"]["User"][0] for u in UNIT_FILES}
    assert units_users == {"expertpack-storaged", "expertpack-inference"}
