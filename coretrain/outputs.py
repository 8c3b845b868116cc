"""What a model returns, turned into the loss the loop backpropagates and the values it logs.

The contract (docs/guides/your-model-and-data.md):

- ``model(*batch)`` for tuple/list batches, ``model(**batch)`` for dicts, ``model(batch)`` else;
- it returns the scalar loss; or a dict / object with ``loss`` and any other scalar
  values (``{"loss": l, "accuracy": a}``), logged as ``train/NAME`` and ``valid/NAME``; or a
  tuple whose one tensor of no dimensions is the loss (nanoGPT's ``(logits, loss)``);
- or, with ``model.loss`` set, it returns outputs (logits, or a dict / object with
  ``logits``) and the configured loss turns them into the loss (Megatron's forward_step /
  loss_func split): the batch's last item — or its ``labels`` key (or ``label``,
  ``label_ids``) — is the target and the rest is the model's input. A name is looked up in
  the ``coretrain.losses`` entry-point group (coretrain-plugins: ``cross_entropy``, which
  also reports ``accuracy``, and ``mse``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, cast

import torch

from coretrain.errors import UserError
from coretrain.run import LossFn, Run

TARGET_KEYS = ("labels", "label", "label_ids")
"""A dict batch's target, under the names transformers' data collators take it by."""


LOSSES_GROUP = "coretrain.losses"
"""Named losses for ``model.loss`` (coretrain-plugins gives ``cross_entropy`` and ``mse``)."""


def resolve_loss(name: str | None) -> LossFn | None:
    """The configured loss function, or None when the model returns its own loss."""
    if name is None:
        return None
    if ":" in name:
        from coretrain.usercode import import_callable

        return cast(LossFn, import_callable(name, "model.loss"))
    from importlib.metadata import entry_points

    from coretrain.errors import did_you_mean

    named = {point.name: point for point in entry_points(group=LOSSES_GROUP)}
    if name not in named:
        raise UserError(
            f"model.loss: '{name}' is neither an installed loss ({', '.join(sorted(named)) or 'none'}) nor an "
            f"import path 'pkg.module:function'{did_you_mean(name, named)}"
        )
    try:
        loaded: LossFn = named[name].load()
    except Exception as exc:  # a broken distribution: name it, with the cause
        raise UserError(f"model.loss: the loss '{name}' ({named[name].value}) failed to import: {exc}") from None
    return loaded


NUM_TOKENS = "num_tokens"
"""A model that returns this next to ``loss`` (its loss is the mean over that many tokens) gets
Megatron's per-token loss: each micro-batch weighs by its tokens, normalised by the step's
tokens over every micro-batch and rank — so padding and uneven lengths change nothing."""


def split_output(output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, other scalar tensors) from whatever the model or the loss function returned."""
    if isinstance(output, torch.Tensor):
        return one_value(output), {}
    if isinstance(output, tuple) and hasattr(output, "_asdict"):  # a namedtuple names its values: a dict
        output = output._asdict()
    if isinstance(output, (tuple, list)):  # nanoGPT's (logits, loss), or transformers' (loss, logits, ...)
        losses = [item for item in output if isinstance(item, torch.Tensor) and item.dim() == 0]
        if len(losses) > 1:
            raise UserError(
                f"the model returned a {type(output).__name__} holding {len(losses)} single values, so which is "
                "the loss is unclear; return a dict with 'loss' and the others by name"
            )
        if losses:
            return losses[0], {}
    items = output if isinstance(output, dict) else getattr(output, "__dict__", None)
    if items is None or items.get("loss") is None:
        if getattr(output, "loss", None) is not None:  # e.g. a Hugging Face ModelOutput
            return one_value(output.loss), {}
        raise UserError(
            f"the model returned a {type(output).__name__} without a loss (a Hugging Face model computes one "
            "only when the batch has 'labels'); return the loss, a dict with 'loss', or set model.loss to "
            "turn its outputs into one"
        )
    loss = one_value(items["loss"])
    logged = {name: logged_value(value, loss.device) for name, value in items.items() if name != "loss"}
    return loss, {name: value for name, value in logged.items() if value is not None}


def logged_value(value: Any, device: torch.device) -> torch.Tensor | None:
    """What is logged for a value the model returned beside its loss: a one-value tensor, or a
    number the model took off the device itself (``acc.item()``); None for anything else (a
    bool is a flag, not a metric)."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.numel() == 1 else None
    return torch.tensor(float(value), device=device) if type(value) in (int, float) else None


def one_value(loss: Any) -> torch.Tensor:
    """The loss, checked once it is out of the model: one value to backpropagate."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
    raise UserError(f"the loss is {what}, not one value; reduce it to one (e.g. loss.mean()) before returning it")


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model(*batch)``, ``model(**batch)`` or ``model(batch)``, as the batch is shaped."""
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(**batch) if isinstance(batch, Mapping) else model(batch)  # a dict, or transformers' BatchEncoding


def call(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward: the loss and the named scalar values to log."""
    if loss_fn is None:
        return split_output(call_model(model, batch))
    inputs, target = inputs_and_target(batch)
    if target is None:
        keys = f" (this batch has {sorted(batch)}: rename its target's key)" if isinstance(batch, Mapping) else ""
        names = ", ".join(repr(key) for key in TARGET_KEYS[:-1]) + f" or {TARGET_KEYS[-1]!r}"
        raise UserError(f"model.loss needs a target: a batch of (inputs..., target) or a dict with it as {names}{keys}")
    return split_output(loss_fn(call_model(model, inputs), target))


def inputs_and_target(batch: Any) -> tuple[Any, Any]:
    """A batch for a model with ``model.loss``: what the model gets, and the target held back
    (the dict's ``labels``, ``label`` or ``label_ids``, or a tuple's last item); None when the
    batch has none."""
    for key in TARGET_KEYS:
        if isinstance(batch, Mapping) and key in batch:
            return {name: value for name, value in batch.items() if name != key}, batch[key]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        *inputs, target = batch
        return tuple(inputs), target
    return batch, None


def model_outputs(run: Run, batch: Any, hold_target: bool | None = None) -> tuple[Any, Any]:
    """(the model's outputs, the batch's target or None) as a prediction sees them: with
    ``model.loss`` set the target is held back from the model, as in training; without, the
    model gets the whole batch (and its outputs may hold the loss) — unless ``hold_target``
    (a language model that returns its logits when called without targets). Under the run's
    precision."""
    held = run.loss_fn is not None if hold_target is None else hold_target
    inputs, target = inputs_and_target(batch) if held else (batch, None)
    with autocast(run):
        return call_model(run.model, inputs), target


def autocast(run: Run) -> contextlib.AbstractContextManager[Any]:
    """The run's precision (``run.precision``) for a forward: nothing for fp32, else autocast."""
    precision = run.config.run.precision
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(run.device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def forward(run: Run, batch: Any, model: torch.nn.Module | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and named values of one batch as a training step computes them: ``run.model``
    (or ``model``) under the run's precision, with its configured loss. No gradient is turned off
    here; wrap it in ``torch.no_grad()`` to evaluate."""
    with autocast(run):
        return call(model if model is not None else run.model, batch, run.loss_fn)
