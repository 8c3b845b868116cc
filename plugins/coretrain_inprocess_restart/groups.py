"""Leaving a process group that peers may be blocked in: NCCL aborts its communicators; gloo has
no abort (its ``abort`` and ``shutdown`` leave the connections open, and a peer blocked in a
collective waits until this process exits), so its TCP connections are shut down here, which a
blocked peer sees at once as "Connection closed by peer" — the failure reaches every rank."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist


def _socket_inode(fd: int) -> int | None:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return int(target[8:-1]) if target.startswith("socket:[") else None


def tcp_connections(except_port: int) -> dict[int, int]:
    """This process's connected TCP sockets, fd -> inode, but those to or from ``except_port``
    (the store the next group is formed through: the launcher's, or the one rank 0 serves)."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        inode = _socket_inode(fd)
        if inode is None:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                if except_port not in (
                    sock.getpeername()[1],
                    sock.getsockname()[1],
                ):  # the store: client or server side
                    found[fd] = inode
        except OSError:  # not connected
            pass
        finally:
            sock.detach()  # the fd stays its owner's
    return found


def cut(connections: dict[int, int]) -> int:
    """Shut down (not close: the fds stay their owner's) each connection still open; how many."""
    done = 0
    for fd, inode in connections.items():
        if _socket_inode(fd) != inode:
            continue  # closed since, the fd perhaps reused
        sock = socket.socket(fileno=fd)
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return done


def abort_nccl() -> None:
    """NCCL's communicators aborted, so a peer's collective fails instead of hanging (torch's
    private ``_abort_process_group``, what torchft uses; not checked here: no GPU was lent)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        abort()
