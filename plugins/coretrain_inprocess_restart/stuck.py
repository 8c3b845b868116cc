"""A rank its peers' failure cannot reach: blocked where no error arrives (a gloo receive that
the peers' shut-down connections do not end — seen on 4 ranks — or a hook that never returns).
The others wait for it at the next group; this thread ends its process once they have begun the
restart and it is still in the failed run, so the launcher restarts the job at once instead of
the job waiting for the watchdog's timeout."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("coretrain")

STUCK_EXIT_CODE = 1


class StuckGuard:
    """Watches the store for the next restart while this rank trains; ends the process when this
    rank has not followed its peers within ``seconds``."""

    def __init__(self, store: Any, next_restart_key: Callable[[], str], seconds: float) -> None:
        self.store, self.next_restart_key, self.seconds = store, next_restart_key, seconds
        self.step: int | None = None
        """The step this rank is training at; None while it is not in a run (restarting, ended)."""
        threading.Thread(target=self._watch, name="coretrain-inprocess-restart", daemon=True).start()

    def _watch(self) -> None:
        seen: float | None = None
        while True:
            time.sleep(0.5)
            step = self.step
            if step is None:
                seen = None
                continue
            try:
                begun = bool(self.store.check([self.next_restart_key()]))
            except Exception:  # the store is gone: the job is ending anyway
                return
            seen = (seen or time.monotonic()) if begun else None
            if seen is not None and time.monotonic() - seen >= self.seconds and self.step is not None:
                self._end(step)

    def _end(self, step: int) -> None:
        log.error(
            "rank %s: the other ranks began an in-process restart %.0f s ago, but this rank is still at step %d, "
            "blocked where their failure does not reach it; ending this process (exit %d) so the launcher "
            "restarts the job",
            os.environ.get("RANK", "?"),
            self.seconds,
            step,
            STUCK_EXIT_CODE,
        )
        for handler in [*logging.getLogger().handlers, *log.handlers]:
            handler.flush()
        os._exit(STUCK_EXIT_CODE)
