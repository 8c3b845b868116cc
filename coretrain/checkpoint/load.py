"""Putting a checkpoint's weights (and optimizer state) into the run's model, whatever the layouts.

A checkpoint is *replicated* (``model.pt`` / ``optimizer.pt``: whole tensors, as one rank or DDP
saves them) or *sharded* (torch.distributed.checkpoint, as FSDP2, HSDP and tensor parallelism
save them). The model in memory holds plain tensors (one rank, DDP) or DTensors (FSDP2, HSDP,
TP). Every pair loads, through torch's own state-dict API, so parameter names are the only
contract between layouts:

- sharded → any model: DCP reads, on each rank, the parts of each tensor its parameters hold
  (resharding by global offsets; a plain model reads whole tensors);
- replicated → a plain model: ``load_state_dict``;
- replicated → a DTensor model: ``set_model_state_dict`` / ``set_optimizer_state_dict`` with
  ``full_state_dict`` cut the whole tensors into this rank's shards; the optimizer file numbers
  its parameters (torch's ``Optimizer.state_dict``), which are named first by their place in the
  run's parameter groups.

Without the optimizer (``checkpoint.load_optimizer = false``, ``checkpoint.pretrained``,
``coretrain predict``) only the model's state is asked for, in every case.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from coretrain.checkpoint import safeload
from coretrain.checkpoint.layout import read_manifest
from coretrain.checkpoint.state import dcp_options, is_sharded
from coretrain.errors import CheckpointUnreadable, UserError

SHARED_PARAMETERS = "coretrain_shared_parameters"
"""A model's attribute mapping the names of parameters that are this rank's copy of a weight
another part also holds (a weight tied across pipeline stages: the last stage's copy of the
embedding) to that weight's own name: counted once, under its own name (Megatron's
``param.shared``); a checkpoint of a layout without the copy gives it the weight's state."""


def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    directory: Path,
    with_frozen: bool,
    single_process: bool,
    metadata: Any = None,
    kept: Collection[str] = (),
) -> None:
    """A DCP checkpoint (``directory`` = its ``sharded/``) into ``model`` and, when given,
    ``optimizer``; ``metadata``: its ``.metadata`` if already read (:func:`safeload.check_metadata`);
    the ``kept`` parameters are neither read nor changed."""
    from torch.distributed.checkpoint import state_dict as dsd
    from torch.distributed.checkpoint.state_dict_loader import load

    metadata = metadata or safeload.check_metadata(directory)
    saved = metadata.state_dict_metadata  # torch's nested optimizer groups before 0.4
    nested = any(key.startswith("optimizer.param_groups.") and key.endswith(".params") for key in saved)
    options = dcp_options(with_frozen, flat=not nested, strict=not kept)
    whole = dsd.get_model_state_dict(model, options=options)
    state: dict[str, Any] = {"model": {name: value for name, value in whole.items() if name not in kept}}
    if optimizer is not None:
        state["optimizer"] = dsd.get_optimizer_state_dict(model, optimizer, options=options)
    borrowed = _borrow_tied_state(state.get("optimizer"), model, saved)
    try:
        with warnings.catch_warnings():  # one process loading alone is what no_dist says; DCP warns of it
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load(
                state,
                storage_reader=safeload.dcp_reader(directory, metadata),
                planner=safeload.dcp_planner(directory),
                no_dist=single_process,
            )
    except safeload.dcp_errors() as exc:  # DCP gathers every rank's failure: report ours, or the first
        raise safeload.dcp_unreadable(directory, exc) from None
    _check_finite(state["model"], directory, single_process)
    dsd.set_model_state_dict(model, state["model"], options=options)
    if optimizer is not None:
        _give_borrowed(state["optimizer"], borrowed)
        dsd.set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def _borrow_tied_state(optimizer: dict[str, Any] | None, model: torch.nn.Module, saved: Any) -> dict[str, Any]:
    """A weight this rank holds a copy of (``coretrain.SHARED_PARAMETERS``: a pipeline's last
    stage's tied head) has no optimizer state of its own in a checkpoint of a layout that held it
    once: its entries are read from the weight's own — renamed in ``optimizer`` for the load, or,
    where this rank holds the weight too (a V-shaped pipeline's first rank), read once and copied
    after (:func:`_give_borrowed`). Returns own key -> the key read, or (that key, the tensor to
    copy it into)."""
    copies = getattr(getattr(model, "module", model), SHARED_PARAMETERS, None) or {}
    borrowed: dict[str, Any] = {}
    for key in list(optimizer or {}):
        kind, _, rest = key.partition(".")
        copy = next((name for name in copies if rest.startswith(name + ".")), None)
        if optimizer is None or copy is None or f"optimizer.{key}" in saved:
            continue
        source_key = f"{kind}.{copies[copy]}{rest[len(copy) :]}"
        if f"optimizer.{source_key}" not in saved:
            continue
        own = optimizer.pop(key)
        if source_key in optimizer:
            borrowed[key] = (source_key, own)
        else:
            optimizer[source_key] = own
            borrowed[key] = source_key
    return borrowed


def _give_borrowed(optimizer: dict[str, Any], borrowed: dict[str, Any]) -> None:
    """Each borrowed entry under its own key again (see :func:`_borrow_tied_state`)."""
    for own, read in borrowed.items():
        if isinstance(read, str):
            optimizer[own] = optimizer.pop(read)
            continue
        source_key, placeholder = read
        value = optimizer[source_key]
        if isinstance(placeholder, torch.Tensor) and isinstance(value, torch.Tensor):
            optimizer[own] = placeholder.copy_(value)
        else:
            optimizer[own] = value


