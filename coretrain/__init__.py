"""coretrain: a small PyTorch training loop whose every feature is a plugin.

The public API — everything a plugin needs, first-party or third-party — is what ``__all__``
lists, importable from ``coretrain`` itself. Importing this package imports no torch: the
names below load their modules on first use.
"""

from __future__ import annotations

import functools
import importlib

from coretrain.version import __version__

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `coretrain` is the first
# import of the console script, before its Ctrl-C handler exists, so it imports next to nothing

_DEFINED_IN = {
    "coretrain.api": ("train", "TrainResult", "load", "prepare", "load_plugins"),
    "coretrain.markers": ("hookimpl", "hookspec"),
    "coretrain.hookspecs": ("HOOK_API", "Outcome"),
    "coretrain.run": ("Run", "TrainState", "StepOutputs", "Datasets", "DatasetContext", "Scheduler"),
    "coretrain.control": ("Control",),
    "coretrain.cadence": ("Every",),
    "coretrain.dist": ("DistInfo", "max_over_ranks", "mean_over_ranks", "sum_over_ranks"),
    "coretrain.data": ("fetch", "to_device", "SampleOrder"),
    "coretrain.loader": ("is_stream", "SplitBatches", "loader_settings"),
    "coretrain.outputs": ("forward", "model_outputs", "inputs_and_target", "NUM_TOKENS"),
    "coretrain.gradnorm": ("gradient_norm", "clip_to"),
    "coretrain.errors": ("UserError", "require", "did_you_mean"),
    "coretrain.configload": ("config_as_dict",),
    "coretrain.configchanges": ("config_changes",),
    "coretrain.checkpoint.state": ("is_sharded", "rng_state", "set_rng_state"),
    "coretrain.checkpoint.layout": ("find_checkpoint", "step_dir", "step_dirs", "linked_step", "read_manifest"),
    "coretrain.checkpoint.load": ("read_weights", "SHARED_PARAMETERS"),
    "coretrain.validators": ("FieldValueError", "positive", "non_negative", "fraction", "in_range", "exit_code"),
    "coretrain.commands.common": ("add_config_args",),
    "coretrain.pluginmanager": ("field_defaults", "discover", "hooks_of"),
}
"""Each module of the public API and the names it defines."""
_LAZY = {name: module for module, names in _DEFINED_IN.items() for name in names}
"""Public name -> the module ``__getattr__`` imports it from, on first use."""

if TYPE_CHECKING:  # what a type checker sees; at run time __getattr__ imports on first use
    from typing import Any

    from coretrain.api import TrainResult, load, load_plugins, prepare, train
    from coretrain.cadence import Every
    from coretrain.checkpoint.layout import find_checkpoint, linked_step, read_manifest, step_dir, step_dirs
    from coretrain.checkpoint.load import SHARED_PARAMETERS, read_weights
    from coretrain.checkpoint.state import is_sharded, rng_state, set_rng_state
    from coretrain.commands.common import add_config_args
    from coretrain.configchanges import config_changes
    from coretrain.configload import config_as_dict
    from coretrain.control import Control
    from coretrain.data import SampleOrder, fetch, to_device
    from coretrain.dist import DistInfo, max_over_ranks, mean_over_ranks, sum_over_ranks
    from coretrain.errors import UserError, did_you_mean, require
    from coretrain.gradnorm import clip_to, gradient_norm
    from coretrain.hookspecs import HOOK_API, Outcome
    from coretrain.loader import SplitBatches, is_stream, loader_settings
    from coretrain.markers import hookimpl, hookspec
    from coretrain.outputs import NUM_TOKENS, forward, inputs_and_target, model_outputs
    from coretrain.pluginmanager import discover, field_defaults, hooks_of
    from coretrain.run import DatasetContext, Datasets, Run, Scheduler, StepOutputs, TrainState
    from coretrain.validators import FieldValueError, exit_code, fraction, in_range, non_negative, positive

# written out (not built from _LAZY) so that type checkers see what is exported; a test holds the two equal
# fmt: off
__all__ = [
    "__version__", "train", "TrainResult", "load", "prepare", "load_plugins",  # a run from Python
    "hookimpl", "hookspec", "HOOK_API", "Outcome", "Control", "Every",  # the hook contract
    "Run", "TrainState", "StepOutputs", "Datasets", "DatasetContext", "Scheduler",  # what hooks receive
    "DistInfo", "max_over_ranks", "mean_over_ranks", "sum_over_ranks", "is_sharded",  # ranks
    "fetch", "to_device", "SampleOrder", "is_stream", "SplitBatches", "loader_settings",  # data
    "forward", "model_outputs", "inputs_and_target", "NUM_TOKENS", "gradient_norm", "clip_to",  # models
    "UserError", "require", "did_you_mean", "config_as_dict", "config_changes",  # errors, configs
    "find_checkpoint", "step_dir", "step_dirs", "linked_step", "read_manifest", "read_weights",  # checkpoints
    "SHARED_PARAMETERS", "rng_state", "set_rng_state",  # (the random streams, as a checkpoint holds them)
    "FieldValueError", "positive", "non_negative", "fraction", "in_range", "exit_code",  # option fields
    "add_config_args", "field_defaults", "discover", "hooks_of",  # command plugins
]
# fmt: on


MOVED_GROUP = "coretrain.moved"
"""Public names that left the core, by the distribution that holds them now: ``NAME = "module:attr"``."""


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562), or one that moved to a
    plugin distribution, with its warning."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name.startswith("__") or (value := _moved(name)) is None:
        raise AttributeError(f"module 'coretrain' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute (and a moved name warns once)
    return value


def _moved(name: str) -> Any:
    """A name that moved to a plugin distribution (which says so in the ``coretrain.moved``
    entry-point group): still found, with a deprecation warning naming its new place."""
    if (point := _moved_points().get(name)) is None:
        return None
    import warnings

    where = f"{point.value.replace(':', '.')} ({point.dist.name if point.dist else 'an installed distribution'})"
    warnings.warn(f"coretrain.{name} moved to {where}; import it from there", DeprecationWarning, stacklevel=3)
    return point.load()


@functools.cache
def _moved_points() -> dict[str, Any]:
    """Read once: probing for an attribute that is not there costs a dict lookup."""
    from importlib.metadata import entry_points

    return {point.name: point for point in entry_points(group=MOVED_GROUP)}


def __dir__() -> list[str]:
    return sorted(__all__)
