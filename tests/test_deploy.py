"""deploy/: the files parse, and every swarmtrain command in them is one our CLI accepts
(no Docker here: what can be checked without building an image; tests/test_wheel.py builds
and runs the image where a Docker engine answers)."""

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from node.cli import build_parser
from node.launch import node_config

DEPLOY = Path(__file__).parent.parent / "deploy"
A_PEER_ID = "12D3KooWRQR6dEJXaYFpJcVNJ2gCWNScK5th5Cp4oFTyJnM2bvKx"


def swarmtrain_args(service: dict[str, Any]) -> list[str]:
    """The arguments a service gives swarmtrain: its command under the image's entrypoint,
    or what its shell script finally ``exec``s (peer ids read at start stand in as one)."""
    command = service["command"]
    if service.get("entrypoint") != ["sh", "-c"]:
        return [str(part) for part in command]
    script = " ".join(command)
    found = re.search(r"exec swarmtrain (.*)$", script, re.DOTALL)
    assert found, f"the script never starts swarmtrain: {script}"
    return shlex.split(re.sub(r"\$\$\(cat [^)]*\)", A_PEER_ID, found.group(1)))


def check_cli(args: list[str], tmp_path: Path) -> Any:
    parsed = build_parser().parse_args(args)  # SystemExit (a usage error) fails the test
    if parsed.command in ("node", "join"):
        bootstrap = [parsed.multiaddr] if parsed.command == "join" else None
        parsed.data_dir = tmp_path  # the container's /data
        node_config(parsed, bootstrap=bootstrap)  # every value checked as the daemon would
    return parsed


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_install_the_pinned_torch_and_start_swarmtrain(name: str, tmp_path: Path) -> None:
    lines = [line.strip() for line in (DEPLOY / name).read_text().splitlines() if line.strip()]
    instructions = {line.split()[0] for line in lines if not line.startswith("#")}
    assert {"FROM", "RUN", "COPY", "ENTRYPOINT", "CMD"} <= instructions
    assert any("torch==2.13.0" in line for line in lines if line.startswith("RUN"))
    for package in ("node", "protocol", "training", "kernels"):
        assert any(line == f"COPY {package} ./{package}" for line in lines), package
    (entrypoint,) = [line for line in lines if line.startswith("ENTRYPOINT")]
    assert entrypoint == 'ENTRYPOINT ["swarmtrain"]'
    (cmd,) = [line for line in lines if line.startswith("CMD")]
    args = yaml.safe_load(cmd.removeprefix("CMD"))  # a JSON list
    assert check_cli(args, tmp_path).command == "node"


def test_the_testnet_runs_a_bootstrap_and_three_trainers_that_prometheus_scrapes(tmp_path: Path) -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    nodes = {name: s for name, s in services.items() if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"}
    assert set(nodes) == {"bootstrap", "node1", "node2", "node3"}
    commands = {name: check_cli(swarmtrain_args(s), tmp_path) for name, s in nodes.items()}
    assert commands["bootstrap"].role == "bootstrap"
    assert commands["node1"].new_run and commands["node1"].bootstrap[0].startswith("/dns4/bootstrap/tcp/7400/")
    for joiner in ("node2", "node3"):
        assert commands[joiner].command == "join" and commands[joiner].multiaddr.startswith("/dns4/node1/tcp/7400/")
    volumes = set(compose["volumes"])
    for service in nodes.values():
        assert {v.split(":")[0] for v in service["volumes"]} <= volumes
    scraped = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"][0]
    metrics = {f"{name}:{c.metrics_port}" for name, c in commands.items() if c.metrics_port}
    assert set(scraped["targets"]) == metrics == {"node1:9400", "node2:9400", "node3:9400"}
    assert all(commands[name].metrics_host == "0.0.0.0" for name in ("node1", "node2", "node3"))
    grafana = services["grafana"]["volumes"]
    assert any(v.startswith("./grafana-dashboard.json:") for v in grafana)
    for provisioning in (DEPLOY / "grafana" / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(provisioning.read_text())["apiVersion"] == 1


def test_the_systemd_unit_starts_a_valid_node(tmp_path: Path) -> None:
    unit = (DEPLOY / "swarmtrain.service").read_text()
    (exec_start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    binary, *args = shlex.split(exec_start.removeprefix("ExecStart="))
    assert binary.endswith("/swarmtrain")
    config = args.index("--config")
    args[config + 1] = str(DEPLOY / "node.example.toml")  # the file the unit expects there, as shipped
    assert check_cli(args, tmp_path).command == "node"
