"""The named losses of ``model.loss``: ``"cross_entropy"`` and ``"mse"``.

A model that returns outputs (logits, a dict / object with ``logits``, or a tuple that starts
with them) rather than its loss
gets one from ``model.loss``; a name there is looked up in the ``coretrain.losses`` entry-point
group, which this distribution fills (yours may add names: ``focal = "mypkg.losses:focal"``),
and ``"pkg.module:function"`` names any function. A loss is ``fn(outputs, target)`` and
returns the loss, or a dict with ``loss`` and other scalars to log.
"""

from __future__ import annotations

from typing import Any

import torch

from coretrain import UserError

__all__ = ["cross_entropy", "mse"]


def logits_in(output: Any) -> torch.Tensor | None:
    """The model's outputs as a tensor, or None: a tensor, the ``logits`` of a dict or an object (a
    Hugging Face ``ModelOutput``), or a tuple's first tensor with a batch dimension (nanoGPT's
    ``(logits, loss)``, transformers' ``(loss, logits, ...)`` with ``return_dict=False``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((item for item in output if isinstance(item, torch.Tensor) and item.dim() > 0), None)
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def logits_of(output: Any) -> torch.Tensor:
    """:func:`logits_in`, or one error saying what a loss needs."""
    logits = logits_in(output)
    if logits is None:
        raise UserError(
            f"model.loss: the model returned a {type(output).__name__}, which holds no logits; return a tensor, "
            "a dict or object with 'logits', or a tuple whose first item is the logits"
        )
    return logits


def cross_entropy(output: Any, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean cross entropy over samples (or tokens: [B, T, V] logits, [B, T] targets; -100 is
    ignored) and accuracy."""
    logits = logits_of(output)
    if target.is_floating_point():  # class ids stored as floats (a pandas column): torch's error names no fix
        raise UserError(
            f'model.loss = "cross_entropy": the target is {target.dtype} (class ids are integers); return it as '
            'torch.long (torch.tensor(label, dtype=torch.long)), or set model.loss = "mse" for a regression'
        )
    flat_logits, flat_target = logits.reshape(-1, logits.size(-1)), target.reshape(-1)
    loss = torch.nn.functional.cross_entropy(flat_logits.float(), flat_target, ignore_index=-100)
    with torch.no_grad():
        counted = flat_target != -100
        accuracy = ((flat_logits.argmax(-1) == flat_target) & counted).sum() / counted.sum().clamp(min=1)
    return {"loss": loss, "accuracy": accuracy}


def mse(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the outputs (their ``logits``) against the target, in float32."""
    prediction = logits_of(output)
    return torch.nn.functional.mse_loss(prediction.float(), target.float().reshape(prediction.shape))
