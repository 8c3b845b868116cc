"""Where a run's log lines go: coretrain's on the console, everything in ``OUTPUT_DIR/run.log``.

Libraries a run uses (torchao, torch's ``_pytree``, transformers, mlflow, torchdata) warn and
log on their own; on the console that buries the run's own lines. Records from installed
libraries below ERROR — their loggers and the Python warnings they raise — go to the log file
only, and the console says once at the end how many there were and where. Lines from
coretrain and its plugins (the ``coretrain`` logger) and warnings raised by the user's own
code (outside site-packages and the standard library) stay on the console. Python warnings
reach each handler once per distinct text.
"""

from __future__ import annotations

import logging
import os
import re
import site
import sys
import sysconfig
from collections import Counter
from pathlib import Path

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
    """Keeps libraries' records below ERROR off the console, counting them by library."""

    def __init__(self) -> None:
        super().__init__()
        self.held: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.name.startswith("coretrain"):
            return True
        source = source_file(record)
        path = os.path.realpath(source) if source else ""
        library = next((d for d in LIBRARY_DIRS if path.startswith(d + os.sep)), None)
        if library is None:
            return True
        relative = Path(path).relative_to(library).parts
        self.held[relative[0].split(".")[0] if relative else "?"] += 1
        return False


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


def setup_logging(level_name: str, output_dir: str | None) -> LibraryNoise:
    """The console: rank 0 at ``level_name``, other ranks warnings and errors only, libraries'
    lines held back; the log file (``run.log``, ``run.rankN.log``): all of it at ``level_name``."""
    import warnings

    rank = int(os.environ.get("RANK", "0"))
    level = getattr(logging, level_name.upper())
    noise = LibraryNoise()
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level if rank == 0 else max(level, logging.WARNING))
    console.setFormatter(
        logging.Formatter("coretrain: %(message)s" if rank == 0 else f"coretrain[rank {rank}]: %(message)s")
    )
    console.addFilter(OnceEach())
    console.addFilter(noise)
    handlers: list[logging.Handler] = [console]
    if output_dir is not None:
        try:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            to_file = logging.FileHandler(Path(output_dir) / ("run.log" if rank == 0 else f"run.rank{rank}.log"))
        except (OSError, ValueError):  # the run's own checks name the unusable directory
            to_file = None
        if to_file is not None:
            to_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
            to_file.addFilter(OnceEach())
            handlers.append(to_file)
    logging.basicConfig(level=level, force=True, handlers=handlers)
    warnings.simplefilter("once")
    logging.captureWarnings(False)  # captureWarnings(True) is a no-op while an earlier capture is on,
    logging.captureWarnings(True)  # though warnings.showwarning may have been reset since (a second run)
    return noise


def say_held(noise: LibraryNoise, output_dir: str) -> None:
    """One console line for the libraries' lines kept in the log file, if any."""
    if noise.held and int(os.environ.get("RANK", "0")) == 0:
        names = ", ".join(name for name, _ in noise.held.most_common(5))
        logging.getLogger("coretrain").info(
            "%d line(s) from libraries (%s) are in %s", sum(noise.held.values()), names, Path(output_dir) / "run.log"
        )
