"""The node daemon: every service of one node in one trio nursery.

Start-up order: take the data-dir lock, load the identity, start the libp2p host, reach
the bootstrap peers, settle which run we are in (new, given, or the bootstrap peer's),
then run discovery, state sync and the control API until asked to stop. Stopping says
goodbye on gossip, saves the run state and closes the host: no traceback, exit 0.
"""

import contextlib
import dataclasses
import logging
import os
import resource
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node import api, identity
from node.algorithms.rounds import PayloadRounds
from node.config import NodeConfig
from node.datadir import DataDir
from node.device import detect_device, total_memory_nbytes
from node.errors import ApiError, ConfigError, NodeError
from node.logs import short_peer
from node.metrics import NodeMetrics, serve_metrics
from node.training import TrainingService
from node.versions import our_versions
from protocol.errors import BadMessage, NotSupported, ProtocolError
from protocol.net.discovery import Discovery
from protocol.net.host import Host, PeerAddrs, check_listen_addr, open_host, parse_dial_addr, peer_id_from_seed
from protocol.net.nat import NatPolicy
from protocol.net.peers import PeerTable
from protocol.runstate.info import NodeInfo, ask_info, serve_info
from protocol.runstate.run import RunService
from protocol.runstate.state import MAX_ADDRS, Manifest, MemberRecord, RunState, sign_member
from training import corpus, tokenizer
from training.files import write_atomic
from training.settings import RunSettings

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

AGENT = "swarmtrain/0.1.0"
# On a clean stop, how long the goodbye and the final save may take.
SHUTDOWN_GRACE_S = 3.0
# The start-up network line waits at most this long for reachability and a relay slot.
NETWORK_SETTLE_S = 30.0