def _check_finite(weights: dict[str, Any], directory: Path, single_process: bool) -> None:
    """No weight holds NaN or Inf (never saved: such weights stop a run first), agreed over the
    ranks, each of which checked its own shards."""
    from coretrain.dist import max_over_ranks

    bad = [
        name
        for name, value in weights.items()
        if isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(torch.isfinite(value.to_local() if hasattr(value, "to_local") else value).all())
    ]
    if bad if single_process else max_over_ranks(int(bool(bad)))[0]:
        where = f"'{bad[0]}'" if bad else "a weight another rank read"
        raise CheckpointUnreadable(directory, f"not a valid checkpoint: {where} holds NaN or Inf")


def load_whole(model: torch.nn.Module, unwrapped: torch.nn.Module, weights: dict[str, Any], strict: bool) -> None:
    """Whole tensors (a replicated ``model.pt``) into a plain model, or cut into a DTensor model's
    shards; keys the model does not have (a pipeline stage's: the other stages') are not asked for."""
    wanted = unwrapped.state_dict()
    weights = {key: value for key, value in weights.items() if key in wanted}
    if not is_sharded(model):
        unwrapped.load_state_dict(weights, strict=strict)
        return
    from torch.distributed.checkpoint import state_dict as dsd

    dsd.set_model_state_dict(model, weights, options=dsd.StateDictOptions(full_state_dict=True, strict=strict))


def load_whole_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], path: Path, weights: dict[str, Any]
) -> None:
    """A replicated ``optimizer.pt`` (torch's numbered form) into the run's optimizer, sharded or not.

    A DTensor model's optimizer is given its state by parameter name: the saved groups' names
    (``param_names``, recorded since 0.4) or, in an older file, the run's own order; a name the
    saved weights tie to another (an output head tied to the embedding) takes that one's state, as
    a pipeline's last stage, holding the head alone, needs."""
    if not is_sharded(model):
        try:
            optimizer.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise _not_fitting(path, exc) from None
        return
    from torch.distributed.checkpoint import state_dict as dsd

    groups: Any = dsd.get_optimizer_state_dict(model, optimizer)["param_groups"]
    try:
        named = {"state": _state_by_name(saved, groups, weights), "param_groups": groups}
        dsd.set_optimizer_state_dict(model, optimizer, named, options=dsd.StateDictOptions(full_state_dict=True))
    except (ValueError, KeyError, IndexError, RuntimeError) as exc:
        raise _not_fitting(path, exc) from None


def _state_by_name(saved: dict[str, Any], groups: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The saved optimizer's state under the names of the run's ``groups``' parameters (a weight
    the saved ``weights`` tie to another taking a copy of that one's)."""
    names = _saved_names(saved, groups)
    saved_state = {names[index]: moments for index, moments in saved["state"].items()}
    tied = _tied_names(weights)
    wanted = [key for group in groups for key in group["params"]]
    if unknown := [key for key in wanted if key not in names and tied.get(key) not in names]:
        raise KeyError(f"the file has no parameter named {', '.join(unknown[:3])}")
    state: dict[str, Any] = {}
    for key in wanted:
        alias = tied.get(key, key)
        # a copy of its own: a rank holding both (a V-shaped pipeline's first) updates them apart
        if alias != key and alias in saved_state:
            state[key] = _copied(saved_state[alias])
        elif key in saved_state:
            state[key] = saved_state[key]
    return state


def _saved_names(saved: dict[str, Any], groups: Any) -> list[str]:
    """The saved parameters' names in torch's numbering: the saved groups' ``param_names``
    (recorded since 0.4), else the run's own groups' order."""
    names = [name for group in saved["param_groups"] for name in group.get("param_names", [])]
    return names or [name for group in groups for name in group["params"]]


def _tied_names(weights: dict[str, Any]) -> dict[str, str]:
    """Each weight's name -> the name of the first weight sharing its tensor (its own when none
    before it does): an output head tied to the embedding maps to the embedding."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for key, tensor in weights.items():
        if tensor.numel():
            tied[key] = first.setdefault(tensor.data_ptr(), key)
    return tied


def _copied(moments: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state with tensors of its own."""
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in moments.items()}


def _not_fitting(path: Path, exc: BaseException) -> UserError:
    """torch's refusal of a saved optimizer state, with the way out (start the optimizer afresh)."""
    return UserError(
        f"{path}: the optimizer state does not fit this optimizer ({exc}); "
        "if its parameter groups changed, set checkpoint.load_optimizer = false"
    )


def read_weights(source: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a complete checkpoint, read safely in this one process (a
    sharded one's shards gathered): what an export or a conversion reads."""
    if read_manifest(source)["layout"] == "sharded":
        weights = read_sharded_model(source / "sharded")
    else:
        weights = safeload.load_file(source / "model.pt")
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise CheckpointUnreadable(source, "the model weights are not a dict of tensors")
    return weights


def read_sharded_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a DCP checkpoint, in this one process, read safely."""
    # dcp.load fills a copy of the dict it is given; torch's own dcp_to_torch_save calls this instead
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    metadata = safeload.check_metadata(directory)
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=safeload.dcp_reader(directory, metadata),
            planner=safeload.dcp_planner(directory, empty=True),
            no_dist=True,
        )
    except safeload.dcp_errors() as exc:
        raise safeload.dcp_unreadable(directory, exc) from None
    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointUnreadable(directory, "no model state in the sharded checkpoint")
    return model
