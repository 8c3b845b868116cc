"""The run's output directory: created and checked once, held by one run at a time.

Two runs writing one directory interleave metrics, overwrite each other's checkpoints and,
worst, the second silently continues the first one's weights. Rank 0 therefore holds an
exclusive ``flock`` on the directory (and on ``<output_dir>/.lock``) for the whole run. The OS drops the lock when
the process ends in any way, SIGKILL included, so a crashed run never blocks its restart.
The file itself stays (deleting a lock file races with the next taker); it only says who
holds it, for the message the next run prints.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from coretrain.errors import UserError

LOCK_NAME = ".lock"
RECORDED_CONFIG = "config.toml"
RECORDED_HEADER = "# coretrain: the resolved config of the run in this directory, written at each start\n"
"""The first line of the config a run records: a ``config.toml`` without it, in a directory no run
has checkpointed into, is a file of the user's (the config being run, when run.output_dir = ".")."""


def prepare(path: Path, key: str = "run.output_dir") -> None:
    """Create ``path`` (and parents) or say in one line why it cannot be a run's directory."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}: '{path}' exists and is not a directory; choose another output dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except NotADirectoryError:
        raise UserError(f"{key}: a parent of '{path}' is a file, not a directory") from None
    except PermissionError:
        raise UserError(f"{key}: no permission to create '{path}'") from None
    except OSError as exc:
        raise UserError(f"{key}: cannot create '{path}': {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{key}: '{path}' is not writable by this user")
    inner = path / "checkpoints"  # what the run makes inside: a file there would fail the first save
    if inner.exists() and not inner.is_dir():
        raise UserError(f"{key}: '{inner}' exists and is not a directory; move it away, or choose another output dir")
    recorded = path / RECORDED_CONFIG  # the run writes its resolved config there: never over a file of the user's
    if recorded.is_file() and not inner.is_dir() and not _starts_with(recorded, RECORDED_HEADER.encode()):
        raise UserError(
            f"{key}: '{path}' holds a {RECORDED_CONFIG} no run wrote (yours?), and the run would write its resolved "
            f'config over it; give the run a directory of its own (run.output_dir = "runs/{{name}}"), or move the file'
        )


def _starts_with(path: Path, prefix: bytes) -> bool:
    with open(path, "rb") as file:
        return file.read(len(prefix)) == prefix


class OutputDirLock:
    """An exclusive lock on a run's output dir, held until :meth:`release` or process exit.

    The lock is held on the directory itself, which a stray ``rm .lock`` cannot take away
    (a lock on the file alone let a second run take the directory once the file was deleted,
    and both trained into it). ``.lock`` is locked too, for older coretrain versions, and
    names the holder. Where the filesystem cannot lock a directory (NFS emulates ``flock``
    with byte-range locks, which a directory opened for reading cannot take), the file lock
    is what remains.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self._directory: int | None = None

    def acquire(self) -> OutputDirLock:
        """Take both locks without waiting, or refuse naming the holder. The directory's own lock
        holds even if someone deletes ``.lock``; the file's holds on filesystems that cannot lock
        a directory, and records who holds it for the next run's message."""
        prepare(self.path)
        lock_path = self.path / LOCK_NAME
        directory = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(directory, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(directory)
            if exc.errno in _HELD:
                raise self._in_use(lock_path) from None
            directory = -1  # this filesystem cannot lock a directory: the file lock alone
        handle = open(lock_path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.close()
            if directory >= 0:
                os.close(directory)
            if exc.errno in _HELD:
                raise self._in_use(lock_path) from None
            raise UserError(f"{self.path}: cannot lock {lock_path}: {exc.strerror}") from None
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {since}\n")
        handle.flush()
        self._file, self._directory = handle, directory if directory >= 0 else None
        return self

    def _in_use(self, lock_path: Path) -> UserError:
        """The refusal, naming the process that holds the directory as its ``.lock`` says."""
        try:
            holder = lock_path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            holder = ""
        return UserError(
            f"{self.path} is in use by {holder or 'another process (its .lock file was removed)'}; "
            "wait for that run to end, or give this one another run.output_dir"
        )

    def release(self) -> None:
        """Let go at the run's end (the process may go on: the API, tests, an in-process restart);
        the file stays."""
        if self._file is not None:
            self._file.close()  # closing the descriptors drops the locks
            self._file = None
        if self._directory is not None:
            os.close(self._directory)
            self._directory = None


_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


SHARED_CHECK = ".shared-check"


def check_shared(path: Path, rank: int) -> None:
    """Every rank must see the files rank 0 writes here: a checkpoint's ranks write into one
    directory, and resume reads every rank's file. Rank 0 writes a random token; every rank
    reads it back; the ranks agree on the first one that cannot (two tiny CPU all-reduces, at
    start: the token reaches the others as the maximum of it and their zeros)."""
    import secrets

    from coretrain.dist import max_over_ranks

    written = 0
    if rank == 0:
        written = secrets.randbits(62)
        (path / SHARED_CHECK).write_text(str(written))
    token = max_over_ranks(written)[0]
    try:
        seen = int((path / SHARED_CHECK).read_text())
    except (OSError, ValueError):
        seen = -1
    blind = rank + 1 if seen != token else 0
    worst = max_over_ranks(blind)[0]
    if worst:
        raise UserError(
            f"run.output_dir: {path} is not one directory for every rank: rank {worst - 1} on "
            f"{socket.gethostname() if blind else 'another node'} does not see what rank 0 wrote there; "
            "checkpoints need a directory all nodes share (a network filesystem such as NFS or Lustre), "
            "e.g. an absolute path on it"
        )
