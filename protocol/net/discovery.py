"""Finding peers: bootstrap dials and a Kademlia provider record per run.

Every node of a run provides the key ``sha256("swarmtrain-run:" + run id)`` in the DHT
(server mode: we also store records for others) and looks it up again and again: every
``interval_s`` while the look-ups keep finding someone new, backing off to
``idle_interval_s`` once they stop. A look-up that finds a peer dials it and hands it to
``on_peer``. Bootstrap peers are dialed happy-eyeballs style (all at once, first win
counts); if none answers we keep retrying with backoff, the daemon stays up meanwhile.
"""

import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from protocol.errors import ProtocolError
from protocol.net.host import Host, PeerAddrs

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

# Provider records expire after 24 h in libp2p; re-announcing hourly also reaches peers
# that joined the DHT after our first announcement.
REPROVIDE_INTERVAL_S = 3600.0
BOOTSTRAP_RETRY_MAX_S = 30.0
MAX_PARALLEL_DIALS = 8

PeerCallback = Callable[[str, str], Awaitable[None]]


def run_key(run_id: str) -> bytes:
    return hashlib.sha256(f"swarmtrain-run:{run_id}".encode()).digest()


class Discovery:
    def __init__(
        self,
        host: Host,
        *,
        run_id: str | None,
        bootstrap: list[PeerAddrs],
        dial_timeout_s: float,
        interval_s: float,
        idle_interval_s: float,
        on_peer: PeerCallback,
    ) -> None:
        self._host = host
        self._run_id = run_id
        self._bootstrap = bootstrap
        self._dial_timeout_s = dial_timeout_s
        self._interval_s = interval_s
        self._idle_interval_s = idle_interval_s
        self._on_peer = on_peer
        self.num_lookups = 0
        self.found: set[str] = set()
        """Run peers that DHT look-ups turned up."""
        self.bootstrapped = trio.Event()
        self._reprovide = trio.Event()

    async def run(self, *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_bootstrapped)
            task_status.started()
            if self._run_id is None:
                return
            await self.bootstrapped.wait()
            nursery.start_soon(self._provide_loop)
            await self._lookup_loop()

    async def _keep_bootstrapped(self) -> None:
        if not self._bootstrap:
            self.bootstrapped.set()
            return
        delay_s = 1.0
        while True:
            if not any(b.peer_id in self._host.connected_peers() for b in self._bootstrap):
                if await self._dial_bootstrap():
                    delay_s = 1.0
                    self.bootstrapped.set()
                else:
                    logger.warning("no bootstrap peer answered; retrying in %.0f s", delay_s)
                    await trio.sleep(delay_s)
                    delay_s = min(2 * delay_s, BOOTSTRAP_RETRY_MAX_S)
                    continue
            await trio.sleep(self._idle_interval_s)

    async def _dial_bootstrap(self) -> bool:
        reached: list[str] = []

        async def dial(peer: PeerAddrs) -> None:
            try:
                await self._host.connect(peer, timeout_s=self._dial_timeout_s)
            except ProtocolError as exc:
                logger.info("bootstrap %s: %s", peer.peer_id, exc)
                return
            reached.append(peer.peer_id)
            await self._on_peer(peer.peer_id, "bootstrap")

        async with trio.open_nursery() as nursery:
            for peer in self._bootstrap:
                nursery.start_soon(dial, peer)
        return bool(reached)

    def reprovide(self) -> None:
        """Announce again now (our addresses changed: a relay slot came or went)."""
        self._reprovide.set()

    async def _provide_loop(self) -> None:
        assert self._run_id is not None
        while True:
            self._reprovide = trio.Event()
            try:
                await self._host.dht_provide(run_key(self._run_id))
                logger.debug("announced run %s in the DHT", self._run_id)
            except ProtocolError as exc:
                logger.warning("could not announce the run in the DHT: %s", exc)
            with trio.move_on_after(REPROVIDE_INTERVAL_S):
                await self._reprovide.wait()

    async def _lookup_loop(self) -> None:
        assert self._run_id is not None
        key = run_key(self._run_id)
        wait_s = self._interval_s
        while True:
            found_new = await self._lookup(key)
            wait_s = self._interval_s if found_new else min(2 * wait_s, self._idle_interval_s)
            await trio.sleep(wait_s)

    async def _lookup(self, key: bytes) -> bool:
        try:
            providers = await self._host.dht_find_providers(key)
        except ProtocolError as exc:
            logger.info("DHT look-up failed: %s", exc)
            return False
        self.num_lookups += 1
        self.found.update(p.peer_id for p in providers)
        connected = self._host.connected_peers()
        new = [p for p in providers if p.peer_id not in connected]
        limiter = trio.CapacityLimiter(MAX_PARALLEL_DIALS)

        async def dial(peer: PeerAddrs) -> None:
            async with limiter:
                try:
                    await self._host.connect(peer, timeout_s=self._dial_timeout_s)
                except ProtocolError as exc:
                    logger.info("run peer %s from the DHT: %s", peer.peer_id, exc)
                    return
            await self._on_peer(peer.peer_id, "dht")

        async with trio.open_nursery() as nursery:
            for peer in new:
                nursery.start_soon(dial, peer)
        return bool(new)
