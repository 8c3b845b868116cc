"""coretrain: a small PyTorch training loop whose every feature is a plugin.

The public API — everything a plugin needs, first-party or third-party — is what ``__all__``
lists, importable from ``coretrain`` itself. Importing this package imports no torch: the
names below load their modules on first use.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `coretrain` is the first
# import of the console script, before its Ctrl-C handler exists, so it imports next to nothing
__version__ = "0.2.0"


_LAZY = {
    # the Python API: a run from a notebook or a script
    "train": "coretrain.api",
    "TrainResult": "coretrain.api",
    "load": "coretrain.api",
    # the hook contract
    "HOOK_API": "coretrain.hookspecs",
    "Outcome": "coretrain.hookspecs",
    # what every hook receives, and what it may ask for
    "Run": "coretrain.run",
    "TrainState": "coretrain.run",
    "StepOutputs": "coretrain.run",
    "Control": "coretrain.control",
    "Every": "coretrain.cadence",
    "DistInfo": "coretrain.dist",
    # data a provider returns
    "Datasets": "coretrain.run",
    "DatasetContext": "coretrain.run",
    "TokenWindows": "coretrain.data",
    "RandomWindows": "coretrain.data",
    "windows": "coretrain.data",
    "fetch": "coretrain.data",
    "to_device": "coretrain.data",
    "is_stream": "coretrain.loader",
    "SampleOrder": "coretrain.data",
    "SplitBatches": "coretrain.loader",
    # the model, called as a training step calls it, and its repeated blocks
    "forward": "coretrain.outputs",
    "model_outputs": "coretrain.outputs",
    "NUM_TOKENS": "coretrain.outputs",
    "blocks_of": "coretrain.blocks",
    # helpers plugins share with the core
    "LoggingBackend": "coretrain.backend",
    "UserError": "coretrain.errors",
    "require": "coretrain.errors",
    "config_as_dict": "coretrain.configload",
    "is_sharded": "coretrain.checkpoint",
    "find_checkpoint": "coretrain.checkpoint",
    "max_over_ranks": "coretrain.dist",
    "mean_over_ranks": "coretrain.dist",
    "sum_over_ranks": "coretrain.dist",
    # validators for a plugin's config fields
    "FieldValueError": "coretrain.validators",
    "positive": "coretrain.validators",
    "non_negative": "coretrain.validators",
    "fraction": "coretrain.validators",
    "in_range": "coretrain.validators",
    "exit_code": "coretrain.validators",
}

if TYPE_CHECKING:  # what a type checker sees; at run time __getattr__ imports on first use
    from typing import Any

    import pluggy

    hookimpl: pluggy.HookimplMarker
    """Mark a plugin method as a hook implementation: ``@hookimpl`` / ``@hookimpl(trylast=True)``."""
    from coretrain.api import TrainResult, load, train
    from coretrain.backend import LoggingBackend
    from coretrain.blocks import blocks_of
    from coretrain.cadence import Every
    from coretrain.checkpoint import find_checkpoint, is_sharded
    from coretrain.configload import config_as_dict
    from coretrain.control import Control
    from coretrain.data import RandomWindows, SampleOrder, TokenWindows, fetch, to_device, windows
    from coretrain.dist import DistInfo, max_over_ranks, mean_over_ranks, sum_over_ranks
    from coretrain.errors import UserError, require
    from coretrain.hookspecs import HOOK_API, Outcome
    from coretrain.loader import SplitBatches, is_stream
    from coretrain.outputs import NUM_TOKENS, forward, model_outputs
    from coretrain.run import DatasetContext, Datasets, Run, StepOutputs, TrainState
    from coretrain.validators import FieldValueError, exit_code, fraction, in_range, non_negative, positive

__all__ = [
    "__version__",
    "train",
    "TrainResult",
    "load",
    "hookimpl",
    "HOOK_API",
    "Outcome",
    "Run",
    "TrainState",
    "StepOutputs",
    "Control",
    "Every",
    "DistInfo",
    "Datasets",
    "DatasetContext",
    "TokenWindows",
    "RandomWindows",
    "windows",
    "fetch",
    "to_device",
    "is_stream",
    "SampleOrder",
    "SplitBatches",
    "forward",
    "model_outputs",
    "NUM_TOKENS",
    "blocks_of",
    "LoggingBackend",
    "UserError",
    "require",
    "config_as_dict",
    "is_sharded",
    "find_checkpoint",
    "max_over_ranks",
    "mean_over_ranks",
    "sum_over_ranks",
    "FieldValueError",
    "positive",
    "non_negative",
    "fraction",
    "in_range",
    "exit_code",
]


def __getattr__(name: str) -> Any:
    if name == "hookimpl":  # pluggy loads on first use too: `python -m coretrain` starts quicker
        import pluggy

        globals()[name] = pluggy.HookimplMarker("coretrain")
        return globals()[name]
    if name not in _LAZY:
        raise AttributeError(f"module 'coretrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
