"""Typed calls of every hook: how the core calls plugins, with the types the specs promise.

pluggy's ``manager.hook.NAME(**kwargs)`` returns ``Any``; every call the core makes goes
through one method here instead, so a type checker sees what each hook takes and returns.
Hooks whose results belong to one plugin (``on_checkpoint``, ``on_resume``) and the hook that
must reach every plugin even past a failure (``on_train_end``) are called plugin by plugin,
each call through pluggy so that ``wrapper=True`` implementations wrap it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import pluggy

from coretrain.errors import PluginError
from coretrain.hookspecs import Outcome

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from coretrain.run import DatasetContext, Datasets, Run, StepOutputs

PluginState = dict[str, Any]


class HookCalls:
    """One typed method per hook spec."""

    def __init__(self, manager: pluggy.PluginManager) -> None:
        self._manager = manager
        self._hook = manager.hook

    def implemented(self, name: str) -> bool:
        """Whether any plugin implements ``name`` (a wrapper counts: it expects to be called)."""
        return bool(getattr(self._hook, name).get_hookimpls())

    # ---------------------------------------------------------------- building

    def provide_datasets(self, run: Run, context: DatasetContext) -> Datasets | None:
        return cast("Datasets | None", self._hook.provide_datasets(run=run, context=context))

    def provide_model(self, run: Run) -> torch.nn.Module | None:
        return cast("torch.nn.Module | None", self._hook.provide_model(run=run))

    def configure_model(self, run: Run) -> None:
        self._hook.configure_model(run=run)

    def tensor_parallel_plan(self, run: Run, model: torch.nn.Module) -> dict[str, Any] | None:
        return cast("dict[str, Any] | None", self._hook.tensor_parallel_plan(run=run, model=model))

    def param_group_overrides(self, run: Run, model: torch.nn.Module) -> dict[str, dict[str, float]]:
        """The plugins' overrides merged: later plugins (in pluggy's call order) win per key."""
        merged: dict[str, dict[str, float]] = {}
        results = cast("list[dict[str, dict[str, float]]]", self._hook.param_group_overrides(run=run, model=model))
        for result in reversed(results):
            for name, values in result.items():
                merged.setdefault(name, {}).update(values)
        return merged

    # ---------------------------------------------------------------- the loop

    def num_micro_batches(self, run: Run, step: int, consumed_samples: int) -> int | None:
        return cast("int | None", self._hook.num_micro_batches(run=run, step=step, consumed_samples=consumed_samples))

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

    def on_train_start(self, run: Run) -> None:
        self._hook.on_train_start(run=run)

    def pre_step(self, run: Run, step: int) -> None:
        self._hook.pre_step(run=run, step=step)

    def before_update(self, run: Run, step: int, loss: torch.Tensor) -> None:
        self._hook.before_update(run=run, step=step, loss=loss)

    def post_step(self, run: Run, step: int, outputs: StepOutputs) -> None:
        self._hook.post_step(run=run, step=step, outputs=outputs)

    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        self._hook.on_log(run=run, step=step, metrics=metrics)

    def on_eval(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        self._hook.on_eval(run=run, step=step, metrics=metrics)

    def on_checkpoint_saved(self, run: Run, step: int, path: str) -> None:
        self._hook.on_checkpoint_saved(run=run, step=step, path=path)

    def on_signal(self, run: Run, signum: int) -> None:
        self._hook.on_signal(run=run, signum=signum)

    def export_model(
        self,
        state: dict[str, torch.Tensor],
        config: dict[str, Any],
        run_dir: Path,
        export_format: str,
        to: Path,
        options: dict[str, Any],
    ) -> str | None:
        answer = self._hook.export_model(
            state=state, config=config, run_dir=run_dir, export_format=export_format, to=to, options=options
        )
        return cast("str | None", answer)

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
        errors: list[BaseException] = []
        for _, call in self._one_by_one("on_train_end"):
            try:
                call(run=run, outcome=outcome)
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
        impls = getattr(self._hook, name).get_hookimpls()
        wrappers = [impl for impl in impls if impl.wrapper or impl.hookwrapper]
        plain = [impl for impl in impls if not (impl.wrapper or impl.hookwrapper)]
        execute = private_executor(self._manager)
        for impl in reversed(plain):
            subset = [impl, *wrappers]  # pluggy runs the list from the end: wrappers outermost

            def call(_subset: list[Any] = subset, _impl: Any = impl, **kwargs: object) -> list[Any]:
                if execute is None:  # a pluggy without it: the implementation alone, unwrapped
                    result = _impl.function(*(kwargs[arg] for arg in _impl.argnames))  # positional, as pluggy calls
                    return [] if result is None else [result]
                return cast("list[Any]", execute(name, _subset, kwargs, False))

            yield impl.plugin_name, call


def private_executor(manager: pluggy.PluginManager) -> Callable[..., Any] | None:
    """pluggy's ``PluginManager._hookexec`` (private in pluggy 1.x), or None where a release has
    none: the per-plugin calls then run each implementation alone, outside any wrapper."""
    execute: Callable[..., Any] | None = getattr(manager, "_hookexec", None)
    return execute


def _single(results: list[Any]) -> Any:
    """pluggy leaves None results out of the list: one implementation gives [] or [value]."""
    return results[0] if results else None
