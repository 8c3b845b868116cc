"""When things happen: the one place that decides the log, evaluation and save steps.

"Every N steps" is data here (Ignite's ``every=N`` event filters), not ``step % N`` written
again in the loop and in every plugin that must act on the same steps: a plugin asks
``run.cadence.logs(step)`` and stays right when the config's intervals change; an interval of
its own is an :class:`Every` (``Every(self.interval)(step)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attrs import frozen

if TYPE_CHECKING:
    from coretrain.config import Config


@frozen
class Every:
    """Ignite's ``every=N`` as data: due at steps N, 2N, 3N, ...; N = 0 (or None) is never."""

    n: int | None

    def __call__(self, step: int) -> bool:
        return _due(self.n, step)


def _due(every: int | None, step: int) -> bool:
    return every is not None and every > 0 and step % every == 0


@frozen
class Cadence:
    """The run's intervals in steps (0 = never), decided once from the config and whether
    there is a validation split. Each question is one modulo: the loop asks every step."""

    log_every: int = 1
    """``train.log_interval``: the interval's one host sync, then on_log."""
    eval_every: int = 0
    """``train.eval_interval``, when a validation split exists and evaluation has work
    (``eval_iters`` or ``eval_full``)."""
    save_every: int = 0
    """``checkpoint.save_interval``; stops and plugins' requests add other saves."""
    exit_every: int = 0
    """``train.exit_interval``: the job ends after such a step."""

    @classmethod
    def of(cls, config: Config, has_valid: bool) -> Cadence:
        """From the config: an evaluation interval counts only when there is a validation split
        and evaluation has batches to run (a zero interval is never)."""
        train = config.train
        evaluates = has_valid and bool(train.eval_iters or train.eval_full)
        return cls(
            log_every=train.log_interval,
            eval_every=(train.eval_interval or 0) if evaluates else 0,
            save_every=config.checkpoint.save_interval or 0,
            exit_every=train.exit_interval or 0,
        )

    def logs(self, step: int) -> bool:
        return _due(self.log_every, step)

    def evaluates(self, step: int) -> bool:
        return _due(self.eval_every, step)

    def saves(self, step: int) -> bool:
        return _due(self.save_every, step)

    def exits(self, step: int) -> bool:
        return _due(self.exit_every, step)
