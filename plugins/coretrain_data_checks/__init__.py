"""``data-checks`` (on by default): every split is read once before the first step.

A run that fails in its final validation loses everything it trained; a dataset that lies
about its length fails hours in. So before training each map-style split is asked: is it long
enough for one global batch (valid/test: for one evaluation), can its first and last samples
be read, are its token ids inside the vocabulary. Each failure is one :class:`UserError`
naming the split and what to change. A train stream with a ``state_dict()`` is checked to resume
where it stands (:mod:`.stream_state`; a warning: the run is right, its resume would not be);
other streams are read in order and not checked. That the
provider handed back a dataset at all is the core's check, not this plugin's. A batch of
float64 tensors (numpy's default) is noted, and when torch then fails on a float64 input to a
float32 model, the run's error says so (``explain_failure``).
Turn it off with ``[plugins.data-checks] enabled = false`` (a split too large to index twice).
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from attrs import define, field

from coretrain import Run, UserError, fetch, hookimpl, is_stream
from coretrain_data_checks.stream_state import stream_state_problem

log = logging.getLogger("coretrain")

NO_GRADIENT = "element 0 of tensors does not require grad"
"""torch's words when backward is called on a loss that autograd did not record."""
UNEVEN_SAMPLES = "stack expects each tensor to be equal size"
"""torch.stack's words when default_collate stacks samples of different lengths."""


@define
class DataChecks:
    """Check every split's length, first and last samples and token ids once, before training."""

    in_float64: list[str] = field(factory=list, init=False)
    """The splits whose first batch holds float64 tensors."""
    batch_keys: set[str] = field(factory=set, init=False)
    """The keys of the splits' first batches, when they are dicts (the model's keyword arguments)."""

    @hookimpl
    def on_datasets(self, run: Run) -> None:
        train, datasets = run.config.train, run.datasets
        # a full pass needs a sample per rank; eval_iters batches need one global batch
        eval_needed = run.dist.dp_size if train.eval_full else run.global_batch_size if train.eval_iters else 1
        self.in_float64.clear()
        self.batch_keys.clear()
        for split, dataset in [named for name in ("train", "valid", "test") for named in datasets.sets(name)]:
            if is_stream(dataset):
                if split == "train" and run.dist.is_main and (problem := stream_state_problem(dataset)):
                    log.warning(
                        "data.provider '%s': the train stream's state_dict() does not resume where it stands: %s; "
                        "a run resumed from a checkpoint would not read what an uninterrupted one reads",
                        run.config.data.provider,
                        problem,
                    )
                continue
            needed = run.global_batch_size if split == "train" else eval_needed
            micro_batch = min(train.micro_batch_size, needed)
            first = check_split(dataset, split, run.config.data.provider, needed, micro_batch, datasets)
            if any(tensor.dtype == torch.float64 for tensor in tensors_of(first)):
                self.in_float64.append(split)
            if isinstance(first, Mapping):
                self.batch_keys.update(str(key) for key in first)

    @hookimpl
    def explain_failure(self, run: Run, error: BaseException) -> str | None:
        """torch's dtype error for a float64 batch (numpy's default) in a float32 model, its stack
        error for samples of different lengths collated into one batch, a batch key the model's
        forward does not take, a forward that wants the target model.loss holds back, and a loss
        autograd did not record, each with the fix."""
        fixes = (
            uneven_samples(error),
            unexpected_key(error, self.batch_keys, run),
            held_target(error, run),
            no_gradient(error),
            self.float64_batches(error),
        )
        return next((fix for fix in fixes if fix is not None), None)

    def float64_batches(self, error: BaseException) -> str | None:
        """What to do about torch's dtype error for the float64 batches found before training, or None."""
        if not (self.in_float64 and isinstance(error, RuntimeError) and "double" in str(error).lower()):
            return None
        return (
            f"the {' and '.join(self.in_float64)} batches hold float64 tensors (numpy's default float type), "
            f"and the model computes in float32 ({str(error).splitlines()[0]}): return float32 from the "
            "dataset (x.astype(np.float32), torch.as_tensor(x, dtype=torch.float32)), or convert in data.collate_fn"
        )


def unexpected_key(error: BaseException, batch_keys: set[str], run: Run) -> str | None:
    """What to do about a dict batch's key that the model's ``forward`` does not take (torch's
    TypeError from ``model(**batch)``), or None for another error."""
    taken = re.search(r"(\S+)\(\) got an unexpected keyword argument '(\w+)'", str(error))
    if not (isinstance(error, TypeError) and taken and taken.group(2) in batch_keys):
        return None
    forward, key = taken.groups()
    parameters = forward_parameters(run)
    if len(parameters) == 1:  # forward(self, batch): the dict as one argument
        return (
            f"{forward}() takes the batch as one argument, but a dict batch is called as model(**batch), each "
            "key an argument: take the keys as forward's arguments, or hand the dict over in a tuple from "
            "data.collate_fn (return (batch,): model(*batch))"
        )
    if key == "labels" and "label" in parameters:
        return (
            f"{forward}() takes 'label', but the batches hold 'labels': hf-datasets renames a dataset's 'label' "
            "column so, as transformers' data collators do for their models; name forward's argument labels"
        )
    return (
        f"the batches hold '{key}', which {forward}() does not take (a dict batch is called as model(**batch)): "
        "leave it out of the samples or in data.collate_fn, or give forward a **kwargs"
    )


