"""The interpreter's long-lived objects kept out of the garbage collector's way, so the collections
between a failure and the rebuilt run cost milliseconds, not a quarter of a second.

Leaving a failed run collects its cycles twice (the core's shutdown: what holds the old process
group, then what that freed), and a full collection walks every object there is: about 300,000
once torch and ``torch._dynamo`` are imported, 0.12–0.15 s each on this machine — most of an
in-process restart. ``gc.freeze()`` (CPython 3.7+) moves the objects that exist now to a
generation collections skip; frozen objects are still freed by reference counting, never by a
collection, so it is done once, before anything of a run exists (a run's cycles must stay
collectable: the old model and optimizer go before the new ones are built).
"""

from __future__ import annotations

import gc

_frozen = False


def freeze_imports() -> None:
    """Once per process, before the first run is built: import ``torch._dynamo`` (torch's
    optimizers import it on their first parameter group in every run: it comes now instead) and
    freeze what the imports made."""
    global _frozen
    if _frozen:
        return
    import torch._dynamo  # noqa: F401

    gc.collect()  # (what start-up left as garbage is freed, not frozen)
    gc.freeze()
    _frozen = True