def process_usage() -> dict[str, float | None]:
    """This daemon process's CPU seconds so far, its resident memory now and its peak (MB;
    now: None where /proc is not there to read)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss_mb = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        rss_mb = round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    return {
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "rss_mb": rss_mb,
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # kilobytes on Linux
    }


class Daemon:
    def __init__(self, config: NodeConfig, *, run_from_bootstrap: bool = False) -> None:
        """``run_from_bootstrap``: with no run configured, join the bootstrap peer's run."""
        self.config = config
        self._run_from_bootstrap = run_from_bootstrap
        self.data_dir = DataDir(config.data_dir)
        self.seed = b""
        self.peer_id = ""
        self.identity_warning: str | None = None
        """Set when the key file changed since the last start (said loudly, shown in status)."""
        self.metrics_url: str | None = None
        self.data_sha256 = ""
        """Of this node's --data ("" for the embedded corpus), hashed in ``prepare``."""
        self.data_path: str | None = None
        """This node's --data, made absolute in ``prepare``."""
        self.tokenizer_sha256 = ""
        """Of the BPE tokenizer a run we create trains with (``prepare``); "" for bytes."""
        self._new_tokenizer: str | None = None
        self.host: Host | None = None
        self.run_service: RunService | None = None
        self.discovery: Discovery | None = None
        self.training: TrainingService | None = None
        self.peers = PeerTable(ttl_s=config.state.peer_ttl_s)
        self.ready = trio.Event()
        self._stop = trio.Event()
        self._started_at = time.time()

    def prepare(self) -> str:
        """Take the data dir and load the identity (before logging is set up); returns the peer id."""
        self.data_dir.open()
        self.seed = identity.load_or_create(self.data_dir.identity_file)
        self.peer_id = peer_id_from_seed(self.seed)
        self.identity_warning = identity.remember(self.data_dir.path / identity.RECORD_FILE, self.peer_id)
        self._read_data()
        return self.peer_id

    def _read_data(self) -> None:
        """Before the network starts (a path that is not usable is the user's to fix now),
        reading the text once: the hash of this node's --data ("" for the embedded corpus),
        and for a run we create with a BPE tokenizer that tokenizer, trained on it, with its
        hash for the run's settings (every trainer trains its own alike)."""
        path = self.config.training.data
        vocab = tokenizer.bpe_vocab(self.config.run.settings.tokenizer) if self.config.run.new_run else None
        if path is None and vocab is None:
            return
        if path is not None:
            # Absolute from where the command ran: the worker and `export` read it from elsewhere.
            self.data_path = str(Path(path).expanduser().resolve())
        try:
            text = corpus.read_corpus(None if self.data_path is None else Path(self.data_path))
        except corpus.CorpusError as exc:
            raise ConfigError(f"training.data (--data): {exc}") from exc
        if path is not None:
            self.data_sha256 = corpus.text_sha256(text)
        if vocab is not None:
            self._new_tokenizer = tokenizer.train_bpe(text, vocab)
            self.tokenizer_sha256 = tokenizer.sha256(self._new_tokenizer)

    @property
    def run_settings(self) -> RunSettings:
        """What we would train: the configured settings with our data's hash."""
        return dataclasses.replace(
            self.config.run.settings, data_sha256=self.data_sha256, tokenizer_sha256=self.tokenizer_sha256
        )

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self, *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED) -> None:
        if not self.peer_id:
            self.prepare()
        net = self.config.network
        relay = NatPolicy(
            mode=net.relay,
            max_reservations=net.relay_max_reservations,
            max_circuits=net.relay_max_circuits,
            circuit_duration_s=net.relay_circuit_duration_s,
            circuit_data_mib=net.relay_circuit_data_mib,
            reservation_ttl_s=net.relay_reservation_ttl_s,
            reachability=net.reachability,
            upnp=net.upnp,
        )
        try:
            async with open_host(
                identity_seed=self.seed,
                listen_addrs=net.listen,
                announce_addrs=net.announce,
                mdns=net.mdns,
                relay=relay,
                preferred_peers=[parse_dial_addr(a).peer_id for a in net.bootstrap],
                relayed_tensors_mbps=net.relayed_tensors_mbps,
                peers=self.peers,
            ) as host:
                self.host = host
                await self._serve(host, task_status)
        except ProtocolError as exc:
            raise NodeError(str(exc)) from exc
        finally:
            self.host = None
            self.data_dir.close()

    async def _serve(self, host: Host, task_status: "TaskStatus[None]") -> None:
        if self.identity_warning:
            logger.error("%s", self.identity_warning)
        logger.info("peer id %s listening on %s", self.peer_id, ", ".join(host.addrs()))
        bootstrap = [parse_dial_addr(a) for a in self.config.network.bootstrap]
        run_id = await self._settle_run(host, bootstrap)
        state = self._open_state(run_id) if run_id else None
        serve_info(host, NodeInfo(self.peer_id, self.config.role, (run_id,) if run_id else (), AGENT, our_versions()))
        async with trio.open_nursery() as nursery:
            on_peer = self._on_peer_without_run
            if state is not None:
                self.run_service = RunService(
                    host,
                    state,
                    self.peers,
                    role=self.config.role,
                    heartbeat_interval_s=self.config.state.heartbeat_interval_s,
                    anti_entropy_interval_s=self.config.state.anti_entropy_interval_s,
                    dial_timeout_s=self.config.network.dial_timeout_s,
                )
                await nursery.start(self.run_service.run)
                on_peer = self.run_service.on_peer_connected
                nursery.start_soon(self.run_service.push, state.put_member(self._member_record(host, state)))
                nursery.start_soon(self._follow_addresses, host, state)
                nursery.start_soon(self._save_loop, state)
                if self.config.role == "trainer":  # trains what the run's manifest says
                    self.training = TrainingService(
                        host,
                        self.peers,
                        self.config.training,
                        state,
                        own_settings=self.run_settings,
                        data_path=self.data_path,
                        tokenizer_file=self.data_dir.tokenizer_file(state.run_id),
                        listen_ips=[check_listen_addr(a)[0] for a in self.config.network.listen],
                        log_path=str(self.config.data_dir / "worker.log"),
                        upload_limit_mbps=self.config.network.upload_limit_mbps,
                        checkpoint_path=str(self.data_dir.checkpoint_file(state.run_id)),
                        device=self.config.device,
                        identity_seed=self.seed,
                        run_service=self.run_service,
                    )
                    await nursery.start(self.training.run)
            self.discovery = Discovery(
                host,
                run_id=run_id,
                bootstrap=bootstrap,
                dial_timeout_s=self.config.network.dial_timeout_s,
                interval_s=self.config.discovery.interval_s,
                idle_interval_s=self.config.discovery.idle_interval_s,
                on_peer=on_peer,
            )
            await nursery.start(self.discovery.run)
            nursery.start_soon(self._say_network, host)
            handlers = {"status": self._api_status, "stop": self._api_stop, "gather": self._api_gather}
            await nursery.start(api.serve, self.config.data_dir, handlers)
            if self.config.metrics_port is not None:
                port = await nursery.start(
                    serve_metrics, self.config.metrics_host, self.config.metrics_port, self._metrics
                )
                self.metrics_url = f"http://{self.config.metrics_host}:{port}/metrics"
                logger.info("metrics at %s", self.metrics_url)
            self.ready.set()
            task_status.started()
            logger.info("ready%s", f" in run {run_id}" if run_id else " (no run: serving the DHT only)")
            try:
                await self._stop.wait()
                logger.info("stopping")
                with trio.move_on_after(SHUTDOWN_GRACE_S):
                    if self.run_service is not None:
                        await self.run_service.say_bye()
            finally:
                if state is not None:
                    self._save(state)  # also when cancelled: nothing learned is lost
            nursery.cancel_scope.cancel()

    async def _settle_run(self, host: Host, bootstrap: list[PeerAddrs]) -> str | None:
        run = self.config.run
        if run.new_run is not None:
            return f"{run.new_run}-{secrets.token_hex(3)}"
        if run.run_id is not None or not self._run_from_bootstrap:
            return run.run_id
        return await self._ask_bootstrap_for_run(host, bootstrap)

    async def _ask_bootstrap_for_run(self, host: Host, bootstrap: list[PeerAddrs]) -> str:
        errors: list[str] = []
        for peer in bootstrap:
            try:
                await host.connect(peer, timeout_s=self.config.network.dial_timeout_s)
            except ProtocolError as exc:
                addrs = ", ".join(peer.addrs)
                errors.append(
                    f"cannot reach {peer.peer_id} at {addrs} ({exc}): is it running, and is that its address and port?"
                )
                continue
            try:
                info = await ask_info(host, peer.peer_id)
            except NotSupported:
                errors.append(f"{peer.peer_id} answers but does not speak swarmtrain: is that the right address?")
                continue
            except ProtocolError as exc:
                errors.append(f"{peer.peer_id}: {exc}")
                continue
            differ = info.incompatible(our_versions())
            if differ:
                raise NodeError(
                    f"{peer.peer_id} runs another swarmtrain release ({info.agent}): {'; '.join(differ)}."
                    f" This node ({AGENT}) cannot train with it: run the same release"
                )
            if len(info.runs) == 1:
                logger.info("joining run %s of %s", info.runs[0], peer.peer_id)
                return info.runs[0]
            if info.runs:
                raise NodeError(f"{peer.peer_id} is in several runs ({', '.join(info.runs)}); pass --run ID")
            errors.append(f"{peer.peer_id} is in no run")
        raise NodeError("could not learn the run from the bootstrap peers: " + "; ".join(errors) + " (pass --run ID)")

    def _open_state(self, run_id: str) -> RunState:
        state = RunState(run_id)
        saved = self.data_dir.load_run(run_id)
        if saved is not None:
            try:
                state.load(saved)
                logger.info("loaded saved state of run %s (%d members)", run_id, len(state.members))
            except BadMessage as exc:
                corrupt = self.data_dir.run_file(run_id).with_suffix(".corrupt")
                self.data_dir.run_file(run_id).replace(corrupt)
                logger.warning(
                    "saved state of run %s is unusable (%s); moved to %s, resyncing from peers", run_id, exc, corrupt
                )
                state = RunState(run_id)
        if self.config.run.new_run is not None:
            state.create_manifest(
                Manifest(
                    run_id=run_id,
                    name=self.config.run.new_run,
                    creator=self.peer_id,
                    created_at=time.time(),
                    settings=self.run_settings.encode(),
                ),
                self.seed,
            )
            if self._new_tokenizer is not None:  # where the training service looks for it
                write_atomic(self.data_dir.tokenizer_file(run_id), self._new_tokenizer.encode())
            logger.info("created run %s", run_id)
        return state

    def _member_record(self, host: Host, state: RunState) -> MemberRecord:
        """Our record, signed, with a seq above any of ours peers may hold (a millisecond
        clock, and never below the last one we saw: it replaces the old one everywhere)."""
        previous = state.members.get(self.peer_id)
        record = MemberRecord(
            peer_id=self.peer_id,
            addrs=tuple(a.rsplit("/p2p/", 1)[0] for a in host.addrs())[:MAX_ADDRS],
            role=self.config.role,
            device=detect_device(self.config.device),
            memory_nbytes=total_memory_nbytes(),
            joined_at=previous.joined_at if previous else time.time(),
            seq=max(int(time.time() * 1000), previous.seq + 1 if previous else 0),
        )
        return sign_member(record, self.seed, state.run_id)

    async def _follow_addresses(self, host: Host, state: RunState) -> None:
        """Behind a NAT our addresses change as relay slots come and go: tell the run and the DHT."""
        assert self.run_service is not None
        addrs = host.addrs()
        while True:
            changed = host.nat.changed
            await changed.wait()
            if host.addrs() != addrs:
                addrs = host.addrs()
                await self.run_service.push(state.put_member(self._member_record(host, state)))
                if self.discovery is not None:
                    self.discovery.reprovide()

    async def _say_network(self, host: Host) -> None:
        """One line on what the network looks like from here, once it settled (or after a bound)."""
        with trio.move_on_after(NETWORK_SETTLE_S):
            while not network_settled(host.nat.summary()):
                changed = host.nat.changed
                with trio.move_on_after(1.0):
                    await changed.wait()
        logger.info("%s", network_line(host.nat.summary(), host.nat.connection_types(), host.transport_addrs()))

    async def _on_peer_without_run(self, peer_id: str, source: str) -> None:
        logger.debug("connected to %s (%s)", peer_id, source)

    async def _save_loop(self, state: RunState) -> None:
        saved_changes = -1
        while True:
            if state.num_changes != saved_changes:
                saved_changes = state.num_changes
                self._save(state)
            await trio.sleep(self.config.state.save_interval_s)
            if state.num_changes == saved_changes:
                await state.wait_changed()

    def _save(self, state: RunState) -> None:
        try:
            self.data_dir.save_run(state.run_id, state.encode())
        except OSError as exc:
            logger.error("could not save run state: %s", exc)

    async def _api_stop(self) -> dict[str, Any]:
        self.request_stop()
        return {"stopping": True}

    async def _api_status(self) -> dict[str, Any]:
        return self.status()

    async def _api_gather(self) -> dict[str, Any]:
        """The saved states of the run's live trainers, fetched for ``export --average``."""
        algorithm = self.training.algorithm if self.training else None
        if not isinstance(algorithm, PayloadRounds):
            raise ApiError("this node trains no noloco, diloco or local run: there are no peers' weights to average")
        directory = self.data_dir.path / "exports" / "peers"
        gathered = await algorithm.states.gather(algorithm.ctx.partners(), directory)
        return {"states": [{"peer": peer, "path": str(path), "round": r} for peer, path, r in gathered]}

    def status(self) -> dict[str, Any]:
        host = self.host
        rs = self.run_service
        live = self.peers.live()
        connected = host.connected_peers() if host else set()
        members = rs.state.members if rs else {}
        now = trio.current_time()
        nat = host.nat.summary() if host else None
        links = host.nat.connection_types() if host else {}
        peers = [
            {
                "peer_id": peer_id,
                "role": info.role or (members[peer_id].role if peer_id in members else ""),
                "last_seen_s": round(now - info.last_seen, 2),
                "connected": peer_id in connected,
                "connection": links.get(peer_id),
            }
            for peer_id, info in sorted(live.items())
        ]
        return {
            "peer_id": self.peer_id,
            "addrs": host.addrs() if host else [],
            "role": self.config.role,
            "run_id": rs.state.run_id if rs else None,
            "uptime_s": round(time.time() - self._started_at, 2),
            "process": process_usage(),
            "identity_changed": self.identity_warning,
            "reachability": host.nat.status.reachability if host else "unknown",
            "nat": nat,
            "network": network_line(nat, links, host.transport_addrs()) if host and nat else "",
            "peers_seen": len(live),
            "peers": peers,
            "connections": len(connected),
            "links": links,
            "dht_routing_table": host.dht_routing_table_size() if host else 0,
            # yamux's 256 streams per connection, fewest free over our connections: a leak shows here.
            "fewest_free_stream_slots": min(host.free_stream_slots().values(), default=None) if host else None,
            "stuck_connections_closed": host.stuck_connections_closed if host else 0,
            "members": len(members),
            "state_digest": rs.state.digest if rs else None,
            "manifest_name": rs.state.manifest.name if rs and rs.state.manifest else None,
            "num_pulls": rs.num_pulls if rs else 0,
            "num_pull_failures": rs.num_pull_failures if rs else 0,
            "num_dht_lookups": self.discovery.num_lookups if self.discovery else 0,
            "num_gossip_received": rs.num_gossip_received if rs else 0,
            "training": self.training.status() if self.training else None,
            "not_training": self.training.refusal if self.training else None,
            "metrics_url": self.metrics_url,
        }

    def _metrics(self) -> NodeMetrics:
        return NodeMetrics.of(self.status(), bans=self.peers.bans_total, penalties=self.peers.penalties_total)


