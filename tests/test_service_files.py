"""The service files in systemd/: the socket and service units, the launchd plist (all made by
daemon/service_files.py), the example config, the README."""

import os
import plistlib
import re
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

# Run from a source checkout (tests/ beside systemd/): the wheel ships systemd/ as src/moe_l2/systemd, not the tests.
SERVICE_DIR = Path(__file__).resolve().parents[1] / "systemd"
UNIT = SERVICE_DIR / "moe-l2d.service"
SOCKET = SERVICE_DIR / "moe-l2d.socket"
PLIST = SERVICE_DIR / "com.moe-l2.moe-l2d.plist"
CONFIG = SERVICE_DIR / "moe-l2d.toml.example"
README = SERVICE_DIR / "README.md"

SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?$")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as section -> key -> values in order (keys may repeat; no continuation lines)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"assignment outside a section: {raw!r}"
        assert not line.endswith("\\"), f"continuation lines are not parsed here: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(section: dict[str, list[str]], key: str) -> str:
    values = section[key]
    assert len(values) == 1, f"{key} set {len(values)} times"
    return values[0]


@pytest.fixture(scope="module")
def unit():
    return parse_unit(UNIT.read_text())


@pytest.fixture(scope="module")
def socket_unit():
    return parse_unit(SOCKET.read_text())


@pytest.fixture(scope="module")
def plist():
    return plistlib.loads(PLIST.read_bytes())


@pytest.fixture(scope="module")
def config():
    return tomllib.loads(CONFIG.read_text())


def test_unit_service_contract(unit):
    service = unit["Service"]
    assert one(service, "Type") == "notify"
    assert one(service, "NotifyAccess") == "main"
    # Restarted after crashes and kills, never after a start-up error it logged (the plist's KeepAlive agrees).
    assert one(service, "Restart") == "on-abnormal"
    assert one(service, "LimitMEMLOCK") == "infinity"  # the daemon mlock()s its segments
    assert one(service, "RuntimeDirectory") == "moe-l2"
    assert one(service, "RuntimeDirectoryMode") == "0755"  # clients reach the socket; its mode decides who connects
    # Kept when the daemon stops: the socket unit's file (and the crashed daemon's segment list) lives there.
    assert one(service, "RuntimeDirectoryPreserve") == "yes"
    assert one(service, "StateDirectory") == "moe-l2"  # L2's heat, preloaded at the next start
    argv = one(service, "ExecStart").split()
    assert argv[0].startswith("/") and Path(argv[0]).name == "moe-l2d"
    assert argv[1:] == ["--config", "/etc/moe-l2/moe-l2d.toml"]
    assert "TimeoutStopSec" in service
    # Started by its socket, on the first connection; enabling the service enables the socket.
    assert one(unit["Unit"], "Requires") == "moe-l2d.socket"
    assert unit["Install"] == {"Also": ["moe-l2d.socket"]}


def test_socket_unit_is_where_clients_look_with_the_daemons_mode_and_group(socket_unit, unit, config):
    from moe_l2.daemon.activation import SOCKET_NAME as HANDED_NAME
    from moe_l2.runtime import SOCKET_NAME, SYSTEM_DIRS

    listen = one(socket_unit["Socket"], "ListenStream")
    assert listen == f"%t/{SYSTEM_DIRS[0].name}/{SOCKET_NAME}"  # %t is /run for the system manager
    assert one(socket_unit["Socket"], "FileDescriptorName") == HANDED_NAME
    # What the daemon checks the socket against: the example config's socket_mode, the service's account.
    assert int(one(socket_unit["Socket"], "SocketMode"), 8) == config["socket_mode"]
    assert one(socket_unit["Socket"], "SocketUser") == one(unit["Service"], "User")
    assert one(socket_unit["Socket"], "SocketGroup") == one(unit["Service"], "Group")
    assert one(socket_unit["Socket"], "RemoveOnStop") == "yes"
    assert socket_unit["Install"]["WantedBy"] == ["sockets.target"]


def test_shipped_files_are_what_service_files_makes():
    """systemd/'s unit, socket and plist and what `moe-l2 service install` writes come from one place."""
    from moe_l2.daemon.service_files import shipped_files

    for name, text in shipped_files().items():
        assert (SERVICE_DIR / name).read_text() == text, (
            f"systemd/{name} differs from daemon/service_files.py; regenerate: python -c 'from "
            "moe_l2.daemon.service_files import shipped_files as s; [open(f\"systemd/{n}\", \"w\").write(t) "
            "for n, t in s().items()]'")


