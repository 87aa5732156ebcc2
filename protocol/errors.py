"""Errors raised by the protocol layer.

    ProtocolError                 anything that went wrong talking to peers
    ├── DialError                 could not reach a peer (all addresses failed or timed out)
    ├── StreamError               a stream broke: closed, reset, or ended early
    │   └── NotSupported          the peer does not speak the protocol we asked for
    ├── Overdue                   a handler's deadline passed after the peer had sent its
    │                             request: we, or the link, were slow; nobody is penalized
    └── BadMessage                a peer sent something we refuse (malformed, oversized,
        │                         wrong version, invalid content); the peer gets penalized
        └── UnsupportedVersion    a well-formed message of a protocol version we don't speak

libp2p's own exceptions never leave protocol/net/host.py: they are mapped to these there.
"""


class ProtocolError(Exception):
    """Base class of every error raised by protocol/."""


class DialError(ProtocolError):
    """Could not connect to a peer."""


class StreamError(ProtocolError):
    """A stream was closed, reset or ended before a whole message arrived."""


class NotSupported(StreamError):
    """The peer answered that it does not speak the protocol we opened a stream for."""


class Overdue(ProtocolError):
    """A handler ran past its deadline although the peer had sent its request: on an
    overloaded machine that is our own slowness as often as the peer's, so it is no
    penalty (a peer that sends nothing still earns one: protocol/net/hostlike.py)."""


class BadMessage(ProtocolError):
    """A peer sent bytes we refuse to act on."""


class UnsupportedVersion(BadMessage):
    """A peer speaks a message version we do not: refused with one clear answer naming both
    versions, never penalized (an old or newer release is not an attack)."""

    def __init__(self, message: str, *, theirs: int | None = None, ours: int | None = None) -> None:
        super().__init__(message)
        self.theirs = theirs
        self.ours = ours