def held_target(error: BaseException, run: Run) -> str | None:
    """What to do when ``forward`` misses an argument because ``model.loss`` held the batch's
    target back from it (the model returns outputs; the loss is computed from them), or None."""
    missing = re.search(r"(\S+)\(\) missing \d+ required positional arguments?: (.+)$", str(error))
    if not (isinstance(error, TypeError) and missing and run.config.model.loss):
        return None
    forward, names = missing.groups()
    return (
        f"{forward}() misses {names}: with model.loss = {run.config.model.loss!r} the batch's target (its last "
        "item, or its 'labels' key) is held back from the model, which returns outputs the loss is computed "
        "from; drop the target from forward's arguments, or unset model.loss and return the loss"
    )


def no_gradient(error: BaseException) -> str | None:
    """What to do about a loss autograd did not record (torch's words kept), or None."""
    if not (isinstance(error, RuntimeError) and str(error).startswith(NO_GRADIENT)):
        return None
    return (
        f"the loss carries no gradient ({NO_GRADIENT}): it was computed under torch.no_grad() or "
        "inference_mode, from detached tensors (.detach(), .item(), numpy), or by a model with no "
        "parameter that trains; compute it from the model's outputs with autograd on"
    )


def forward_parameters(run: Run) -> list[str]:
    """The names ``forward`` of the run's model takes (none when it cannot be read)."""
    try:
        return list(inspect.signature(run.unwrapped_model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return []


def uneven_samples(error: BaseException) -> str | None:
    """What to do about samples of different lengths that the default collate stacked (torch's
    words kept), or None for another error."""
    if not (isinstance(error, RuntimeError) and str(error).startswith(UNEVEN_SAMPLES)):
        return None
    return (
        f"the samples of a micro-batch hold tensors of different lengths, which the default collate cannot "
        f"stack ({str(error).splitlines()[0]}): pad them in data.collate_fn (e.g. "
        "torch.nn.utils.rnn.pad_sequence(..., batch_first=True), padding labels with -100), or return samples "
        "of one length"
    )


def check_split(dataset: Any, split: str, provider: str, needed: int, micro_batch: int, datasets: Any) -> Any:
    """Length, first micro-batch, last sample, token ids of one map-style split; its first batch."""
    where = f"data.provider '{provider}': the {split} split"
    try:
        length = len(dataset)
    except Exception as exc:
        raise UserError(f"{where}: len() failed: {type(exc).__name__}: {exc}") from None
    if length < needed:
        if split == "train":
            fix = "lower train.global_batch_size / micro_batch_size or give it more data"
        else:
            fix = "lower the batch size, give it more data, or set train.eval_full = true or train.eval_iters = 0"
        raise UserError(
            f"{where} has {length} sample(s), fewer than {needed} (one global batch, or a sample "
            f"per rank for a full pass): {fix}"
        )
    batches = []
    for indices in (torch.arange(micro_batch), torch.arange(length - 1, length)):
        try:
            batches.append(fetch(dataset, indices, datasets.collate_fn))
        except Exception as exc:
            cause = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"  # a reader's own words
            cause = uneven_samples(exc) or cause
            raise UserError(f"{where}: cannot read samples {indices.tolist()[:4]} of {length}: {cause}") from None
        if datasets.vocab_size is not None:
            check_token_ids(batches[-1], datasets.vocab_size, where)
    return batches[0]


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors a batch holds at its top level (a tensor, or those of a tuple, list or dict)."""
    items = batch if isinstance(batch, (list, tuple)) else batch.values() if isinstance(batch, Mapping) else [batch]
    return [item for item in items if isinstance(item, torch.Tensor)]


def check_token_ids(batch: Any, vocab_size: int, where: str) -> None:
    """Integer tensors of the batch hold ids below ``vocab_size`` (negative ones are ignore-indices)."""
    for tensor in tensors_of(batch):
        if tensor.is_floating_point() or tensor.dtype == torch.bool:
            continue
        high = int(tensor.max()) if tensor.numel() else -1
        if high >= vocab_size:
            raise UserError(
                f"{where} holds token id {high}, outside the vocabulary (vocab_size {vocab_size}): "
                "a wrong dtype for the token file, or a tokenizer that does not match?"
            )
