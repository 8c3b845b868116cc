"""Where a launcher's ranks write their error files: a temporary directory the launcher removes
when it ends — and, since a SIGKILLed launcher removes nothing, the next launcher on the machine
removes those of launchers that are gone (torchrun leaves its ``torchelastic_*`` directories)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

PREFIX = "coretrain-launch-"


def error_dir() -> Path:
    """A new directory named for this machine and this launcher's process; the directories of
    this machine's launchers whose process no longer exists are removed first."""
    host = socket.gethostname()
    for leftover in Path(tempfile.gettempdir()).glob(f"{PREFIX}{host}-*-*"):
        pid = leftover.name.removeprefix(f"{PREFIX}{host}-").split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{host}-{os.getpid()}-"))


def _running(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts: it is not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
