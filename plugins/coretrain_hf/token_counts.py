"""Every labelled token of a step weighs the same for a transformers model a provider returns.

A transformers model computes its loss as the mean over its batch's labelled tokens. Averaged
over the micro-batches of an accumulated step, and over data-parallel ranks, such means weigh a
token of a short micro-batch more than one of a long one: the gradient-accumulation bug the
Hugging Face ``Trainer`` fixed in transformers 4.46 by handing the model ``num_items_in_batch``.
Here the model's output also says how many tokens its mean is over (``num_tokens``,
:data:`coretrain.NUM_TOKENS`), and the loop weighs each micro-batch's mean by that count over
the whole step and every rank, as it does the ``hf`` provider's models. The count is the
``Trainer``'s: the labels that are not -100, after the shift for a causal LM's loss
(``ForCausalLMLoss``, not an encoder-decoder's); a model whose loss takes ``num_items_in_batch``
is handed it, so its mean is over exactly that count.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from coretrain import NUM_TOKENS
from coretrain_hf.model import IGNORE_INDEX, adapted_model


def count_tokens(model: torch.nn.Module) -> None:
    """Hooks on ``model`` (a transformers model, or a PeftModel of one) that add ``num_tokens``
    to its output when it computed a loss from keyword ``labels`` (a dict batch's)."""
    base = adapted_model(model)
    shifted = loss_shifts_labels(base)
    takes_count = getattr(base, "accepts_loss_kwargs", None)
    takes_count = (takes_count if takes_count is not None else takes_keywords(base)) and takes_keywords(model)

    def counted(labels: torch.Tensor) -> torch.Tensor:
        return (labels[..., 1:] if shifted else labels).ne(IGNORE_INDEX).sum()

    def before(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        labels = kwargs.get("labels")
        if not takes_count or not isinstance(labels, torch.Tensor) or "num_items_in_batch" in kwargs:
            return None
        return args, {**kwargs, "num_items_in_batch": counted(labels)}

    def after(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor) and isinstance(output, dict) and output.get("loss") is not None:
            output[NUM_TOKENS] = kwargs.get("num_items_in_batch", counted(labels))
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def loss_shifts_labels(model: Any) -> bool:
    """The ``Trainer``'s test: the model's loss is transformers' causal-LM loss (position t
    predicts label t + 1) and the model is not an encoder-decoder (whose decoder input is shifted
    instead of its labels)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return LOSS_MAPPING.get(str(getattr(model, "loss_type", None))) is ForCausalLMLoss and not encoder_decoder


def takes_keywords(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` takes ``**kwargs`` (where transformers reads ``num_items_in_batch``)."""
    parameters = inspect.signature(model.forward).parameters.values()
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)
