"""Resume a run from its checkpoints: choose, read safely, check, apply.

Reading (:func:`read`) is separate from applying (:func:`apply`), so a resume can fall back
past a corrupt checkpoint without having changed the run (:func:`read_newest_loadable`).
What a resume may and may not change is decided in :func:`check_resumable` and :func:`apply`;
whether the weights fit the model (:func:`check_model_fits`, :func:`check_sharded_fits`: one
error naming every misfit, for either kind of checkpoint) before any is loaded, here and for
``checkpoint.pretrained``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

import attrs
import torch

from coretrain.build import seed_everything
from coretrain.checkpoint import safeload, schema
from coretrain.checkpoint.layout import (
    complete_steps,
    followed_link,
    parse_step_dir,
    read_manifest,
    step_dir,
    step_dirs,
)
from coretrain.checkpoint.load import load_sharded, load_whole, load_whole_optimizer
from coretrain.checkpoint.state import frozen_names, set_rng_state
from coretrain.checkpoint.writer import checkpoint_root
from coretrain.configchanges import config_changes
from coretrain.configload import config_as_dict
from coretrain.errors import CheckpointUnreadable, UserError
from coretrain.pluginmanager import hook_calls
from coretrain.run import Run, TrainState

log = logging.getLogger("coretrain")


def resume_candidates(run: Run, target: Path | None) -> tuple[list[Path], bool]:
    """The checkpoints ``checkpoint.resume`` allows, newest first, and whether it named one
    explicitly; ``target``: a plugin's directory of checkpoints besides ``checkpoints/``
    (``checkpoint_target``)."""
    choice = run.config.checkpoint.resume
    if choice == "never":
        return [], False
    if choice != "auto":
        path = followed_link(Path(choice), "checkpoint.resume")
        parsed = parse_step_dir(path.name)
        if not path.is_dir() or parsed is None or not parsed[1]:
            raise UserError(f"checkpoint.resume: '{choice}' is not a checkpoint directory (step_NNNNNNNN)")
        return [path], True
    durable = checkpoint_root(run)
    roots = [durable] if target is None else [durable, target]
    candidates = [(step, step_dir(root, step)) for root in roots for step in complete_steps(root)]
    candidates.sort(key=itemgetter(0), reverse=True)  # newest first; at one step the durable one (a stable sort)
    newest = candidates[0][0] if candidates else -1
    for step, committed, partial in step_dirs(durable):
        if not committed and step > newest:
            log.warning("ignoring incomplete checkpoint %s (its save never committed)", partial)
    return [path for _, path in candidates], False


def optional_names(model: torch.nn.Module, frozen_saved: bool, kept: Collection[str] = ()) -> set[str]:
    """What a checkpoint need not hold: the frozen parameters, if it was saved without them, and
    the ``kept`` ones (left as the model was built: ``checkpoint.pretrained_exclude``)."""
    return {*kept, *(() if frozen_saved else frozen_names(model))}


def fit_problems(
    shapes: Mapping[str, Sequence[int] | None], current: Mapping[str, Any], optional: Collection[str], part: bool
) -> list[str]:
    """The names missing on either side and the shapes that differ, between a checkpoint's
    tensors (name → shape; None for a value that is no tensor) and the model's state dict
    (``current``); ``optional`` names are not asked for (the checkpoint may lack them, or hold
    them in any shape), and one loaded into a ``part`` of the model (a pipeline stage) holds
    the other parts' too."""
    problems = [f"'{k}' is missing from the checkpoint" for k in current if k not in shapes and k not in optional]
    problems += [f"'{k}' is in the checkpoint but not in the model" for k in shapes if k not in current and not part]
    for name, value in current.items():
        saved, shape = shapes.get(name), getattr(value, "shape", None)
        if name not in optional and saved is not None and shape is not None and list(saved) != list(shape):
            problems.append(f"'{name}' has shape {list(saved)} in the checkpoint, {list(shape)} now")
    return problems


def model_mismatches(
    saved: dict[str, Any], model: torch.nn.Module, optional: Collection[str], dtypes: bool = False, part: bool = False
) -> str:
    """:func:`fit_problems` of whole tensors, and those whose dtypes differ (with ``dtypes``) or
    that hold NaN or Inf (never saved: such weights stop a run first), in one phrase ("" when
    the weights fit)."""
    current = model.state_dict()
    shapes = {name: getattr(value, "shape", None) for name, value in saved.items()}
    problems = fit_problems(shapes, current, optional, part)
    if dtypes:  # a checked model file: every value a tensor
        problems += [
            f"'{k}' is {v.dtype} in the checkpoint, {current[k].dtype} in the model"
            for k, v in saved.items()
            if k in current and v.shape == current[k].shape and v.dtype != current[k].dtype
        ]
    problems += [
        f"'{k}' holds NaN or Inf"
        for k, v in saved.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]
    return in_one_phrase(problems)


def in_one_phrase(problems: list[str]) -> str:
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def check_model_fits(directory: Path, saved: dict[str, Any], run: Run, hint: str, optional: Collection[str]) -> None:
    """One error naming the parameters whose names or shapes differ (a changed model config)."""
    if problems := model_mismatches(saved, run.unwrapped_model, optional, part=run.dist.pp_size > 1):
        raise UserError(f"{directory}: the checkpoint does not fit the model: {problems}{hint}")