def test_unit_account_and_permissions(unit):
    service = unit["Service"]
    # Clients join this group; a dynamic user could have no members (and implies RemoveIPC=yes).
    assert one(service, "User") == "moe-l2"
    assert one(service, "Group") == "moe-l2"
    assert "DynamicUser" not in service
    assert one(service, "RemoveIPC") == "no"
    # The umask must leave the group's bits alone: 0640 segments, a group-connectable socket.
    assert int(one(service, "UMask"), 8) & 0o070 == 0


def test_unit_hardening_keeps_what_the_daemon_needs(unit):
    service = unit["Service"]
    assert one(service, "NoNewPrivileges") == "yes"
    assert one(service, "ProtectSystem") == "strict"
    assert one(service, "ProtectHome") == "read-only"  # models in home directories stay readable
    assert one(service, "PrivateTmp") == "yes"
    assert one(service, "RestrictAddressFamilies") == "AF_UNIX"
    assert "/dev/shm" in one(service, "ReadWritePaths").split()
    assert "ProcSubset" not in service  # the start-up memory check reads /proc/meminfo


def test_plist(plist):
    assert plist["Label"] == "com.moe-l2.moe-l2d"
    argv = plist["ProgramArguments"]
    assert argv[0].startswith("/") and Path(argv[0]).name == "moe-l2d"
    assert argv[argv.index("--config") + 1] == "/usr/local/etc/moe-l2/moe-l2d.toml"
    runtime = argv[argv.index("--runtime-dir") + 1]
    assert runtime.startswith("/") and argv[argv.index("--state-dir") + 1].startswith("/")
    assert plist["RunAtLoad"] is False  # the first client starts it
    (listener,) = plist["Sockets"].values()
    assert listener["SockPathName"] == f"{runtime}/moe-l2d.sock" and listener["SockPathMode"] == 0o660
    # Relaunched after a crash, not every 10 s after a configuration error (SuccessfulExit = false would).
    assert plist["KeepAlive"] == {"Crashed": True}
    assert plist["ProcessType"] in {"Standard", "Interactive", "Adaptive"}  # never throttled
    assert plist["StandardOutPath"].startswith("/")
    assert plist["StandardErrorPath"].startswith("/")
    assert plist["UserName"] and plist["GroupName"]
    assert plist["Umask"] & 0o070 == 0


def test_example_config(config):
    models = config["model"]
    assert models
    for model in models:
        assert isinstance(model["path"], str) and model["path"].startswith("/")
        assert SIZE.match(model["budget"]), model["budget"]
        assert model.get("policy", "lru") in {"lru", "lfu"}
    assert config["log_level"] in {"debug", "info", "warning", "error"}
    assert config["shm_mode"] & ~0o777 == 0 and config["shm_mode"] & 0o040  # the clients' group reads


def test_example_config_loads_in_the_daemon(tmp_path):
    from moe_l2.daemon.config import build_parser, resolve

    def load(path):
        return resolve(build_parser().parse_args(["--config", str(path)]))

    config = load(CONFIG)
    assert [str(m.path) for m in config.models] == [m["path"] for m in tomllib.loads(CONFIG.read_text())["model"]]
    assert config.models[0].budget == 24 * 1024**3
    assert config.shm_mode == 0o640
    # Every top-level key the example shows commented out is accepted once uncommented.
    text = CONFIG.read_text()
    commented = re.findall(r"^# (\w+) = ", text, re.M)
    assert {"socket", "runtime_dir", "profile"} <= set(commented)
    uncommented = tmp_path / "all-keys.toml"
    uncommented.write_text(re.sub(r"^# (\w+ = )", r"\1", text, flags=re.M))
    assert load(uncommented).socket == "tcp://127.0.0.1:5557"


def test_readme_creates_what_the_service_files_use(unit, plist):
    readme = README.read_text()
    argv = plist["ProgramArguments"]
    wanted = [
        one(unit["Service"], "ExecStart").split()[2],
        argv[argv.index("--config") + 1],
        argv[argv.index("--runtime-dir") + 1],
        argv[argv.index("--state-dir") + 1],
        plist["StandardOutPath"].rsplit("/", 1)[0],
        "moe-l2 service install --system",
        "moe-l2 service install --user",
        "systemctl enable --now moe-l2d.socket",
        "journalctl -u moe-l2d",
        "launchctl bootstrap system",
        "launchctl print system/" + plist["Label"],
        "moe-l2 stats",
    ]
    for text in wanted:
        assert text in readme, text


