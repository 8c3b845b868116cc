"""``compute_metrics``: metrics of a whole split from every sample's prediction and label — F1,
AUC, a confusion matrix, what a mean over batches cannot give — called as the Hugging Face
``Trainer`` calls its ``compute_metrics``, once per evaluation, with all of them.

The predictions are what the model returned for each sample (a tensor, its ``logits``, or a
tuple's first tensor with a batch dimension, such as nanoGPT's ``(logits, loss)``), taken from
the evaluation's own forward passes by a forward hook; the labels are the batch's target (its
last item, or its ``labels`` / ``label`` / ``label_ids``). Every rank's share is gathered (a
tensor-parallel group's first rank's copy, a pipeline's last stage's) and put back in sample
order, so the function sees the split as one process would, on every rank alike.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from coretrain_losses import logits_in

from coretrain import Run, UserError, inputs_and_target

KEY = "plugins.evaluation.compute_metrics"


def import_metrics(path: str) -> Callable[..., Any]:
    """``package.module:function``, imported when the run starts (a module of the current directory
    is found, as for ``model.provider``); one that does not import is one error."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise UserError(f"{KEY}: '{path}' is not an import path; expected 'package.module:function'")
    try:
        function = getattr(importlib.import_module(module), name)
    except Exception as exc:  # ImportError, AttributeError, or what the module raised as it loaded
        raise UserError(f"{KEY}: cannot import '{path}': {type(exc).__name__}: {exc}") from None
    if not callable(function):
        raise UserError(f"{KEY}: '{path}' is not callable")
    return function  # type: ignore[no-any-return]


class Collected:
    """This rank's predictions and labels over one evaluation, from a forward hook on the model.

    The hook is registered once, for the run, and keeps outputs only during an evaluation
    (:meth:`start`): one registered afresh for each would change the module's hooks, which a
    compiled model guards on — every evaluation would compile it again."""

    def __init__(self, model: torch.nn.Module, function: Callable[..., Any]) -> None:
        self.function = function
        """The user's ``compute_metrics``."""
        self.outputs: list[Any] = []
        self.predictions: list[torch.Tensor] = []
        self.labels: list[Any] = []
        self.indices: list[torch.Tensor] = []
        self.active = False
        self._hook = model.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.active:
            self.outputs.append(output)

    def start(self) -> None:
        """An evaluation begins: keep the outputs of its forward passes."""
        self.outputs, self.predictions, self.labels, self.indices = [], [], [], []
        self.active = True

    def add(self, batch: Any, chunk: torch.Tensor | None, counted: bool) -> None:
        """After each forward: keep what it returned for ``batch`` (unless the rank ran it only to keep in step)."""
        outputs, self.outputs = self.outputs, []
        if not counted:
            return
        predictions = logits_in(outputs[-1]) if outputs else None
        if predictions is None:
            what = type(outputs[-1]).__name__ if outputs else "nothing (a plugin ran the forward in parts)"
            raise UserError(
                f"{KEY}: the model returned {what}, which holds no per-sample outputs; return logits, a dict or "
                "object with 'logits', or a tuple starting with them"
            )
        self.predictions.append(predictions.detach().cpu())
        labels = inputs_and_target(batch)[1]
        self.labels.append(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
        if chunk is not None:
            self.indices.append(chunk)

    def stop(self) -> None:
        self.active = False

    def metrics(self, run: Run, split: str) -> dict[str, float]:
        """The function's metrics of the evaluation just run, over every rank's samples."""
        return computed(self.function, *self.gathered(run), split)

    def close(self) -> None:
        self._hook.remove()

    def gathered(self, run: Run) -> tuple[torch.Tensor, Any]:
        """Every rank's predictions and labels, in sample order (a stream's: rank by rank)."""
        mine = (self.predictions, self.labels, self.indices) if run.reports_loss else None
        shares: list[Any] = [mine] if mine is not None else []
        if run.dist.world_size > 1:  # each replica's share from its first rank that has one
            everyone: list[Any] = [None] * run.dist.world_size
            torch.distributed.all_gather_object(everyone, (run.dist.dp_rank, mine))
            by_replica = dict(part for part in everyone[::-1] if part[1] is not None)
            shares = [share for _, share in sorted(by_replica.items())]
        predictions = [part for share in shares for part in share[0]]
        labels = [part for share in shares for part in share[1]]
        indices = [part for share in shares for part in share[2]]
        joined = concatenated(predictions) if predictions else torch.empty(0)
        if all(isinstance(label, torch.Tensor) for label in labels) and labels:
            joined_labels: Any = concatenated(labels)
        else:
            joined_labels = None if all(label is None for label in labels) else [x for part in labels for x in part]
        if len(indices) != len(predictions) or not indices:
            return joined, joined_labels
        order = torch.argsort(torch.cat(indices), stable=True)
        if isinstance(joined_labels, list):  # labels that are no tensors (strings) follow the same order
            return joined[order], [joined_labels[i] for i in order.tolist()]
        return joined[order], (joined_labels[order] if joined_labels is not None else None)


def concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    """Batches joined on their first dimension, each padded with -100 to the longest where their
    other dimensions differ (sequences of another length), as the Hugging Face Trainer joins them."""
    widest = [max(sizes) for sizes in zip(*(part.shape[1:] for part in parts))]
    padded = []
    for part in parts:
        missing = [most - size for size, most in zip(part.shape[1:], widest)]
        pad = [amount for gap in reversed(missing) for amount in (0, gap)]  # F.pad: the last dimension first
        padded.append(torch.nn.functional.pad(part, pad, value=-100) if any(missing) else part)
    return torch.cat(padded)


class EvalPrediction(NamedTuple):
    """What the Hugging Face ``Trainer`` hands a ``compute_metrics`` of one parameter (its class when
    transformers is imported): numpy arrays, read as ``p.predictions`` or ``logits, labels = p``."""

    predictions: Any
    label_ids: Any


def as_numpy(value: Any) -> Any:
    """A tensor as the Trainer hands it over: a numpy array, bf16 and fp16 as float32."""
    if not isinstance(value, torch.Tensor):
        return value
    return (value.float() if value.is_floating_point() else value).numpy()


def takes_one_argument(function: Callable[..., Any]) -> bool:
    """``compute_metrics(eval_pred)``, the Trainer's form, rather than ``(predictions, labels)``."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1 and not any(p.kind == p.VAR_POSITIONAL for p in parameters)


def computed(function: Callable[..., Any], predictions: torch.Tensor, labels: Any, split: str) -> dict[str, float]:
    """The metrics as ``SPLIT/NAME`` of ``function(predictions, labels)`` (torch tensors), or of
    ``function(eval_pred)`` (the Trainer's form); anything but numbers by name is one error."""
    if takes_one_argument(function):
        transformers = sys.modules.get("transformers")
        kind = transformers.EvalPrediction if transformers is not None else EvalPrediction
        result = function(kind(predictions=as_numpy(predictions), label_ids=as_numpy(labels)))
    else:
        result = function(predictions, labels)
    if not isinstance(result, Mapping):
        raise UserError(f"{KEY}: returned a {type(result).__name__}; return a dict of metrics by name")
    metrics = {}
    for name, value in result.items():
        try:
            metrics[f"{split}/{name}"] = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise UserError(f"{KEY}: '{name}' is a {type(value).__name__}, not a number") from None
    return metrics
