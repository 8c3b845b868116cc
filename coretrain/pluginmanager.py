"""Find plugins through entry points, import only the enabled ones, configure and register them.

A plugin is an entry point in the ``coretrain`` group whose name is the plugin's name and
whose object is an attrs class: its fields are the keys of the ``[plugins.NAME]`` table (or
of ``[model.options]`` / ``[data.options]`` for the provider the config names). A
distribution that wants a plugin on without any table also lists it, with the same object,
in the ``coretrain.autoload`` group, so deciding what to load never imports anything.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Collection, Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Any, cast

import attrs
import pluggy

from coretrain import hookspecs
from coretrain.config import Config, world_size_from_env
from coretrain.configload import CONVERTER, Location, structure, withhold_secrets
from coretrain.errors import PluginError, RunFailure, UserError, did_you_mean
from coretrain.hookcalls import HookCalls
from coretrain.markers import PROJECT
from coretrain.version import __version__

if TYPE_CHECKING:
    from coretrain.run import Run

GROUP = "coretrain"
AUTOLOAD_GROUP = "coretrain.autoload"
HOOKSPECS_GROUP = "coretrain.hookspecs"
"""Hook specifications a plugin distribution adds for other plugins: ``NAME = "module:Class"``."""
AUTOLOAD_OFF_ENV = "CORETRAIN_DISABLE_PLUGIN_AUTOLOAD"
PARALLELISM = {
    "tp_size": "tensor-parallel",
    "cp_size": "context-parallel",
    "ep_size": "expert-parallel",
    "pp_size": "pipeline-parallel",
}
"""The plugin ``distributed.KEY > 1`` turns on, as ``distributed.strategy`` turns on its own."""
INSTALL_HINT = "install one, e.g. `pip install -e ./plugins` for the first-party plugins"


@attrs.define(frozen=True)
class PluginEntry:
    """What entry-point metadata says about a plugin, read without importing it."""

    name: str
    value: str
    distribution: str
    version: str
    autoload: bool

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version}"

    def load(self) -> type:
        """Import the plugin's class; any failure is a UserError naming plugin, distribution, cause."""
        obj = imported(metadata.EntryPoint(self.name, self.value, GROUP), f"plugin '{self.name}'", self.origin)
        if not (inspect.isclass(obj) and attrs.has(obj)):
            raise UserError(
                f"plugin '{self.name}' (from {self.origin}): {self.value} is not an attrs class; "
                "a plugin is an @attrs.define class whose fields are its config"
            )
        return obj


def discover() -> dict[str, PluginEntry]:
    """Every installed plugin, by name, from entry-point metadata alone: read once while no
    directory on sys.path changes (installing or removing a distribution changes its directory's
    modification time), as a scan of every distribution costs milliseconds and a run asks often."""
    return dict(_discover(_path_state()))


def _path_state() -> tuple[tuple[str, int], ...]:
    """Each entry of sys.path with its directory's modification time (0: not a directory)."""
    return tuple((path, os.stat(path or ".").st_mtime_ns if os.path.isdir(path or ".") else 0) for path in sys.path)


@functools.lru_cache(maxsize=1)
def _discover(path_state: tuple[tuple[str, int], ...]) -> dict[str, PluginEntry]:
    """The scan :func:`discover` caches (``path_state`` is its key). Two distributions claiming
    one name are an error: which of them ran would depend on the order they were installed in."""
    autoload = {ep.name for ep in metadata.entry_points(group=AUTOLOAD_GROUP)}
    found: dict[str, PluginEntry] = {}
    for ep in metadata.entry_points(group=GROUP):
        dist = ep.dist
        entry = PluginEntry(
            ep.name, ep.value, dist.name if dist else "?", dist.version if dist else "?", ep.name in autoload
        )
        if ep.name in found and found[ep.name].value != entry.value:
            raise UserError(
                f"two installed distributions register plugin '{ep.name}': "
                f"{found[ep.name].origin} and {entry.origin}; uninstall one"
            )
        found[ep.name] = entry
    return found


