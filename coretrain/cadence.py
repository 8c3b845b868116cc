"""When things happen: the one place that decides the log, evaluation and save steps.

"Every N steps" is data here (Ignite's ``every=N`` event filters), not ``step % N`` written
again in the loop and in every plugin that must act on the same steps: a plugin asks
``run.cadence.logs(step)`` and stays right when the config's intervals change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attrs import frozen

if TYPE_CHECKING:
    from coretrain.config import Config


@frozen
class Every:
    """Every ``n`` steps; never when ``n`` is 0."""

    n: int = 0

    def __call__(self, step: int) -> bool:
        return self.n > 0 and step % self.n == 0


@frozen
class Cadence:
    """The run's intervals, decided once from the config (and whether there is a validation split)."""

    log: Every = Every(1)
    """Steps that log (``train.log_interval``): the interval's one host sync, then on_log."""
    eval: Every = Every()
    """Steps that evaluate the validation split (``train.eval_interval``, when one exists and
    evaluation has work: ``eval_iters`` or ``eval_full``)."""
    save: Every = Every()
    """Steps that save a checkpoint (``checkpoint.save_interval``); stops and requests add others."""
    exit: Every = Every()
    """Steps that end the job (``train.exit_interval``)."""

    @classmethod
    def of(cls, config: Config, has_valid: bool) -> Cadence:
        train = config.train
        evaluates = has_valid and bool(train.eval_iters or train.eval_full)
        return cls(
            log=Every(train.log_interval),
            eval=Every((train.eval_interval or 0) if evaluates else 0),
            save=Every(config.checkpoint.save_interval or 0),
            exit=Every(train.exit_interval or 0),
        )

    def logs(self, step: int) -> bool:
        return self.log(step)

    def evaluates(self, step: int) -> bool:
        return self.eval(step)

    def saves(self, step: int) -> bool:
        return self.save(step)
