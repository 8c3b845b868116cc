"""One run's lifecycle, written once: plugins → build (the output dir locked) → resume → train →
close (``close_run`` on every plugin, however far the run got). ``coretrain run``,
``coretrain.train()`` and ``coretrain.testing`` all go through it and differ only in what they do
around it (the CLI's error lines, the API's result, a test's hook recorder)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from coretrain import dist
from coretrain.build import build_run, close_run
from coretrain.config import world_size_from_env
from coretrain.loop import Trainer
from coretrain.pluginmanager import Plugins, load_plugins

if TYPE_CHECKING:
    from coretrain.config import Config
    from coretrain.configload import LoadedConfig
    from coretrain.run import Run
    from coretrain.signals import SignalWatcher


def session_plugins(
    loaded: LoadedConfig, extra: Mapping[str, object] | None = None, autoload: bool | Collection[str] | None = None
) -> Plugins:
    """The config's plugins and ``extra`` instances (a caller's own, by name), every hook name
    checked, and the layout and batch sizes checked against the ranks this job has."""
    plugins = load_plugins(loaded.config, loaded.locations, autoload=autoload)
    for name, instance in (extra or {}).items():
        plugins.register(name, instance)
    plugins.check_pending()
    check_world(loaded.config, plugins, world_size_from_env())
    return plugins


def check_world(config: Config, plugins: Plugins, world_size: int) -> None:
    """The layout and the batch sizes fit ``world_size`` ranks: the core's keys, then each
    plugin's (``check_layout``) — what a launcher asks once for a job."""
    config.check_world(world_size)
    if plugins.implemented("check_layout"):
        plugins.calls.hook.check_layout(config=config, world_size=world_size, hooks=plugins.calls.hook)


def run_session(
    loaded: LoadedConfig,
    plugins: Plugins,
    signals: SignalWatcher | None = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> tuple[int, Run]:
    """Build, resume, train and close; the exit code and the run. ``on_error`` sees a failure
    while the frames that hold the run still exist (the CLI writes its traceback); then the run
    is let go and the process group left before the failure propagates."""
    while True:
        run = None
        try:
            run = build_run(loaded.config, plugins, signals=signals)  # closes itself when it fails
            try:
                code = Trainer(run, signals).train()
            except BaseException:
                close_run(run, failing=True)
                raise
            close_run(run, failing=False)
            break
        except BaseException as exc:
            if on_error is not None:
                on_error(exc)
            drop_frames(exc)
            dist.shutdown()
            restart = isinstance(exc, Exception) and plugins.implemented("restart_in_process")
            if not (restart and plugins.calls.hook.restart_in_process(run=run, error=exc)):
                raise
    dist.shutdown(graceful=True)
    return code, run


def drop_frames(exc: BaseException | None) -> None:
    """Forget the frames an exception chain holds: they hold the run, which shutdown must free."""
    while exc is not None:
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