def is_import_path(provider: str) -> bool:
    return ":" in provider


_Chosen = dict[str, tuple[tuple[str, ...], dict[str, Any]]]


def enabled_tables(
    config: Config, installed: Mapping[str, PluginEntry], autoload: bool | Collection[str] | None = None
) -> _Chosen:
    """Decide which plugins a config turns on: name -> (config key path, table).

    Providers named by ``model.provider`` / ``data.provider`` take ``[model.options]`` /
    ``[data.options]``; ``[plugins.NAME]`` tables turn theirs on; autoload plugins are on
    unless ``enabled = false`` or autoload is disabled by the environment (or ``autoload`` names
    the only ones to keep on).
    """
    chosen = _providers(config, installed)
    strategy = config.distributed.resolved_strategy(world_size_from_env())
    parallelism = {strategy: "distributed.strategy"} if strategy is not None else {}
    for key, name in PARALLELISM.items():
        if getattr(config.distributed, key) > 1:
            parallelism[name] = f"distributed.{key}"
    for name, key in parallelism.items():
        _require_installed(name, key, installed)
        chosen[name] = (("plugins", name), {})
    _apply_plugin_tables(config, installed, chosen, set(parallelism))
    if autoload is None:
        autoload = os.environ.get(AUTOLOAD_OFF_ENV, "") not in ("1", "true", "yes")
    if autoload:
        for name, entry in installed.items():
            wanted = autoload is True or name in autoload
            if entry.autoload and wanted and name not in config.plugins and name not in chosen:
                chosen[name] = (("plugins", name), {})
    return chosen


def _providers(config: Config, installed: Mapping[str, PluginEntry]) -> _Chosen:
    """The model and data providers named by entry-point name, with their ``options`` tables."""
    chosen: _Chosen = {}
    for section in ("model", "data"):
        provider = getattr(config, section).provider
        if not provider or is_import_path(provider):
            continue  # a missing provider is reported when the run is built
        _require_installed(provider, f"{section}.provider", installed)
        if provider in config.plugins:
            raise UserError(
                f"plugins.{provider}: '{provider}' is the {section} provider; "
                f"put its settings in [{section}.options] instead"
            )
        chosen[provider] = ((section, "options"), dict(getattr(config, section).options))
    return chosen


def _apply_plugin_tables(
    config: Config, installed: Mapping[str, PluginEntry], chosen: _Chosen, parallelism: set[str]
) -> None:
    """``[plugins.NAME]`` turns NAME on (and configures a parallelism plugin); ``enabled = false`` off."""
    for name, table in config.plugins.items():
        if not isinstance(table, dict):
            raise UserError(f"plugins.{name}: expected a table, e.g. [plugins.{name}]")
        _require_installed(name, f"plugins.{name}", installed)
        table = dict(table)
        enabled = table.pop("enabled", True)
        if not isinstance(enabled, bool):
            raise UserError(f"plugins.{name}.enabled: expected true or false, got {enabled!r}")
        if enabled and (name not in chosen or name in parallelism):
            chosen[name] = (("plugins", name), table)
        elif not enabled:
            chosen.pop(name, None)


def _require_installed(name: str, key: str, installed: Mapping[str, PluginEntry]) -> None:
    """The plugin ``key`` turns on is installed, or an error naming the key and what is."""
    if name not in installed:
        known = ", ".join(sorted(installed)) or f"none ({INSTALL_HINT})"
        raise UserError(
            f"{key}: no plugin named '{name}' is installed{did_you_mean(name, installed)}; installed: {known}"
        )


VETO_FLAG = "coretrain_vetoes_updates"
"""The class attribute by which a plugin says its ``before_update`` may veto an update."""


