"""`moe-l2 service` (cli/service.py): what install writes, checked by systemd-analyze verify and by the
daemon's own config loader; its refusals where it cannot act, with the fix; launchd's install, status and
uninstall with launchctl faked (no Mac here: launchd is the one thing these tests mock)."""

from __future__ import annotations

import argparse
import grp
import os
import plistlib
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moe_l2.cli import main as moe_l2_main
from moe_l2.daemon.config import OPTIONS, build_parser, resolve
from moe_l2.lab.daemon_process import short_tempdir
from moe_l2.daemon.service_files import LABEL, MARKER
from moe_l2.runtime import SOCKET_NAME

from .conftest import AS_NOBODY, nobody_runs_python

ANALYZE = shutil.which("systemd-analyze")


def moe_l2(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "moe_l2.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def dry_run(tmp_path, *args: str, cwd=None) -> tuple[dict[Path, str], list[str]]:
    """`service install --dry-run ARGS` with this test's config and runtime dirs: {path: text}, commands."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_RUNTIME_DIR=str(tmp_path / "run"))
    done = moe_l2("service", "install", "--dry-run", *args, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr
    parts = re.split(r"^==> (.*) <==\n", done.stdout, flags=re.M)[1:]
    shown = dict(zip(parts[::2], parts[1::2]))
    commands = shown.pop("then").split("\n")
    return {Path(p): text.removesuffix("\n") for p, text in shown.items()}, [c for c in commands if c]


def unit_value(text: str, key: str) -> str:
    (value,) = re.findall(rf"^{key}=(.*)$", text, re.M)
    return value


def verify(tmp_path, files: dict[Path, str], user: bool) -> None:
    if ANALYZE is None:
        pytest.skip("systemd-analyze is not on PATH (apt-get install systemd)")
    units = tmp_path / "units"
    units.mkdir(exist_ok=True)
    for path, text in files.items():
        if path.suffix in (".socket", ".service"):
            (units / path.name).write_text(text)
    (tmp_path / "run").mkdir(mode=0o700, exist_ok=True)
    result = subprocess.run([ANALYZE, *(["--user"] if user else []), "verify", "--man=no",
                             str(units / "moe-l2d.socket"), str(units / "moe-l2d.service")],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, SYSTEMD_LOG_COLOR="0", XDG_RUNTIME_DIR=str(tmp_path / "run")))
    assert result.returncode == 0 and "moe-l2d" not in result.stdout + result.stderr, result.stdout + result.stderr


def loaded(toml: str, tmp_path):
    """The DaemonConfig moe-l2d makes of a config file's text."""
    path = tmp_path / "loaded.toml"
    path.write_text(toml)
    return resolve(build_parser().parse_args(["--config", str(path)]))


def test_a_user_install_is_a_socket_unit_a_service_and_the_daemons_config(tmp_path, model_dir):
    files, commands = dry_run(tmp_path, "--user", "--model", model_dir.name, "--budget", "8MiB", "--policy",
                              "lfu", "--loader-threads", "8", cwd=model_dir.parent)
    units, config_dir = tmp_path / "config" / "systemd" / "user", tmp_path / "config" / "moe-l2"
    assert set(files) == {units / "moe-l2d.socket", units / "moe-l2d.service", config_dir / "moe-l2d.toml"}
    assert all(text.startswith(f"# {MARKER}") for text in files.values())
    verify(tmp_path, files, user=True)
    config = loaded(files[config_dir / "moe-l2d.toml"], tmp_path)
    # The flags reach the daemon as given, the model's path made absolute (the service runs elsewhere).
    assert [m.path for m in config.models] == [model_dir] and config.models[0].budget == 8 << 20
    assert config.models[0].policy == "lfu" and config.loader_threads == 8
    socket_unit, service = files[units / "moe-l2d.socket"], files[units / "moe-l2d.service"]
    assert unit_value(socket_unit, "ListenStream") == f"%t/moe-l2/{SOCKET_NAME}"  # where clients look
    assert int(unit_value(socket_unit, "SocketMode"), 8) == config.socket_mode == 0o600
    assert "SocketUser" not in socket_unit and "User=" not in service
    assert unit_value(service, "ExecStart").split()[1:] == ["--config", str(config_dir / "moe-l2d.toml")]
    assert Path(unit_value(service, "ExecStart").split()[0]).name == "moe-l2d"
    assert unit_value(service, "Requires") == "moe-l2d.socket" and unit_value(service, "RuntimeDirectory") == "moe-l2"
    assert commands == ["systemctl --user daemon-reload", "systemctl --user enable --now moe-l2d.socket",
                        "systemctl --user try-restart moe-l2d.service"]


def test_a_system_install_opens_the_socket_and_segments_to_the_account_group(tmp_path, model_dir):
    group = grp.getgrgid(os.getegid()).gr_name
    files, commands = dry_run(tmp_path, "--system", "--model", str(model_dir), "--budget", "8MiB",
                              "--socket-group", group)
    units = Path("/etc/systemd/system")
    socket_unit, service = files[units / "moe-l2d.socket"], files[units / "moe-l2d.service"]
    toml = files[Path("/etc/moe-l2/moe-l2d.toml")]
    verify(tmp_path, files, user=False)
    config = loaded(toml, tmp_path)
    assert config.socket_mode == 0o660 and config.shm_mode == 0o640 and config.socket_group == os.getegid()
    assert int(unit_value(socket_unit, "SocketMode"), 8) == 0o660
    assert unit_value(socket_unit, "SocketUser") == unit_value(service, "User") == "moe-l2"
    assert unit_value(socket_unit, "SocketGroup") == unit_value(service, "Group") == group
    assert commands[1] == "systemctl enable --now moe-l2d.socket"


def test_install_takes_the_daemons_options_from_its_table():
    """One owner per fact: install's flags and their help are OPTIONS', all but where the socket is."""
    import argparse as ap

    from moe_l2.cli import build_parser as cli_parser

    (commands,) = [a for a in cli_parser("service")._actions if isinstance(a, ap._SubParsersAction)]
    (actions,) = [a for a in commands.choices["service"]._actions if isinstance(a, ap._SubParsersAction)]
    install = {a.option_strings[-1]: a.help for a in actions.choices["install"]._actions if a.option_strings}
    daemon = {a.option_strings[-1]: a.help for a in build_parser()._actions if a.option_strings}
    expected = {o.option for o in OPTIONS} - {"--socket", "--runtime-dir"}
    assert expected <= set(install) and all(install[flag] == daemon[flag] for flag in expected)
    assert not {"--socket", "--runtime-dir", "--config"} & set(install)


def test_bad_options_are_refused_by_the_daemons_own_checks(tmp_path, model_dir):
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path))
    for args, message in ((["--budget", "8MiB", "--loader-threads", "0"], "--loader-threads must be an integer"),
                          ([], "--budget is required with --model"),
                          (["--budget", "8MiB", "--socket-mode", "644"], "socket mode '644' must be 600")):
        done = moe_l2("service", "install", "--dry-run", "--model", str(model_dir), *args, env=env)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    missing = moe_l2("service", "install", "--dry-run", "--model", str(tmp_path / "none"), "--budget", "1GiB", env=env)
    assert missing.returncode == 2 and "--model: no model directory at" in missing.stderr


