"""``console-log``: a run's own lines on the console, everything in ``OUTPUT_DIR/run.log`` (on by default).

Libraries a run uses (torchao, torch's ``_pytree``, transformers, mlflow, torchdata) warn and
log on their own; on the console that buries the run's own lines. From ``configure_run`` on
(the run exists, nothing is built yet), records from installed libraries below ERROR — their
loggers and the Python warnings they raise — go to the log file only (``run.log``;
``run.rankN.log`` on other ranks), and the console says once at the end how many there were
and where. Lines from coretrain and its plugins (the ``coretrain`` logger) and warnings raised
by the user's own code (outside site-packages and the standard library) stay on the console.
Python warnings reach each handler once per distinct text. What C and C++ code writes itself
(torch's store clients, gloo, NCCL: file descriptor 2) goes to the log file too
(:mod:`coretrain_console_log.native`). The console handler is the one
``coretrain run`` sets up (named ``coretrain-console``); a notebook's own handlers are left
as they are, and only the log file is added.
"""

from __future__ import annotations

import logging
import os
import re
import site
import sysconfig
import warnings
from collections import Counter
from collections.abc import Generator
from pathlib import Path

from attrs import define, field

from coretrain import Run, hookimpl
from coretrain_console_log.native import NativeStderr

CONSOLE = "coretrain-console"
"""The name of the console handler ``coretrain run`` installs."""

LIBRARY_DIRS = tuple(
    sorted(
        {
            str(Path(p).resolve())
            for p in [
                *site.getsitepackages(),
                site.getusersitepackages(),
                *(sysconfig.get_paths()[name] for name in ("purelib", "platlib", "stdlib", "platstdlib")),
            ]
            if p
        },
        key=len,
        reverse=True,  # the most specific first: a library is named by its folder in site-packages
    )
)
"""Directories whose code is "a library": site-packages and the standard library."""
WARNING_SOURCE = re.compile(r"^(.*?):\d+: \w+: ")
"""``path:line: Category: text``, as ``logging.captureWarnings`` formats a warning."""


def source_file(record: logging.LogRecord) -> str:
    """The file that logged or warned: for a captured warning, the one named in its text."""
    if record.name == "py.warnings":
        match = WARNING_SOURCE.match(record.getMessage())
        return match.group(1) if match else ""
    return record.pathname


class LibraryNoise(logging.Filter):
    """Keeps libraries' records below ERROR off the console, counting them by library (in
    ``held``, which filters may share), and hands each to ``divert`` (the log file) where the
    record would not reach it otherwise."""

    def __init__(self, held: Counter[str] | None = None, divert: logging.Handler | None = None) -> None:
        super().__init__()
        self.held: Counter[str] = Counter() if held is None else held
        self.divert = divert

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.name.startswith("coretrain"):
            return True
        source = source_file(record)
        path = os.path.realpath(source) if source else ""
        library = next((d for d in LIBRARY_DIRS if path.startswith(d + os.sep)), None)
        if library is None:
            return True
        if self.divert is not None and getattr(record, "coretrain_diverted", False):
            return False  # another handler of the logger's took it to the log file already
        relative = Path(path).relative_to(library).parts
        self.held[relative[0].split(".")[0] if relative else "?"] += 1
        if self.divert is not None:
            record.coretrain_diverted = True
            self.divert.handle(record)
        return False