def sharded_shapes(metadata: Any) -> dict[str, Sequence[int] | None]:
    """A sharded checkpoint's model tensors and their whole shapes, from its DCP metadata."""
    return {
        key.removeprefix("model."): getattr(entry, "size", None)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }


def check_sharded_fits(directory: Path, metadata: Any, run: Run, hint: str, optional: Collection[str]) -> None:
    """:func:`check_model_fits` for a sharded checkpoint, from its metadata. A tensor in the
    checkpoint that the model does not hold is not read (DCP reads what the model asks for), so it
    is no misfit."""
    if problems := fit_problems(sharded_shapes(metadata), run.unwrapped_model.state_dict(), optional, part=True):
        raise UserError(f"{directory}: the checkpoint does not fit the model: {in_one_phrase(problems)}{hint}")


@attrs.define
class Restored:
    """What :func:`read` found in a checkpoint, before anything of the run is changed."""

    path: Path
    manifest: dict[str, Any]
    rank_state: dict[str, Any]
    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    metadata: Any = None
    """A sharded checkpoint's DCP metadata, checked (read once: the load uses it)."""


def read(run: Run, path: Path, with_optimizer: bool = True) -> Restored:
    """Read and check this rank's files of a checkpoint; changes nothing (so a caller may fall back).

    On another number of ranks than the checkpoint's: a rank the checkpoint did not have takes
    rank 0's file (train state, schedule and plugin states are the same on every rank) with
    its random streams derived from (seed, rank, step); every rank gets the pending log
    interval averaged over all saved ranks, so the next logged loss still covers every rank's
    steps."""
    info = read_manifest(path)
    saved_world = int(info.get("world_size") or run.dist.world_size)
    saved_stages = int(((info.get("config") or {}).get("distributed") or {}).get("pp_size") or 1)
    rank = run.dist.rank
    own = rank if rank < saved_world else 0
    rank_state = _rank_state(path, own, info.get("step"))
    if saved_world != run.dist.world_size and rank >= saved_world:
        rank_state["rng"] = None
    if saved_world != run.dist.world_size or saved_stages != run.dist.pp_size:  # another rank had this one's place
        # the pending interval as every saved rank that reported a loss had it, averaged when it was saved
        rank_state["interval_log"] = rank_state.get("interval_log_mean", rank_state.get("interval_log"))
    declared = run.plugins.get  # a plugin's coretrain_state: what its saved state must look like
    schema.check_plugin_states(
        rank_state.get("plugins") or {},
        lambda name: getattr(declared(name), "coretrain_state", None),
        path / f"rank_{own:05d}.pt",
    )
    restored = Restored(path, info, rank_state)
    if info["layout"] == "replicated":
        restored.model = _model_file(run, path, info)
        if with_optimizer:
            restored.optimizer = safeload.load_file(path / "optimizer.pt")
            schema.validate(restored.optimizer, schema.OPTIMIZER_FILE, path / "optimizer.pt")
            if run.dist.pp_size == 1 and not changed_keys_hint(info.get("config"), run.config, ("model", "data")):
                schema.check_optimizer_fits(restored.optimizer, run.optimizer, path / "optimizer.pt")
    else:  # read here, a crafted or torn one fails before the run changes
        restored.metadata = safeload.check_metadata(path / "sharded")
    return restored


def _rank_state(path: Path, rank: int, manifest_step: int | None) -> dict[str, Any]:
    """A rank file, checked against its schema and against the step the checkpoint is of."""
    rank_file = path / f"rank_{rank:05d}.pt"
    rank_state = safeload.load_file(rank_file)
    schema.validate(rank_state, schema.RANK_FILE, rank_file)
    step = rank_state["train"]["step"]
    named = parse_step_dir(path.name)
    expected = manifest_step if manifest_step is not None else named[0] if named else step
    if step != expected:
        raise CheckpointUnreadable(
            rank_file, f"not a valid checkpoint file: train.step is {step}, the checkpoint's {expected}"
        )
    schema.check_counters(rank_state, rank_file)
    return dict(rank_state)


def _model_file(run: Run, path: Path, info: dict[str, Any]) -> dict[str, Any]:
    """model.pt, checked to be a state dict of tensors that fits the model when the config is the
    one it was saved with (a file that does not is damaged: an automatic resume falls back past
    it); a changed config's misfit is the user's to fix, an error naming the keys in apply."""
    model = safeload.load_file(path / "model.pt")
    schema.validate(model, schema.MODEL_FILE, path / "model.pt")
    if changed_keys_hint(info.get("config"), run.config, ("model", "data")):
        return dict(model)  # the config changed: whether it still fits is for check_resumable and apply to say
    optional, part = optional_names(run.unwrapped_model, info.get("frozen_saved", True)), run.dist.pp_size > 1
    if problems := model_mismatches(model, run.unwrapped_model, optional, dtypes=True, part=part):
        raise CheckpointUnreadable(
            path / "model.pt", f"not a valid checkpoint file: it does not fit the model it was saved from: {problems}"
        )
    return dict(model)


