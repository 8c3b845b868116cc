"""The hook ``coretrain run --nproc-per-node`` asks before it starts torchrun (the ``launch``
command module's ``coretrain.hookspecs`` entry point): a plugin that starts the job its own way."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Protocol

from coretrain import hookspec


class LaunchSpecs(Protocol):
    """Hooks for plugins that start a job's processes themselves."""

    @hookspec(firstresult=True)
    def launch_job(self, args: argparse.Namespace, loaded: Any, check: Callable[[list[int]], None]) -> int | None:
        """Start the job yourself instead of one torchrun job over every rank (a spec of
        coretrain-plugins since 1.1: ``torchft`` starts a lighthouse and one torchrun job per replica group).

        Args: ``args`` — ``coretrain run``'s parsed flags (``config``, ``overrides``,
        ``nproc_per_node``, ``nnodes``, ``max_restarts``, ...); ``loaded`` — the config as
        ``coretrain.load`` returned it (checked); ``check(sizes)`` — raises the job's one error
        unless the layout and batch sizes fit each number of ranks in ``sizes``.
        May change: nothing of the config; start processes, wait for them.
        Returns: None to let torchrun start the job, else the job's exit code.
        Ranks: none — the launcher, once, before any rank starts.
        """
