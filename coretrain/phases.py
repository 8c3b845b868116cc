"""Phase marks: where the loop is, for the plugins that watch it (the watchdog) or time it.

The loop calls one function at each phase boundary, ``mark(step, phase)``; plugins supply the
listeners (hook ``phase_listener``). With none, ``mark`` is a function that does nothing, so a
run without instrumentation pays one call per boundary and nothing else.

The phases, in the order a step meets them: ``restore`` (once, first), ``pre_step``, ``data``,
``forward_backward``, ``update``, ``post_step``, ``log``, ``eval``, ``checkpoint``,
``agreement``, ``end`` (once, last).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Listener = Callable[[int, str], None]


def _ignore(step: int, phase: str) -> None:
    """No plugin listens."""


def combined(listeners: Sequence[Listener]) -> Listener:
    """One function that tells every listener: a no-op for none, the listener itself for one."""
    if not listeners:
        return _ignore
    if len(listeners) == 1:
        return listeners[0]
    chosen = tuple(listeners)

    def each(step: int, phase: str) -> None:
        for listener in chosen:
            listener(step, phase)

    return each
