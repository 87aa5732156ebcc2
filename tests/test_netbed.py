"""The NAT test bed: hosts behind separate NATs reach the public node, nothing reaches them."""

import subprocess
import sys

import pytest

from node.simulate.netbed import Netbed, NetbedUnavailable, check_available

try:
    check_available()
except NetbedUnavailable as exc:
    pytest.skip(f"NAT test bed unavailable here: {exc}", allow_module_level=True)

SERVER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 9000)); s.listen(); print('ready', flush=True)\n"
    "s.settimeout(20); c, addr = s.accept(); print(addr[0], flush=True)\n"
)
CLIENT = "import socket, sys; socket.create_connection((sys.argv[1], 9000), timeout=2); print('connected')"


def serve(bed: Netbed, role: str) -> subprocess.Popen[str]:
    server = subprocess.Popen([*bed.exec_prefix(role), sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server


def connect(bed: Netbed, role: str, ip: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*bed.exec_prefix(role), sys.executable, "-c", CLIENT, ip], capture_output=True, text=True, timeout=20
    )


def test_hosts_behind_nat_reach_the_public_node_from_their_nats_address() -> None:
    with Netbed() as bed, serve(bed, "pub") as server:
        try:
            assert connect(bed, "host0", bed.public_ip).returncode == 0
            assert server.stdout is not None and server.stdout.readline().strip() == bed.nat_wan_ip(0)  # masquerade
        finally:
            server.kill()


def test_nothing_reaches_a_host_behind_nat_unasked() -> None:
    with Netbed() as bed, serve(bed, "host1") as server:
        try:
            for role, ip in (("pub", bed.nat_wan_ip(1)), ("host0", bed.host_ip(1)), ("host0", bed.nat_wan_ip(1))):
                result = connect(bed, role, ip)
                assert result.returncode != 0, f"{role} reached {ip}"
        finally:
            server.kill()


def test_the_bed_leaves_no_namespace_behind() -> None:
    bed = Netbed().open()
    names = list(bed.namespaces)
    bed.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert names and not any(name in listed for name in names)
