"""How the core calls plugins, with the types the specs promise.

pluggy's ``manager.hook.NAME(**kwargs)`` returns ``Any``; the core calls ``calls.hook.NAME``
instead, the same caller typed as :class:`coretrain.hookspecs.HookSpecs`, so mypy checks each
call against the one written contract. Hooks that collect a result per plugin are combined
here. Hooks whose results belong to one plugin (``on_checkpoint``, ``on_resume``) and the hooks that
must reach every plugin even past a failure (``on_train_end``, ``close_run``) are called plugin by plugin,
each call through pluggy so that ``wrapper=True`` implementations wrap it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import pluggy

from coretrain.errors import PluginError
from coretrain.hookspecs import HookSpecs, Outcome

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from coretrain.run import Run

PluginState = dict[str, Any]


class HookCalls:
    """The hooks, typed: ``hook.NAME(...)`` for the hooks pluggy calls as they are, and one
    method each for those whose results the core combines or whose calls go plugin by plugin."""

    def __init__(self, manager: pluggy.PluginManager) -> None:
        self._manager = manager
        self.hook = cast("HookSpecs", manager.hook)
        """``manager.hook`` as the spec class: mypy checks each call's arguments and result."""

    def __getattr__(self, name: str) -> Any:
        """``calls.NAME`` for any other hook, as pluggy's caller (what plugins have used)."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._manager.hook, name)

    def implemented(self, name: str) -> bool:
        """Whether any plugin implements ``name`` (a wrapper counts: it expects to be called)."""
        return bool(getattr(self._manager.hook, name).get_hookimpls())

    # ---------------------------------------------------------------- collected

    def param_group_overrides(self, run: Run, model: torch.nn.Module) -> dict[str, dict[str, float]]:
        """The plugins' overrides merged: later plugins (in pluggy's call order) win per key."""
        merged: dict[str, dict[str, float]] = {}
        if not self.implemented("param_group_overrides"):
            return merged
        for result in reversed(self._manager.hook.param_group_overrides(run=run, model=model)):
            for name, values in result.items():
                merged.setdefault(name, {}).update(values)
        return merged

    def protected_checkpoints(self, run: Run, root: Path) -> set[int]:
        """Every plugin's steps that retention keeps under ``root``."""
        if not self.implemented("protected_checkpoints"):
            return set()
        return {step for steps in self._manager.hook.protected_checkpoints(run=run, root=root) for step in steps}

    def phase_listeners(self, run: Run) -> list[Callable[[int, str], None]]:
        """Each plugin's listener; one that is not callable is that plugin's error."""
        listeners = []
        for name, call in self._one_by_one("phase_listener"):
            listener = _single(call(run=run))
            if listener is not None and not callable(listener):
                cause = TypeError(f"returned {type(listener).__name__}, expected a function (step, phase) or None")
                raise PluginError(name, "phase_listener", cause)
            if listener is not None:
                listeners.append(listener)
        return listeners

    # ---------------------------------------------------------------- plugin by plugin

    def on_checkpoint(self, run: Run, step: int, path: str) -> dict[str, PluginState | None]:
        """Each plugin's state, keyed by the plugin that returned it."""
        return {
            name: cast("PluginState | None", _single(call(run=run, step=step, path=path)))
            for name, call in self._one_by_one("on_checkpoint")
        }

    def on_resume(self, run: Run, step: int, states: Mapping[str, PluginState]) -> None:
        """Hand each plugin the state it saved (an empty dict when it saved none)."""
        for name, call in self._one_by_one("on_resume"):
            call(run=run, step=step, state=states.get(name, {}))

    def on_train_end(self, run: Run, outcome: Outcome) -> list[BaseException]:
        """Call every plugin even if some raise; return what they raised, in call order."""
        return self._each_even_past_errors("on_train_end", run=run, outcome=outcome)

    def close_run(self, run: Run) -> list[BaseException]:
        """Call every plugin even if some raise; return what they raised, in call order."""
        return self._each_even_past_errors("close_run", run=run)

    def _each_even_past_errors(self, name: str, **kwargs: object) -> list[BaseException]:
        """Call hook ``name`` plugin by plugin (pluggy would stop at the first that raises)."""
        errors: list[BaseException] = []
        for _, call in self._one_by_one(name):
            try:
                call(**kwargs)
            except Exception as exc:  # one plugin's failure must not leave another's files open
                errors.append(exc)
        return errors

    def _one_by_one(self, name: str) -> Iterator[tuple[str, Callable[..., list[Any]]]]:
        """(plugin name, a caller of only that plugin's implementation inside every wrapper), in
        pluggy's call order.

        pluggy's public ``subset_hook_caller`` puts plugins in a set, and attrs plugins are not
        hashable; so this hands pluggy's own executor (tracing and wrappers included) the list of
        implementations to run, as ``HookCaller.__call__`` does.
        """
        impls = getattr(self._manager.hook, name).get_hookimpls()
        wrappers = [impl for impl in impls if impl.wrapper or impl.hookwrapper]
        plain = [impl for impl in impls if not (impl.wrapper or impl.hookwrapper)]
        execute = self._manager._hookexec  # private, in every pluggy 1.x (pyproject: pluggy>=1.5,<2)
        for impl in reversed(plain):
            subset = [impl, *wrappers]  # pluggy runs the list from the end: wrappers outermost

            def call(_subset: list[Any] = subset, **kwargs: object) -> list[Any]:
                return cast("list[Any]", execute(name, _subset, kwargs, False))

            yield impl.plugin_name, call


def _single(results: list[Any]) -> Any:
    """pluggy leaves None results out of the list: one implementation gives [] or [value]."""
    return results[0] if results else None
