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


class NativeStderr:
    """Descriptor 2 to a log file, and back; Python's stderr to the terminal meanwhile."""

    def __init__(self) -> None:
        self._terminal: int | None = None
        self._python_stderr: IO[str] | None = None

    def divert(self, log_file: Path) -> None:
        if self._terminal is not None:
            return
        try:
            native = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:  # the run's own checks name an unusable directory
            return
        sys.stderr.flush()
        self._terminal = os.dup(2)
        os.dup2(native, 2)
        os.close(native)
        if writes_to_fd_2(sys.stderr):  # Python's own lines go on to the terminal
            self._python_stderr = sys.stderr
            sys.stderr = io.TextIOWrapper(
                io.FileIO(self._terminal, "w", closefd=False), line_buffering=True, errors="backslashreplace"
            )
            self._repoint(self._python_stderr, sys.stderr)
            if faulthandler.is_enabled():  # a fatal signal's stacks: on the terminal, as before
                faulthandler.enable(file=sys.stderr, all_threads=True)

    def restore(self) -> None:
        if self._terminal is None:
            return
        if self._python_stderr is not None:
            sys.stderr.flush()
            terminal_stream, sys.stderr = sys.stderr, self._python_stderr
            self._repoint(terminal_stream, sys.stderr)
            if faulthandler.is_enabled():
                faulthandler.enable(file=sys.stderr, all_threads=True)
            terminal_stream.close()  # (the descriptor stays: closefd=False)
            self._python_stderr = None
        os.dup2(self._terminal, 2)
        os.close(self._terminal)
        self._terminal = None

    def _repoint(self, old: Any, new: Any) -> None:
        """Handlers made with the old ``sys.stderr`` (the console's, torch's own) write to the new."""
        for handler in _stream_handlers():
            if handler.stream is old:
                handler.setStream(new)


def _stream_handlers() -> list[logging.StreamHandler[Any]]:
    loggers = [logging.getLogger(), *logging.root.manager.loggerDict.values()]
    return [
        handler
        for logger in loggers
        if isinstance(logger, logging.Logger)
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
    ]
