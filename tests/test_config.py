"""Config: defaults < TOML < flags, and one clear line naming the field when something is wrong."""

import contextlib
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node import config
from node.cli import main
from node.errors import ConfigError
from protocol.net.host import parse_dial_addr

PEER = "12D3KooWRQR6dEJXaYFpJcVNJ2gCWNScK5th5Cp4oFTyJnM2bvKx"


def test_defaults_are_valid() -> None:
    cfg = config.load(None)
    assert cfg.role == "trainer"
    assert cfg.state.peer_ttl_s > 2 * cfg.state.heartbeat_interval_s


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('role = "observer"\n[network]\ndial_timeout_s = 3\nlisten = ["/ip4/127.0.0.1/tcp/9"]\n')
    cfg = config.load(path, {"network.listen": ["/ip4/127.0.0.1/tcp/0"]})
    assert cfg.role == "observer"
    assert cfg.network.dial_timeout_s == 3.0
    assert cfg.network.listen == ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"network.upload_limit_mbps": -1.0}, "network.upload_limit_mbps"),
        ({"network.relayed_tensors_mbps": float("nan")}, "network.relayed_tensors_mbps"),
        ({"network.relay": "sometimes"}, "network.relay"),
        ({"network.reachability": "maybe"}, "network.reachability"),
        ({"network.relay_max_reservations": 0}, "network.relay_max_reservations"),
        ({"network.relay_circuit_data_mib": 0}, "network.relay_circuit_data_mib"),
        ({"network.relay_reservation_ttl_s": 30}, "network.relay_reservation_ttl_s"),
        ({"run.settings.compression": "zip"}, "run.settings.compression"),
        ({"network.dial_timeout_s": -1}, "network.dial_timeout_s"),
        ({"network.listen": "/ip4/1.2.3.4/tcp/1"}, "network.listen"),
        ({"network.listen": ["/dns/x/tcp/1"]}, "network.listen"),
        ({"network.bootstrap": ["/ip4/1.2.3.4/tcp/5"]}, "network.bootstrap"),
        ({"network.nope": 1}, "network.nope"),
        ({"state.peer_ttl_s": 1.0}, "state.peer_ttl_s"),
        ({"state.heartbeat_interval_s": "fast"}, "state.heartbeat_interval_s"),
        ({"run.new_run": "Has Spaces"}, "run.new_run"),
        ({"run.run_id": "nohex"}, "run.run_id"),
        ({"run.new_run": "a", "run.run_id": "a-abcdef"}, "run"),
        ({"role": "king"}, "role"),
        ({"network.mdns": "yes"}, "network.mdns"),
        ({"network": 5}, "network"),
    ],
)
def test_bad_values_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(None, overrides)
    assert str(info.value).startswith(field)


def test_a_run_setting_under_its_old_table_says_where_it_moved() -> None:
    with pytest.raises(ConfigError) as info:
        config.load(None, {"training.lr": 0.01})
    assert str(info.value) == "training.lr: run settings moved to [run.settings]: use run.settings.inner.lr"


def test_bad_toml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("role = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(path)


def test_cli_reports_a_bad_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "node.toml"
    path.write_text("[state]\npeer_ttl_s = -5\n")
    assert main(["node", "--config", str(path), "--data-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "state.peer_ttl_s" in err
    assert "Traceback" not in err


def test_cli_reports_a_bad_flag_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["node", "--listen", "nonsense", "--data-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "network.listen" in err


def test_cli_bootstrap_without_peer_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["node", "--bootstrap", "/ip4/127.0.0.1/tcp/1", "--data-dir", str(tmp_path / "d")]) == 2
    assert "network.bootstrap" in capsys.readouterr().err


def test_status_without_daemon_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--data-dir", str(tmp_path)]) == 1
    assert "no daemon is running" in capsys.readouterr().err


@given(st.binary(max_size=200))
def test_arbitrary_config_file_gives_config_error_or_config(data: bytes) -> None:
    with tempfile.NamedTemporaryFile(suffix=".toml") as f:
        f.write(data)
        f.flush()
        with contextlib.suppress(ConfigError):
            config.load(Path(f.name))


@given(st.text(max_size=120))
def test_arbitrary_bootstrap_address_gives_value_error(text: str) -> None:
    with contextlib.suppress(ValueError):
        parse_dial_addr(text)


def test_the_shipped_example_config_is_valid() -> None:
    cfg = config.load(Path(__file__).parent.parent / "deploy" / "node.example.toml")
    assert cfg.network.listen == ["/ip4/0.0.0.0/tcp/7400"]
    assert cfg.state == config.StateConfig()  # the example documents the defaults
    assert cfg.network == config.NetworkConfig(listen=cfg.network.listen)


def test_nat_modes_match_the_protocol() -> None:
    from protocol.net import nat

    assert config.RELAY_MODES == nat.RELAY_MODES and config.REACHABILITY_MODES == nat.FORCED_REACHABILITY


def test_the_daemon_never_imports_torch() -> None:
    # DESIGN.md: the daemon stays light; torch lives in the worker process only.
    import subprocess
    import sys

    code = "import sys, node.cli, node.daemon, node.simulate; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--report", "/nonexistent-dir/report.json"], "folder /nonexistent-dir does not exist"),
        (["--plot", "/tmp"], "is a folder"),
        (["--port", "70000"], None),
    ],
)
def test_bad_output_paths_and_ports_fail_in_one_line_before_any_work(
    args: list[str], message: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    from node.cli import main

    command = ["simulate", *args] if args[0] != "--port" else ["node", *args, "--data-dir", "/nonexistent-dir/d"]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("swarmtrain: config error:")
    assert message is None or message in err
