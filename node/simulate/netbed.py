"""A NAT test bed on one machine: network namespaces, veth links and real NAT rules.

    ns <p>inet   bridge 10.N.0.254/24: the "internet"
    ns <p>pub    10.N.0.2           : a public node (bootstrap / relay)
    ns <p>natK   wan 10.N.0.(10+K), lan 192.168.K.1/24, nftables masquerade; unsolicited
                 inbound packets on the wan are dropped silently, as home routers do
    ns <p>hostK  192.168.K.2, default route via its NAT

Nothing touches the machine's own namespace: every interface lives in namespaces this
bed created, and ``close`` deletes them (also after a failure half way through setup).
Needs root, iproute2 and nftables; ``NetbedUnavailable`` says which is missing, so tests
can skip with that reason. The NATs are endpoint-independent ("cone"): one private
address and port keeps its public port for every destination, which is what hole
punching needs; port-randomising NATs are left for later.
"""

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

SETUP_TIMEOUT_S = 10.0
_NFT_RULES = """
table ip nat {{
  chain postrouting {{ type nat hook postrouting priority 100; oifname "wan" ip saddr {subnet} masquerade{flags}; }}
}}
table ip filter {{
  chain input {{ type filter hook input priority 0; policy accept;
    iifname "wan" ct state new drop
  }}
  chain forward {{ type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }}
}}
"""


class NetbedUnavailable(Exception):
    """This machine cannot build the bed (the message says why)."""


def check_available() -> None:
    if os.geteuid() != 0:
        raise NetbedUnavailable("network namespaces need root")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            raise NetbedUnavailable(f"{tool} is not installed (iproute2 / nftables)")
    name = f"swtprobe{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", name])
    except NetbedUnavailable as exc:
        raise NetbedUnavailable(f"cannot create a network namespace: {exc}") from exc
    _run(["ip", "netns", "del", name])


def _run(command: list[str], *, stdin: str | None = None) -> None:
    try:
        result = subprocess.run(
            command, input=stdin, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetbedUnavailable(f"{' '.join(command)}: {exc}") from exc
    if result.returncode != 0:
        raise NetbedUnavailable(f"{' '.join(command)}: {result.stderr.strip()[:300]}")


@dataclass
class Netbed:
    num_nats: int = 2
    prefix: str = field(default_factory=lambda: f"swt{secrets.token_hex(2)}")
    subnet: int = field(default_factory=lambda: 64 + secrets.randbelow(128))
    """The second octet of the public 10.x.0.0/24 (random: beds can run side by side)."""
    namespaces: list[str] = field(default_factory=list)
    symmetric: frozenset[int] = frozenset()
    """NATs (by index) that randomise the public port of every connection."""

    def ns(self, role: str) -> str:
        return f"{self.prefix}{role}"

    @property
    def public_ip(self) -> str:
        return f"10.{self.subnet}.0.2"

    def nat_wan_ip(self, k: int) -> str:
        return f"10.{self.subnet}.0.{10 + k}"

    def host_ip(self, k: int) -> str:
        return f"192.168.{k + 1}.2"

    def netns_path(self, role: str) -> str:
        """The file naming the namespace of ``role`` (for ``setns``)."""
        return f"/var/run/netns/{self.ns(role)}"

    def exec_prefix(self, role: str) -> list[str]:
        """Prefix a command with this to run it inside the namespace of ``role``."""
        return ["ip", "netns", "exec", self.ns(role)]

    def open(self) -> "Netbed":
        check_available()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        roles = ["inet", "pub"] + [f"nat{k}" for k in range(self.num_nats)] + [f"host{k}" for k in range(self.num_nats)]
        for role in roles:
            _run(["ip", "netns", "add", self.ns(role)])
            self.namespaces.append(self.ns(role))
            _run(["ip", "-n", self.ns(role), "link", "set", "lo", "up"])
        inet = self.ns("inet")
        _run(["ip", "-n", inet, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", inet, "addr", "add", f"10.{self.subnet}.0.254/24", "dev", "br0"])
        _run(["ip", "-n", inet, "link", "set", "br0", "up"])
        self._attach("pub", "eth0", self.public_ip)
        for k in range(self.num_nats):
            nat, host = self.ns(f"nat{k}"), self.ns(f"host{k}")
            self._attach(f"nat{k}", "wan", self.nat_wan_ip(k))
            gateway = f"192.168.{k + 1}.1"
            _run(["ip", "link", "add", "lan", "netns", nat, "type", "veth", "peer", "name", "eth0", "netns", host])
            _run(["ip", "-n", nat, "addr", "add", f"{gateway}/24", "dev", "lan"])
            _run(["ip", "-n", nat, "link", "set", "lan", "up"])
            _run(["ip", "-n", host, "addr", "add", f"{self.host_ip(k)}/24", "dev", "eth0"])
            _run(["ip", "-n", host, "link", "set", "eth0", "up"])
            _run(["ip", "-n", host, "route", "add", "default", "via", gateway])
            _run(["ip", "netns", "exec", nat, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            _run(
                ["ip", "netns", "exec", nat, "nft", "-f", "-"],
                stdin=_NFT_RULES.format(
                    subnet=f"192.168.{k + 1}.0/24", flags=" fully-random" if k in self.symmetric else ""
                ),
            )

    def _attach(self, role: str, ifname: str, ip: str) -> None:
        bridge_end = f"br{role}"[:15]
        _run(
            [
                "ip",
                "link",
                "add",
                ifname,
                "netns",
                self.ns(role),
                "type",
                "veth",
                "peer",
                "name",
                bridge_end,
                "netns",
                self.ns("inet"),
            ]
        )
        _run(["ip", "-n", self.ns("inet"), "link", "set", bridge_end, "master", "br0"])
        _run(["ip", "-n", self.ns("inet"), "link", "set", bridge_end, "up"])
        _run(["ip", "-n", self.ns(role), "addr", "add", f"{ip}/24", "dev", ifname])
        _run(["ip", "-n", self.ns(role), "link", "set", ifname, "up"])

    def close(self) -> None:
        """Delete every namespace this bed made (their interfaces go with them)."""
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=SETUP_TIMEOUT_S, check=False)
        self.namespaces.clear()

    def __enter__(self) -> "Netbed":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
