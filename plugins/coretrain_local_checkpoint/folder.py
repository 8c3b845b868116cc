"""The run's own folder in ``local_dir``: private to its user, found again by the run's restarts
and by no other run.

Its name, ``coretrain-<uid>-<key>``, holds a digest of rank 0's output directory — its resolved
path and its inode — so two runs whose output directories have the same path on two hosts that
share ``/dev/shm`` (containers with ``--ipc=host``) get two folders, while every restart of one
run (in process, by the launcher, a replaced rank) finds the same one. The folder is made 0700
and must stay a directory of this user's that no one else can write: ``/dev/shm`` is writable
by everyone, so a symbolic link or a folder planted under that name beforehand is refused
before anything in it is read, written or deleted.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from coretrain import UserError

KEY = "plugins.local-checkpoint.local_dir"
PREFIX = "coretrain-"


def usable_local_dir(local_dir: str) -> Path:
    """``local_dir`` checked as a place a run may keep its folder (made when missing), or one
    error naming the key."""
    path = Path(local_dir)
    if not path.is_absolute():
        raise UserError(f"{KEY}: '{local_dir}' is a relative path; give an absolute one (/dev/shm, a local disk)")
    if not path.exists():  # made, as a folder of this user's only (a fast disk's mount point, a new folder)
        try:
            path.mkdir(parents=True, mode=0o700)
        except FileExistsError:
            pass  # another rank of this machine made it meanwhile
        except OSError as exc:
            raise UserError(
                f"{KEY}: cannot make {local_dir}: {exc.strerror}; choose a directory you can write"
            ) from None
    if not path.is_dir():
        raise UserError(f"{KEY}: {local_dir} is not a directory; choose a directory (/dev/shm, a local disk)")
    mode = path.stat().st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise UserError(
            f"{KEY}: {local_dir} can be written by every user and is not sticky (mode {stat.filemode(mode)}): "
            "another user could replace the run's folder there; choose a directory of yours, or /dev/shm"
        )
    return path


def folder_name(output_dir: Path) -> str:
    """The run's folder name, from its output directory as this process sees it (rank 0's is used)."""
    resolved = output_dir.resolve()
    inode = resolved.stat().st_ino if resolved.exists() else 0
    digest = hashlib.sha256(f"{resolved}\0{inode}".encode()).hexdigest()[:16]
    return f"{PREFIX}{os.geteuid()}-{digest}"


def private_folder(path: Path) -> None:
    """Make ``path`` (mode 0700) or check that the one there is this user's own private directory."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UserError(f"{KEY}: cannot make {path}: {exc.strerror}; choose a directory you can write") from None
    found = os.lstat(path)
    if stat.S_ISLNK(found.st_mode):
        raise UserError(
            f"{KEY}: {path} is a symbolic link, not the run's own folder (was it planted?); nothing was "
            "read or deleted through it: remove it, or choose another local_dir"
        )
    if not stat.S_ISDIR(found.st_mode):
        raise UserError(f"{KEY}: {path} is not a directory; remove it, or choose another local_dir")
    if found.st_uid != os.geteuid():
        raise UserError(
            f"{KEY}: {path} belongs to another user (uid {found.st_uid}); its checkpoints are not this run's to "
            "resume: choose another local_dir"
        )
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UserError(
            f"{KEY}: {path} can be written by other users (mode {stat.filemode(found.st_mode)}), so its "
            "checkpoints may not be this run's: remove it, or choose another local_dir"
        )
    if found.st_mode & 0o077:  # readable by others (a folder of an older coretrain): made private
        os.chmod(path, 0o700)


def make_private(path: Path) -> None:
    """Everything under ``path``: folders 0700, files 0600 (what the core and the copies wrote
    with the process's umask; unreachable by others already, through the folder's 0700)."""
    for entry in path.rglob("*"):
        try:
            if entry.is_symlink():
                continue
            wanted = 0o700 if entry.is_dir() else 0o600
            if stat.S_IMODE(entry.stat().st_mode) != wanted:
                os.chmod(entry, wanted)
        except FileNotFoundError:  # (removed meanwhile: the core keeps the newest step only)
            continue