def test_where_it_cannot_act_it_says_why_and_what_to_do(model_dir):
    args = ("--model", str(model_dir), "--budget", "8MiB")
    probe = subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True)
    if shutil.which("systemctl") and probe.returncode != 0:  # no user manager here: the refusal, with the fix
        done = moe_l2("service", "install", "--user", *args)
        assert done.returncode == 1
        assert "no systemd user instance runs for" in done.stderr and "loginctl enable-linger" in done.stderr
        assert "install --system" in done.stderr
        assert not (Path.home() / ".config" / "systemd" / "user" / "moe-l2d.socket").exists()
    if shutil.which("systemctl") and not os.path.isdir("/run/systemd/system") and os.geteuid() == 0:
        done = moe_l2("service", "install", "--system", *args)
        assert done.returncode == 1 and "systemd is not this machine's init" in done.stderr
        assert not os.path.exists("/etc/systemd/system/moe-l2d.socket")


@pytest.mark.skipif(not nobody_runs_python(), reason="needs root, setpriv and a venv uid 65534 can run")
def test_a_system_install_needs_root(model_dir):
    done = subprocess.run([*AS_NOBODY, sys.executable, "-P", "-m", "moe_l2.cli", "service", "install", "--system",
                           "--model", str(model_dir), "--budget", "8MiB"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HOME="/nonexistent"))
    assert done.returncode == 1 and "run this again with sudo" in done.stderr, done.stderr


# ---- launchd, with launchctl faked ------------------------------------------------------------------------------

@pytest.fixture
def mac(tmp_path, monkeypatch):
    """This process as a Mac user's: sys.platform darwin, a home of its own (short: the socket's path must fit
    sun_path), and a launchctl that records its calls (and says the job is loaded once bootstrapped)."""
    from moe_l2.cli import service

    home = short_tempdir()
    bin_dir, calls = tmp_path / "bin", tmp_path / "launchctl.calls"
    bin_dir.mkdir()
    fake = bin_dir / "launchctl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                    f'[ "$1" = print ] && {{ grep -q bootstrap {calls} || exit 113; echo "\tstate = waiting"; }}\n'
                    '[ "$1" = bootstrap ] && [ -n "$NO_GUI" ] && { echo "Bootstrap failed: 125: Domain does not '
                    'support specified action" >&2; exit 125; }\n'
                    "exit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(service, "home", lambda: home)
    yield argparse.Namespace(home=home, calls=calls)
    shutil.rmtree(home, ignore_errors=True)