class Plugins:
    """The pluggy manager with the enabled plugins registered, plus their names and entries."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(hookspecs.HookSpecs)
        for specs in _plugin_hookspecs(_path_state()):
            self.manager.add_hookspecs(specs)
        self.entries: dict[str, PluginEntry] = {}
        self.calls = HookCalls(self.manager)
        """Typed calls of every hook (the only way the core calls plugins)."""
        self.running: list[tuple[str, str]] = []
        """(plugin, hook) of the hook implementations running now, innermost last: what a hang
        report names."""

    def register(self, name: str, plugin: object, entry: PluginEntry | None = None) -> None:
        """Register ``plugin`` as ``name`` after checking the hook API it was written for; pluggy's
        refusal (an argument no spec has) becomes one error naming the plugin; each hook
        implementation but a wrapper is wrapped to name the plugin when it raises."""
        check_hook_api(name, plugin, entry)
        try:
            self.manager.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            origin = f" (from {entry.origin})" if entry else ""
            detail = "; ".join(line.strip() for line in str(exc).splitlines()[1:]) or str(exc)
            raise UserError(f"plugin '{name}'{origin}: {detail}") from None
        if entry:
            self.entries[name] = entry
        for caller in self.manager.get_hookcallers(plugin) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and not (impl.wrapper or impl.hookwrapper):
                    # Final in pluggy's types; replacing it is how the failure gets the plugin's name
                    impl.function = _naming_failures(  # type: ignore[misc]
                        impl.function, name, caller.name, impl.argnames, self.running
                    )

    def get(self, name: str) -> object | None:
        return self.manager.get_plugin(name)

    def names(self) -> list[str]:
        return [name for name, _ in self.manager.list_name_plugin()]

    def implemented(self, hook_name: str) -> bool:
        return self.calls.implemented(hook_name)

    def implementers(self, hook_name: str) -> list[str]:
        """Names of the plugins that implement ``hook_name``."""
        return [impl.plugin_name for impl in getattr(self.manager.hook, hook_name).get_hookimpls()]

    def vetoing(self) -> list[str]:
        """Plugins that declare ``coretrain_vetoes_updates = True``: only for them do the ranks
        agree on an update veto each step (a ``before_update`` that only watches costs nothing)."""
        return [name for name, plugin in self.manager.list_name_plugin() if getattr(plugin, VETO_FLAG, False)]

    def check_pending(self) -> None:
        """A method named like a hook that matches no spec is a typo: make it an error."""
        try:
            self.manager.check_pending()
        except pluggy.PluginValidationError as exc:
            plugin_name = self.manager.get_name(exc.plugin) or "?"
            known = [caller.name for caller in self.manager.hook.__dict__.values() if caller.has_spec()]
            unknown = [name for name in hooks_of(exc.plugin) if name not in known]
            hints = "; ".join(f"'{n}'{did_you_mean(n, known)}" for n in unknown) or str(exc)
            raise UserError(f"plugin '{plugin_name}' implements hooks that do not exist: {hints}") from None


@functools.lru_cache(maxsize=1)
def _plugin_hookspecs(path_state: tuple[tuple[str, int], ...]) -> tuple[type, ...]:
    """The hook specifications installed distributions add (read once per state of sys.path)."""
    return tuple(_load_specs(point) for point in metadata.entry_points(group=HOOKSPECS_GROUP))


def imported(point: metadata.EntryPoint, what: str, origin: str) -> Any:
    """The entry point's object; a failure to import it is one error naming ``what`` and where it is from."""
    try:
        return point.load()
    except Exception as exc:  # a broken distribution must stop the run with its cause
        raise UserError(f"{what} (from {origin}) failed to import {point.value}: {type(exc).__name__}: {exc}") from None


def _load_specs(point: metadata.EntryPoint) -> type:
    """A distribution's hook specifications; a failure to import them names the distribution."""
    origin = f"{point.dist.name} {point.dist.version}" if point.dist else "?"
    specs = imported(point, f"hook specifications '{point.name}'", origin)
    if not inspect.isclass(specs):
        raise UserError(f"hook specifications '{point.name}' (from {origin}): {point.value} is not a class")
    return specs