def apply(run: Run, restored: Restored, with_optimizer: bool = True) -> None:
    """Put a checkpoint read by :func:`read` into the run: model, optimizer, schedule, counters, RNG.

    The optimizer's hyperparameters (lr, betas, weight decay, per-group overrides) come from
    the config, not the checkpoint (Megatron's override_opt_param_scheduler): its moments and
    step counts are what resume needs; the settings are what the user asked for now.
    """
    path, state = restored.path, restored.rank_state
    hint = changed_keys_hint(restored.manifest.get("config"), run.config, ("model",))
    configured = [{k: v for k, v in group.items() if k != "params"} for group in run.optimizer.param_groups]
    frozen_saved = restored.manifest.get("frozen_saved", True)
    optional = optional_names(run.unwrapped_model, frozen_saved)
    if restored.manifest["layout"] == "sharded":
        optimizer = run.optimizer if with_optimizer else None
        check_sharded_fits(path, restored.metadata, run, hint, optional)  # what DCP cannot read from here on is damage
        single = run.dist.world_size == 1
        load_sharded(run.model, optimizer, path / "sharded", frozen_saved, single, restored.metadata)
    else:
        assert restored.model is not None
        check_model_fits(path, restored.model, run, hint, optional)
        load_whole(run.model, run.unwrapped_model, restored.model, strict=frozen_saved)
        if with_optimizer:
            saved = restored.optimizer or {}
            load_whole_optimizer(run.model, run.optimizer, saved, path / "optimizer.pt", restored.model)
    for group, settings in zip(run.optimizer.param_groups, configured):
        group.update(settings)
    run.scheduler.load_state_dict(state["scheduler"])
    if run.grad_scaler is not None and "grad_scaler" in state:
        run.grad_scaler.load_state_dict(state["grad_scaler"])
    run.state = TrainState(**state["train"])
    if state["rng"] is not None:
        set_rng_state(state["rng"])
    else:  # a rank the checkpoint did not have: its own streams, fixed by (seed, rank, step)
        seed_everything((run.config.run.seed + 1_000_003 * run.dist.dp_rank + run.state.step) % 2**32)


def read_newest_loadable(run: Run, candidates: list[Path], explicit: bool, with_optimizer: bool) -> Restored:
    """The newest of ``candidates`` every rank can read, falling back past corrupt ones.

    Every rank reads its part first and the ranks agree on the verdict, so all of them resume
    from the same step. A checkpoint named explicitly, or one whose file names code to run,
    is never skipped: its error stops the run. Nothing is deleted.
    """
    from coretrain.dist import max_over_ranks

    for tried, path in enumerate(candidates, start=1):
        problem: CheckpointUnreadable | None = None
        try:
            restored = read(run, path, with_optimizer)
        except CheckpointUnreadable as exc:
            problem = exc
        verdict = 0 if problem is None else 2 if problem.unsafe else 1
        if run.dist.world_size > 1:
            verdict = max_over_ranks(verdict)[0]
        if verdict == 0:
            return restored
        problem = problem or CheckpointUnreadable(path, "another rank could not read its part of it")
        if verdict == 2 or explicit or tried == len(candidates):
            raise problem
        log.warning(
            "%s: %s; falling back to the previous complete checkpoint, deleting nothing", problem.path, problem.reason
        )
    raise AssertionError("no candidates")  # callers pass at least one


def check_resumable(run: Run, info: dict[str, Any], path: Path) -> None:
    """Refuse what a resume cannot carry over; say which settings change.

    The optimizer class, with its state, is part of what the checkpoint means: a change is an
    error naming the key. Then plugins may refuse it (``check_resume``: the built-in
    ``resume-checks`` refuses a changed seed, model, dataset or sequence length and lists every
    other change in one warning; ``streams`` a stream's changed ranks or workers).
    """
    saved_optimizer, config = info.get("optimizer"), run.config
    if saved_optimizer and saved_optimizer != config.optimizer.name and config.checkpoint.load_optimizer:
        raise UserError(
            f"optimizer.name: the checkpoint was trained with '{saved_optimizer}', the config asks for "
            f"'{config.optimizer.name}'; its state cannot carry over: set checkpoint.load_optimizer = "
            "false to start the optimizer afresh (weights, step and data position are kept)"
        )
    if hook_calls(run).implemented("check_resume"):  # a plugin's refusal: resume-checks, the config's changes
        hook_calls(run).hook.check_resume(run=run, manifest=info, path=path)


def changed_keys_hint(saved: dict[str, Any] | None, config: Any, sections: tuple[str, ...]) -> str:
    """The keys of ``sections`` that changed since the checkpoint, for an error that a changed
    config may explain (``"; changed since the checkpoint: ..."``, or nothing)."""
    changed = [
        f"{key} ({before!r} -> {after!r})"
        for key, before, after in config_changes(saved, config_as_dict(config))
        if key.split(".")[0] in sections
    ]
    return f"; changed since the checkpoint: {', '.join(changed)}" if changed else ""