def test_a_login_agent_is_written_bootstrapped_and_removed(mac, model_dir, capsys, tmp_path):
    plist_path = mac.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    toml_path = tmp_path / "config" / "moe-l2" / "moe-l2d.toml"
    assert moe_l2_main(["service", "install", "--user", "--model", str(model_dir), "--budget", "8MiB"]) == 0
    plist = plistlib.loads(plist_path.read_bytes(), fmt=plistlib.FMT_XML)
    agent_dir = mac.home / "Library" / "Application Support" / "moe-l2"
    (listener,) = plist["Sockets"].values()
    assert listener["SockPathName"] == str(agent_dir / SOCKET_NAME) and listener["SockPathMode"] == 0o600
    assert (listener["SockPathOwner"], listener["SockPathGroup"]) == (os.getuid(), os.getgid())
    assert "UserName" not in plist and plist["RunAtLoad"] is False
    # The daemon launchd runs serves the socket launchd made: its config and --runtime-dir name that path.
    argv = plist["ProgramArguments"]
    config = resolve(build_parser().parse_args(argv[1:]))
    assert config.socket == f"ipc://{listener['SockPathName']}" and config.socket_mode == listener["SockPathMode"]
    assert argv[argv.index("--config") + 1] == str(toml_path) and toml_path.read_text().startswith(f"# {MARKER}")
    assert agent_dir.is_dir() and agent_dir.stat().st_mode & 0o777 == 0o700  # launchd makes no directory
    assert (mac.home / "Library" / "Logs" / "moe-l2").is_dir()
    uid = os.getuid()
    assert mac.calls.read_text().splitlines() == [f"bootout gui/{uid}/{LABEL}", f"enable gui/{uid}/{LABEL}",
                                                  f"bootstrap gui/{uid} {plist_path}"]
    if shutil.which("plutil"):
        assert subprocess.run(["plutil", "-lint", str(plist_path)], capture_output=True).returncode == 0

    capsys.readouterr()
    assert moe_l2_main(["service", "status", "--user"]) == 0
    shown = capsys.readouterr().out
    assert f"{plist_path}: written by moe-l2 service install" in shown and "state = waiting" in shown

    with socket.socket(socket.AF_UNIX) as left:  # the file launchd's socket leaves once the job is gone
        left.bind(listener["SockPathName"])
    assert moe_l2_main(["service", "uninstall", "--user"]) == 0
    assert not plist_path.exists() and not toml_path.exists() and not os.path.exists(listener["SockPathName"])
    assert mac.calls.read_text().splitlines()[-1] == f"bootout gui/{uid}/{LABEL}"
    assert moe_l2_main(["service", "status", "--user"]) == 1


def test_a_login_agent_launchd_cannot_load_says_why(mac, model_dir, capsys, monkeypatch):
    monkeypatch.setenv("NO_GUI", "1")  # an ssh session without a GUI login: no gui/UID domain
    assert moe_l2_main(["service", "install", "--user", "--model", str(model_dir), "--budget", "8MiB"]) == 1
    err = capsys.readouterr().err
    assert "Bootstrap failed: 125" in err and "logged in at the Mac" in err and "--system" in err


def test_install_never_replaces_a_file_it_did_not_write(mac, model_dir, capsys):
    plist_path = mac.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    plist_path.parent.mkdir(parents=True)
    plist_path.write_text("<plist>mine</plist>\n")
    assert moe_l2_main(["service", "install", "--user", "--model", str(model_dir), "--budget", "8MiB"]) == 1
    assert "were not written by moe-l2 service install" in capsys.readouterr().err
    assert plist_path.read_text() == "<plist>mine</plist>\n" and not mac.calls.exists()
    assert moe_l2_main(["service", "uninstall", "--user"]) == 0  # and uninstall leaves it
    assert plist_path.read_text() == "<plist>mine</plist>\n" and "left" in capsys.readouterr().out


def test_clients_on_a_mac_find_the_login_agents_socket(tmp_path, monkeypatch):
    from moe_l2 import runtime

    agent = runtime.login_agent_dir(tmp_path)
    agent.mkdir(parents=True)
    (agent / SOCKET_NAME).touch()
    for name in ("MOE_L2_RUNTIME_DIR", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(runtime, "login_agent_dir", lambda home=None: agent)
    monkeypatch.setattr(runtime, "SYSTEM_DIRS", ())
    assert runtime.resolve_runtime_dir() == (agent, "the login agent's socket (moe-l2 service install --user)")



def test_a_system_service_is_warned_of_a_moe_l2d_its_account_cannot_reach(tmp_path, capsys):
    from moe_l2.cli.service import warn_if_hidden

    venv = tmp_path / "home" / "venv" / "bin"
    venv.mkdir(parents=True)
    (tmp_path / "home").chmod(0o700)
    warn_if_hidden("moe-l2", ["/usr/bin/env", str(venv / "moe-l2d")])
    assert f"lies in {tmp_path / 'home'} (mode 700), which moe-l2 may not" in capsys.readouterr().err
    warn_if_hidden("moe-l2", ["/usr/bin/env"])
    assert capsys.readouterr().err == ""
