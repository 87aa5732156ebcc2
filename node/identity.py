"""The node's persistent ed25519 identity: one 32-byte seed in a 0600 file.

Same file, same PeerID, across restarts. The file is created with O_EXCL and mode 0600
in one step, so there is no moment where another user could read it.
"""

import logging
import os
import secrets
import stat
from pathlib import Path

from node.errors import DataDirError

logger = logging.getLogger(__name__)

SEED_NBYTES = 32
IDENTITY_FILE = "identity.key"
RECORD_FILE = "identity.peer_id"
"""The peer id this data dir had at its last start: a replaced key file is noticed."""


def load_or_create(path: Path) -> bytes:
    """Return the identity seed stored at ``path``, creating it on first use."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _load(path)
    except OSError as exc:
        raise DataDirError(f"cannot create identity file {path}: {exc.strerror}") from exc
    seed = secrets.token_bytes(SEED_NBYTES)
    with os.fdopen(fd, "wb") as f:
        f.write(seed)
        f.flush()
        os.fsync(f.fileno())
    logger.info("created a new identity in %s", path)
    return seed


def _load(path: Path) -> bytes:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        seed = path.read_bytes()
    except OSError as exc:
        raise DataDirError(f"cannot read identity file {path}: {exc.strerror}") from exc
    if len(seed) != SEED_NBYTES:
        raise DataDirError(
            f"identity file {path} holds {len(seed)} bytes, expected {SEED_NBYTES}; "
            "move it away to create a new identity"
        )
    if mode & 0o077:
        logger.warning("identity file %s was readable by others (mode %o); set it to 0600", path, mode)
        path.chmod(0o600)
    return seed


def remember(path: Path, peer_id: str) -> str | None:
    """Record ``peer_id`` as this data dir's; a warning (to print loudly) if it had another.

    A replaced or regenerated key file silently made a new peer before issue 12: peers
    then saw a stranger, its old member record and log entries were orphaned. It may be
    intended (a copied data dir must not share a key), so it is reported, not refused.
    """
    try:
        previous = path.read_text().strip() if path.exists() else None
        if previous != peer_id:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(peer_id + "\n")
            os.replace(tmp, path)
    except OSError as exc:
        raise DataDirError(f"cannot record the peer id in {path}: {exc.strerror}") from exc
    if previous is None or previous == peer_id:
        return None
    return (
        f"this data dir's identity changed: it was peer {previous}, it is now {peer_id} (the key file "
        f"{path.with_name(IDENTITY_FILE)} was replaced or recreated). Peers see a new node; the old one's "
        "records and updates stay under the old id. If that was not intended, stop this node and restore "
        "the old key file."
    )
