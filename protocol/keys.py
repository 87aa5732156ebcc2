"""Node keys: signatures anyone can check knowing only the signer's peer id.

A node's identity is an ed25519 seed (node/identity.py); its libp2p peer id is the
identity multihash of its public key, so the key can be read back out of the id, and a
record signed by a node can be checked without asking anyone. Used for member records and
the manifest (protocol/runstate/state.py) and for ZO log batches (node/algorithms/zo/zolog.py).

A signature covers ``msgpack([domain, *fields])``: the domain names what is signed and its
format version ("swarmtrain/member/1"), so a signature made for one purpose never passes
for another. Fields are plain values (str, int, float, bytes, lists of those) in a fixed
order; the signer and the checker build the same list from typed values.
"""

from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import BadMessage

SIGNATURE_NBYTES = 64
SEED_NBYTES = 32
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# identity multihash (0x00, 36 bytes) of protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}
_ED25519_PEER_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
# A cache of signatures already checked (a document is re-validated on every update):
# (signer, signed bytes, signature) → valid. Bounded: cleared when full.
_MAX_CHECKED = 16384
_checked: set[tuple[str, bytes, bytes]] = set()


def _b58decode(text: str) -> bytes:
    value = 0
    for char in text:
        digit = _B58.find(char)
        if digit < 0:
            raise BadMessage("peer id is not base58")
        value = value * 58 + digit
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return b"\0" * (len(text) - len(text.lstrip("1"))) + raw


def _b58encode(data: bytes) -> str:
    value = int.from_bytes(data, "big")
    out = ""
    while value:
        value, digit = divmod(value, 58)
        out = _B58[digit] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The ed25519 key inside a peer id (``BadMessage`` for other kinds of id)."""
    if len(peer_id) > 64:
        raise BadMessage("peer id too long")
    raw = _b58decode(peer_id)
    if len(raw) != len(_ED25519_PEER_PREFIX) + 32 or not raw.startswith(_ED25519_PEER_PREFIX):
        raise BadMessage("peer id does not hold an ed25519 key")
    return Ed25519PublicKey.from_public_bytes(raw[len(_ED25519_PEER_PREFIX) :])


def peer_id_of(seed: bytes) -> str:
    """The peer id of a node key seed (the same as libp2p's, without importing libp2p)."""
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
    return _b58encode(_ED25519_PEER_PREFIX + public)


def signed_bytes(domain: str, fields: list[Any]) -> bytes:
    body: bytes = msgpack.packb([domain, *fields], use_bin_type=True)
    return body


def sign(seed: bytes, domain: str, fields: list[Any]) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(seed).sign(signed_bytes(domain, fields))


def verify(peer_id: str, signature: bytes, domain: str, fields: list[Any]) -> None:
    """``BadMessage`` unless ``peer_id``'s key signed ``fields`` under ``domain``."""
    if len(signature) != SIGNATURE_NBYTES:
        raise BadMessage(f"a signature is {SIGNATURE_NBYTES} bytes, got {len(signature)}")
    message = signed_bytes(domain, fields)
    key = (peer_id, message, bytes(signature))
    if key in _checked:
        return
    try:
        public_key_of(peer_id).verify(bytes(signature), message)
    except InvalidSignature as exc:
        raise BadMessage(f"bad signature on a {domain} record claiming to be from {peer_id}") from exc
    if len(_checked) >= _MAX_CHECKED:
        _checked.clear()
    _checked.add(key)
