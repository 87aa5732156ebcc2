"""Errors raised by the node layer.

    NodeError            anything the daemon or CLI reports to the user as one line
    ├── ConfigError      a bad config file or flag (subclass of ValueError too)
    ├── DataDirError     the data dir is unusable or already used by a running daemon
    └── ApiError         the control API is unreachable or answered with an error

Protocol-layer errors (protocol.errors) are mapped to these at the daemon's boundary.
"""


class NodeError(Exception):
    """Base class of every error raised by node/."""


class ConfigError(NodeError, ValueError):
    """A config file or flag has a bad value; the message names the field."""


class DataDirError(NodeError):
    """The data dir cannot be used."""


class ApiError(NodeError):
    """Talking to a running daemon failed."""