def test_systemd_analyze_verify(tmp_path, unit, socket_unit):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not on PATH")
    # verify checks that ExecStart's program exists: point it at a stand-in, change nothing else.
    program = one(unit["Service"], "ExecStart").split()[0]
    stand_in = tmp_path / "moe-l2d"
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace(f"ExecStart={program} ", f"ExecStart={stand_in} "))
    (tmp_path / SOCKET.name).write_text(SOCKET.read_text())
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(tmp_path / SOCKET.name), str(copy)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert UNIT.name not in output and SOCKET.name not in output, output


# launchd.plist(5): the keys this plist may use and the type launchd reads each as (plutil -lint checks the
# syntax; launchd ignores a key of the wrong type, which would silently drop e.g. the account or the umask).
LAUNCHD_KEYS = {
    "Label": str, "ProgramArguments": list, "UserName": str, "GroupName": str, "Umask": int, "RunAtLoad": bool,
    "KeepAlive": (bool, dict), "ExitTimeOut": int, "ProcessType": str, "SoftResourceLimits": dict,
    "HardResourceLimits": dict, "StandardOutPath": str, "StandardErrorPath": str, "WorkingDirectory": str,
    "EnvironmentVariables": dict, "ThrottleInterval": int, "Nice": int, "LowPriorityIO": bool, "Sockets": dict,
}
SOCKET_KEYS = {"SockType": str, "SockPassive": bool, "SockNodeName": str, "SockServiceName": str, "SockFamily": str,
               "SockProtocol": str, "SockPathName": str, "SockPathOwner": int, "SockPathGroup": int,
               "SockPathMode": int}
KEEPALIVE_KEYS = {"SuccessfulExit": bool, "Crashed": bool, "NetworkState": bool, "PathState": dict,
                  "OtherJobEnabled": dict, "AfterInitialDemand": dict}
RESOURCE_KEYS = {"Core", "CPU", "Data", "FileSize", "MemoryLock", "NumberOfFiles", "NumberOfProcesses",
                 "ResidentSetSize", "Stack"}


def test_plist_lints_as_launchd_reads_it():
    raw = PLIST.read_bytes()
    assert raw.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN"')
    plist = plistlib.loads(raw, fmt=plistlib.FMT_XML)  # strict XML plist: what plutil -lint accepts
    assert isinstance(plist, dict)
    for key, value in plist.items():
        assert key in LAUNCHD_KEYS, f"{key} is not a launchd.plist key this file should use"
        assert isinstance(value, LAUNCHD_KEYS[key]), f"{key} is a {type(value).__name__}"
        assert not (isinstance(value, bool) and LAUNCHD_KEYS[key] is int), f"{key} must be an <integer>"
    assert {"Label", "ProgramArguments"} <= set(plist)  # launchd requires both (no Program key here)
    assert plist["Label"] == PLIST.stem
    assert plist["ProgramArguments"] and all(isinstance(a, str) and a for a in plist["ProgramArguments"])
    assert 0 <= plist["Umask"] <= 0o777
    if isinstance(plist["KeepAlive"], dict):
        for key, value in plist["KeepAlive"].items():
            assert key in KEEPALIVE_KEYS and isinstance(value, KEEPALIVE_KEYS[key]), (key, value)
    for listener in plist["Sockets"].values():
        for key, value in listener.items():
            assert key in SOCKET_KEYS and isinstance(value, SOCKET_KEYS[key]), (key, value)
            assert not (isinstance(value, bool) and SOCKET_KEYS[key] is int), f"{key} must be an <integer>"
        assert listener["SockFamily"] == "Unix" and listener["SockType"] == "stream"
    for limits in (plist.get("SoftResourceLimits", {}), plist.get("HardResourceLimits", {})):
        for key, value in limits.items():
            assert key in RESOURCE_KEYS and isinstance(value, int) and not isinstance(value, bool), (key, value)
    assert plist["ProcessType"] in {"Background", "Standard", "Adaptive", "Interactive"}
    assert plistlib.loads(plistlib.dumps(plist)) == plist  # round-trips: no value plistlib had to guess at


@pytest.mark.skipif(shutil.which("plutil") is None, reason="plutil is macOS' own plist checker")
def test_plutil_lint():
    result = subprocess.run(["plutil", "-lint", str(PLIST)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_daemon_exits_by_itself_only_with_statuses_the_service_managers_do_not_restart(tmp_path):
    """Start-up errors end in exit statuses (1, 2), never in a signal: Restart=on-abnormal and KeepAlive.Crashed
    leave them down instead of relaunching a daemon that will fail again."""
    import sys

    bad_flag = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--budget", "1GiB"],
                              capture_output=True, text=True, timeout=60)
    assert bad_flag.returncode == 2
    missing = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", "/nonexistent",
                              "--budget", "1GiB", "--runtime-dir", str(tmp_path / "rt")], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 1 and "cannot serve /nonexistent" in missing.stderr
