"""Lines C and C++ code writes itself — torch's store clients when a peer is gone (a stack of
``frame #`` lines), gloo, NCCL — go to file descriptor 2, past Python's logging, so no filter
of a handler can keep them off the console. For the run's length that descriptor is the log
file, and Python's own ``sys.stderr`` (the console handler, warnings, the CLI's error lines,
tracebacks) keeps writing to the terminal through a copy of the original descriptor.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import sys
from pathlib import Path
from typing import IO, Any


def writes_to_fd_2(stream: Any) -> bool:
    try:
        return bool(stream.fileno() == 2)
    except (AttributeError, OSError, ValueError):  # a capture (pytest's, a notebook's): not the descriptor
        return False


_terminals: dict[tuple[int, int], IO[str]] = {}
"""A writer of the terminal per file the process's descriptor 2 was on at a run's start, kept for
the process's life: a handler a library made during a run with it keeps working after."""


def terminal_writer() -> IO[str]:
    """A text stream onto a copy of what descriptor 2 is now (made once per such file)."""
    found = os.fstat(2)
    key = (found.st_dev, found.st_ino)
    if key not in _terminals:
        _terminals[key] = io.TextIOWrapper(
            io.FileIO(os.dup(2), "w", closefd=True), line_buffering=True, errors="backslashreplace"
        )
    return _terminals[key]


class NativeStderr:
    """Descriptor 2 to a log file, and back; Python's stderr to the terminal meanwhile."""

    def __init__(self) -> None:
        self._saved: int | None = None
        self._python_stderr: IO[str] | None = None

    def divert(self, log_file: Path) -> None:
        if self._saved is not None:
            return
        try:
            native = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:  # the run's own checks name an unusable directory
            return
        sys.stderr.flush()
        terminal = terminal_writer()
        self._saved = os.dup(2)
        os.dup2(native, 2)
        os.close(native)
        if writes_to_fd_2(sys.stderr):  # Python's own lines go on to the terminal
            self._python_stderr, sys.stderr = sys.stderr, terminal
            _repoint(self._python_stderr, terminal)
            if faulthandler.is_enabled():  # a fatal signal's stacks: on the terminal, as before
                faulthandler.enable(file=terminal, all_threads=True)

    def restore(self) -> None:
        if self._saved is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = None
        if self._python_stderr is not None:
            terminal, sys.stderr = sys.stderr, self._python_stderr
            _repoint(terminal, sys.stderr)
            if faulthandler.is_enabled():
                faulthandler.enable(file=sys.stderr, all_threads=True)
            self._python_stderr = None


def _repoint(old: Any, new: Any) -> None:
    """Handlers made with the old ``sys.stderr`` (the console's, torch's own) write to the new."""
    for handler in _stream_handlers():
        if handler.stream is old:
            try:
                handler.setStream(new)
            except ValueError:  # (a stream closed by its owner: left as it is)
                continue


def _stream_handlers() -> list[logging.StreamHandler[Any]]:
    loggers = [logging.getLogger(), *logging.root.manager.loggerDict.values()]
    return [
        handler
        for logger in loggers
        if isinstance(logger, logging.Logger)
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
    ]
