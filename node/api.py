"""The local control API: a unix socket in the data dir, used by ``swarmtrain status/stop``.

Protocol flow, one exchange per connection (same framing as protocol/wire.py):

    client                                 daemon
    {t: <command>, v: 1}    ─────────────▶
                            ◀───────────── {t: "ok", v: 1, result: {...}}
                                           or {t: "error", v: 1, reason}

The socket is created mode 0600 inside the 0700 data dir: file permissions are the
authentication, so no token is needed. Commands: ``status``, ``stop`` and ``gather``
(fetch every live trainer's saved state for ``swarmtrain export --average``: gigabytes
for large models, so it has a deadline of its own).
"""

import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.errors import ApiError
from protocol import wire
from protocol.errors import ProtocolError

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

SOCKET_NAME = "api.sock"
VERSION = 1
MAX_FRAME_NBYTES = 4 << 20
REQUEST_TIMEOUT_S = 10.0
# sun_path holds 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_NBYTES = 107
COMMANDS = frozenset({"status", "stop", "gather"})
# Commands that take longer than a request's deadline, with their own.
SLOW_COMMANDS_S = {"gather": 900.0}
# Connections the kernel queues before we accept them. With 16, a burst of 200 clients
# (scripts polling status, dashboards) saw 167 refused: the queue is what bounds a burst,
# every accepted client is served in its own task with its own deadline.
LISTEN_BACKLOG = socket.SOMAXCONN

Handler = Callable[[], Awaitable[dict[str, Any]]]


class _TrioStream:
    """protocol.wire.ByteStream over a trio stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream

    async def read_exact(self, nbytes: int) -> bytes:
        chunks: list[bytes] = []
        remaining = nbytes
        while remaining:
            chunk = await self._stream.receive_some(min(remaining, 1 << 16))
            if not chunk:
                raise ProtocolError(f"connection closed {remaining} bytes early")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    async def write(self, data: bytes) -> None:
        await self._stream.send_all(data)


def socket_path(data_dir: Path) -> Path:
    path = data_dir / SOCKET_NAME
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_NBYTES:
        raise ApiError(f"data dir path too long for a unix socket ({path}); choose a shorter --data-dir")
    return path


async def serve(
    data_dir: Path, handlers: dict[str, Handler], *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED
) -> None:
    path = socket_path(data_dir)
    path.unlink(missing_ok=True)  # a stale socket from a crash; the data-dir lock says we own it
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(os.fspath(path))
    finally:
        os.umask(old_umask)
    sock.listen(LISTEN_BACKLOG)

    async def handle(stream: trio.SocketStream) -> None:
        byte_stream = _TrioStream(stream)
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                request = await wire.receive(
                    byte_stream, msg_types=COMMANDS, version=VERSION, max_nbytes=MAX_FRAME_NBYTES
                )
            handler = handlers.get(request["t"])
            if handler is None:
                raise ProtocolError(f"{request['t']!r} is not served here")
            with trio.fail_after(SLOW_COMMANDS_S.get(request["t"], REQUEST_TIMEOUT_S)):
                result = await handler()
                await wire.send(byte_stream, "ok", VERSION, {"result": result})
        except (ProtocolError, ApiError) as exc:
            logger.info("control API: refused: %s", exc)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await wire.send(byte_stream, "error", VERSION, {"reason": str(exc)})
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            logger.info("control API: client went away: %r", exc)
        finally:
            await stream.aclose()

    try:
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(handle, [listener])
    finally:
        path.unlink(missing_ok=True)


async def call(data_dir: Path, command: str, *, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """Send ``command`` to the daemon using ``data_dir``; raises ``ApiError``."""
    path = socket_path(data_dir)
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_unix_socket(os.fspath(path))
            async with stream:
                byte_stream = _TrioStream(stream)
                await wire.send(byte_stream, command, VERSION, {})
                reply = await wire.receive(
                    byte_stream, msg_types=frozenset({"ok", "error"}), version=VERSION, max_nbytes=MAX_FRAME_NBYTES
                )
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise ApiError(f"no daemon is running with data dir {data_dir}") from exc
    except (OSError, trio.BrokenResourceError) as exc:
        raise ApiError(f"control socket {path}: {exc}") from exc
    except trio.TooSlowError as exc:
        raise ApiError(f"the daemon did not answer within {timeout_s:g} s") from exc
    except ProtocolError as exc:
        raise ApiError(f"bad answer from the daemon: {exc}") from exc
    if reply["t"] == "error":
        raise ApiError(f"the daemon refused {command!r}: {reply.get('reason')}")
    result = reply.get("result")
    if not isinstance(result, dict):
        raise ApiError("bad answer from the daemon: no result")
    return result