def check_hook_api(name: str, plugin: object, entry: PluginEntry | None = None) -> None:
    """A plugin that says which hook API it was written for (``coretrain_hook_api = (1, 0)``)
    runs on the same major with at least that minor; anything else is one error naming it."""
    wanted = getattr(plugin, "coretrain_hook_api", None)
    if wanted is None:
        return
    have = hookspecs.HOOK_API
    origin = f" (from {entry.origin})" if entry else ""
    if not (isinstance(wanted, tuple) and len(wanted) == 2 and all(isinstance(part, int) for part in wanted)):
        raise UserError(
            f"plugin '{name}'{origin}: coretrain_hook_api must be (major, minor), e.g. {have}; got {wanted!r}"
        )
    if wanted[0] != have[0] or wanted[1] > have[1]:
        need = "a newer coretrain" if wanted > have else "a version of the plugin written for this coretrain"
        raise UserError(
            f"plugin '{name}'{origin} was written for hook API {wanted[0]}.{wanted[1]}, and this coretrain "
            f"{__version__} provides {have[0]}.{have[1]}; install {need}, or disable the plugin"
        )


def _naming_failures(
    function: Callable[..., Any], plugin: str, hook: str, argnames: tuple[str, ...], running: list[tuple[str, str]]
) -> Callable[..., Any]:
    """Wrap a hook implementation so an exception from it says which plugin, hook and step, and
    a hang in it which plugin (``running``: what is executing now)."""
    step_at = argnames.index("step") if "step" in argnames else None
    me = (plugin, hook)

    @functools.wraps(function)
    def guarded(*args: Any) -> Any:
        """The implementation, with its failure (or sys.exit) raised as a PluginError."""
        running.append(me)
        try:
            return function(*args)
        except (UserError, PluginError, RunFailure):
            raise  # already says what to fix / who failed
        except (Exception, SystemExit) as exc:  # a hook must not end the process behind the loop's back either
            step = args[step_at] if step_at is not None and step_at < len(args) else None
            if isinstance(exc, SystemExit):
                raise PluginError(plugin, hook, RuntimeError(f"called sys.exit({exc.code!r})"), step) from None
            raise PluginError(plugin, hook, exc, step) from exc
        finally:
            running.pop()

    return guarded


def load_plugins(
    config: Config,
    locations: Mapping[tuple[str, ...], Location] | None = None,
    installed: Mapping[str, PluginEntry] | None = None,
    autoload: bool | Collection[str] | None = None,
) -> Plugins:
    """Import, configure and register every plugin the config enables; check hook names.
    ``autoload``: whether on-by-default plugins load (None: unless the environment says not;
    names: only those of them)."""
    installed = discover() if installed is None else installed
    plugins = Plugins()
    for name, (key_path, table) in enabled_tables(config, installed, autoload).items():
        entry = installed[name]
        cls = entry.load()
        instance: object = structure(table, cls, prefix=key_path, locations=locations)
        withhold_secrets(config, key_path, cls)
        plugins.register(name, instance, entry)
    plugins.check_pending()
    return plugins


# --------------------------------------------------------------------------- describing plugins


def hooks_of(plugin: object) -> list[str]:
    """Names of the hooks a plugin (class or instance) implements (with the coretrain hookimpl marker)."""
    return sorted(n for n, m in inspect.getmembers(plugin) if getattr(m, f"{PROJECT}_impl", None) is not None)


def field_defaults(cls: type) -> dict[str, Any]:
    """Each option's default, as plain data (a required option has none)."""
    values = {}
    for f in attrs.fields(cls):
        if f.default is attrs.NOTHING or not f.init:
            continue
        factory = f.default if isinstance(f.default, attrs.Factory) else None  # type: ignore[arg-type]
        default = factory.factory() if factory is not None and not factory.takes_self else f.default
        values[f.name] = CONVERTER.unstructure(default)
    return values


def hook_calls(run: Run) -> HookCalls:
    """``run.plugins.calls``, typed: how the core calls a run's hooks."""
    return cast(HookCalls, run.plugins.calls)