def network_settled(nat: dict[str, Any]) -> bool:
    """Reachability known and, behind a NAT, a relay slot held."""
    return nat["reachability"] == "public" or (nat["reachability"] == "private" and bool(nat["reservations"]))


def network_line(nat: dict[str, Any], connections: dict[str, str], listen: list[str]) -> str:
    """What we found and what to do, in one line (the start-up summary and ``status``)."""
    direct = sum(kind == "direct" for kind in connections.values())
    peers = f"{direct} of {len(connections)} peers direct"
    port = next((a.rsplit("/", 1)[1] for a in listen if "/tcp/" in a), "?")
    seen = f" (seen as {nat['observed_ip']})" if nat["observed_ip"] else ""
    if nat["reachability"] == "public":
        offer = "; offering relay to peers behind NAT" if nat["offering_relay"] else ""
        return f"network: public address{seen}, peers can dial us{offer}; {peers}{_upnp_note(nat)}"
    if nat["reachability"] == "private":
        relays = ", ".join(short_peer(r) for r in sorted(nat["reservations"]))
        if relays:
            reserved = f"reserved relay {relays}: peers reach us through it, then hole-punch"
        else:
            reserved = "no relay slot yet (no reachable peer offers relay): only peers we dial reach us"
        return (
            f"network: no public address{seen}; {reserved}; {peers}; forward TCP port {port} to be dialable"
            f"{_upnp_note(nat)}"
        )
    return f"network: reachability unknown (not enough dial-back confirmations from distinct peers yet); {peers}"


def _upnp_note(nat: dict[str, Any]) -> str:
    if nat["upnp"] == "mapped":
        return f"; UPnP: the router forwards {nat['upnp_addr']}"
    if nat["upnp"].startswith("failed"):
        return f"; UPnP {nat['upnp']}"
    return ""