def own_terminal_handlers() -> list[logging.Handler]:
    """Terminal handlers of loggers that print for themselves rather than through the root
    logger's (torch's: ``torch`` and ``torch.distributed`` do not propagate, and write to stderr
    with handlers of their own).

    A stream handler with no stream yet prints nothing: torch's structured-trace handler
    (``torch.__trace``, a record for each step of a compilation) opens its file at its first
    record when ``TORCH_TRACE`` names a directory, and otherwise removes itself then. Filtered,
    it never saw that record: it stayed, torch built every trace record (with its stack) for
    ever after, and hundreds of empty DEBUG lines went to run.log."""
    loggers = [logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    return [
        handler
        for logger in loggers
        if not logger.propagate
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and handler.stream is not None
    ]


def shown_nowhere_else(record: logging.LogRecord) -> bool:
    """Whether no logger between the record's and the root has a handler: Python's last resort
    prints only such records, and so does the stand-in for it (``coretrain.train``'s own handler
    on the ``coretrain`` logger has shown the run's lines already: they were printed twice)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger is not logging.root:
        if logger.handlers:
            return False
        logger = logger.parent if logger.propagate else None
    return True


class OnceEach(logging.Filter):
    """Pass each distinct warning (category and text, wherever it was raised) once.

    Python's "once" filter is undone by libraries that warn inside ``catch_warnings`` blocks
    with filters of their own; a warning raised every step would then reach the console again."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "py.warnings":
            return True
        first = record.getMessage().splitlines()[0] if record.getMessage() else ""
        key = first.split(": ", 1)[-1]  # "path:line: Category: text" -> "Category: text"
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@define(kw_only=True)
class ConsoleLog:
    """Libraries' lines below ERROR to run.log only, counted on the console at the end."""

    _noise: LibraryNoise | None = field(default=None, init=False, repr=False)
    _diverted: list[tuple[logging.Handler, LibraryNoise]] = field(factory=list, init=False, repr=False)
    _file: logging.Handler | None = field(default=None, init=False, repr=False)
    _console: logging.Handler | None = field(default=None, init=False, repr=False)
    _stand_in: logging.Handler | None = field(default=None, init=False, repr=False)
    _native: NativeStderr = field(factory=NativeStderr, init=False, repr=False)
    """C and C++ code's own lines (file descriptor 2) to the log file."""
    """The console handler put in for Python's last resort (no handler set up), while diverting."""

    @hookimpl
    def configure_run(self, run: Run) -> None:
        name = "run.log" if run.dist.rank == 0 else f"run.rank{run.dist.rank}.log"
        self.divert(run.output_dir / name)
        self._native.divert(run.output_dir / name)

    @hookimpl(trylast=True)  # after every other plugin's: the libraries they imported have made their handlers
    def on_train_start(self) -> None:
        self._divert_own_handlers()

    @hookimpl(trylast=True)
    def close_run(self, run: Run) -> None:
        """One console line for the libraries' lines kept in the log file; the handler closed —
        however far the run got (a failed build too: the next run in this process starts clean)."""
        self._native.restore()
        self.restore(run.output_dir / "run.log" if run.dist.is_main else None)

    @hookimpl(wrapper=True)
    def export_model(self, run_dir: Path) -> Generator[None, str | None, str | None]:
        """``coretrain checkpoint export`` imports the model's libraries (transformers, peft and
        torchao with it): their lines go to the run's run.log, as in training."""
        self.divert(run_dir / "run.log")
        try:
            return (yield)
        finally:
            self.restore(run_dir / "run.log")

    def divert(self, log_file: Path) -> None:
        """From now on libraries' records below ERROR reach ``log_file`` and not the console: the
        console is ``coretrain run``'s handler or, where no handler is set up (the Python API in a
        script or notebook, a command), one that prints what Python's last resort would; a
        caller's own handlers are left as they are."""
        root = logging.getLogger()
        self._console = next((h for h in root.handlers if h.get_name() == CONSOLE), None)
        if self._console is None and not root.handlers:  # what Python's last resort would print, filtered
            self._console = self._stand_in = logging.StreamHandler()  # stderr, the message alone, as it does
            self._stand_in.setLevel(logging.WARNING)
            root.addHandler(self._stand_in)
        if self._console is not None:
            self._noise = LibraryNoise()
            self._console.addFilter(OnceEach())
            self._console.addFilter(self._noise)
        if self._stand_in is not None:  # (after the libraries' lines are counted and kept in the log file)
            self._stand_in.addFilter(shown_nowhere_else)
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            self._file = logging.FileHandler(log_file)
        except (OSError, ValueError):  # the run's own checks name the unusable directory
            return
        self._file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        self._file.addFilter(OnceEach())
        root.addHandler(self._file)  # a root handler: Python's last resort no longer prints
        self._divert_own_handlers()
        warnings.simplefilter("once")
        logging.captureWarnings(False)  # captureWarnings(True) is a no-op while an earlier capture is on,
        logging.captureWarnings(True)  # though warnings.showwarning may have been reset since (a second run)

    def _divert_own_handlers(self) -> None:
        """Libraries that print through handlers of their own (torch's; comet_ml's, made when it
        is first imported, after the run began): their lines to the log file too."""
        if self._noise is None or self._file is None:
            return
        done = {id(handler) for handler, _ in self._diverted}
        for handler in own_terminal_handlers():
            if id(handler) not in done:
                diverted = LibraryNoise(self._noise.held, divert=self._file)
                handler.addFilter(diverted)
                self._diverted.append((handler, diverted))

    def restore(self, told: Path | None) -> None:
        """Say how many lines went to ``told`` (None: say nothing), and put the handlers back."""
        if self._noise is not None and self._noise.held and told is not None:
            names = ", ".join(name for name, _ in self._noise.held.most_common(5))
            logging.getLogger("coretrain").info(
                "%d line(s) from libraries (%s) are in %s", sum(self._noise.held.values()), names, told
            )
        if self._console is not None and self._noise is not None:
            self._console.removeFilter(self._noise)
        for handler, diverted in self._diverted:
            handler.removeFilter(diverted)
        self._diverted.clear()
        self._noise = None
        if self._stand_in is not None:
            logging.getLogger().removeHandler(self._stand_in)
            self._stand_in = None
        if self._file is not None:
            logging.getLogger().removeHandler(self._file)
            self._file.close()
            self._file = None
