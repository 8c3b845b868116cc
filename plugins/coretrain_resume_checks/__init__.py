"""``resume-checks`` (on by default): what a resume may change in the config, and what it may not.

A checkpoint's weights, data position and random streams mean something only together with
the config they were trained under, and the sequence length the data provider reports. Some
keys may change on resume and take effect from the first resumed step (the learning rate, the
batch size, the cadence, plugins); others would silently change what the run is (another seed
reorders the data from here on; another ``n_head`` reinterprets the same weights; another
dataset or sequence length makes the data position point at other samples). Every key has one
rule, by its longest listed prefix; keys not listed are applied. Applied changes are listed in
one warning; refused ones are one error naming them, unless ``allow_changes`` lists them. Asked
through the core's ``check_resume`` hook, before anything of the run changes; ``enabled =
false`` resumes whatever changed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from attrs import define, field

from coretrain import DistInfo, Run, UserError, config_as_dict, config_changes, hookimpl

log = logging.getLogger("coretrain")

REFUSED = {
    "run.seed": "the data order and every random stream follow it",
    "model": "the checkpoint's weights are those of the model it configured",
    "data.provider": "the data position counts samples of the dataset it built",
    "data.options": "the data position counts samples of the dataset it built",
    "seq_length": "the data position and the model depend on it (the data provider reports it)",
    "tokenizer.path": "the data's token ids and the model's vocabulary come from it",
}
"""Key (or section prefix) -> why a change is refused. Everything else is applied."""

UNREMARKED = ("train.exit_interval", "train.exit_duration_in_mins")
"""When this job stops: changed from one job of a run to the next as a matter of course
(Megatron's jobs do), so applied without a warning."""


def refusal(key: str, allowed: list[str]) -> str | None:
    """Why a change of ``key`` is refused, or None when it is applied."""
    if any(key == a or key.startswith(f"{a}.") for a in allowed):
        return None
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        reason = REFUSED.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} {before!r} -> {after!r}" for key, before, after in changes)


@define
class ResumeChecks:
    """Refuse a resume that would change what its checkpoint means; warn about other changes."""

    allow_changes: list[str] = field(factory=list)
    """Config keys (or sections, e.g. "model.options.dropout", "data.options") that a resume may
    change although they change what the checkpoint means (was checkpoint.allow_changes)."""

    @hookimpl
    def check_resume(self, run: Run, manifest: dict[str, Any], path: Path) -> None:
        changes = config_changes(manifest.get("config"), config_as_dict(run.config))
        saved_seq, seq = manifest.get("seq_length"), run.datasets.seq_length
        if saved_seq is not None and seq is not None and saved_seq != seq:
            changes.append(("seq_length", saved_seq, seq))
        refused = [(change, why) for change in changes if (why := refusal(change[0], self.allow_changes)) is not None]
        if refused:
            reasons = "; ".join(f"{describe([change])}: {why}" for change, why in refused)
            keys = json.dumps([key for (key, _, _), _ in refused])
            raise UserError(
                f"resuming from {path} would change what it means: {reasons}. Resume with the checkpoint's "
                f"values; or start a new run (another run.output_dir) from its weights with "
                f'checkpoint.pretrained = "{path}"; or apply them anyway with [plugins.resume-checks] '
                f"allow_changes = {keys}"
            )
        remarked = [change for change in changes if change[0] not in UNREMARKED]
        if remarked and run.dist.is_main:
            log.warning(
                "resuming with changed settings; the config's values are used from now on: %s",
                describe(remarked),
            )
        grown = batch_that_followed_the_ranks(run, manifest)
        if grown is not None and run.dist.is_main:
            log.warning(grown)


def batch_that_followed_the_ranks(run: Run, manifest: dict[str, Any]) -> str | None:
    """What to say when the global batch changes on resume although no key did: with
    ``train.global_batch_size`` unset it is micro-batch × data-parallel ranks, so a run resumed on
    more (or fewer) ranks trains on other batches from here on (as Megatron's would, printing only
    the new size); None when it stays or the config sets it."""
    saved = manifest.get("config") or {}
    train, layout, world = saved.get("train") or {}, saved.get("distributed") or {}, manifest.get("world_size")
    if run.config.train.global_batch_size or train.get("global_batch_size") or not isinstance(world, int):
        return None
    sizes = {key: layout.get(key, 1) for key in ("tp_size", "cp_size", "pp_size")}
    saved_dp = DistInfo(world_size=world, **sizes).dp_size  # the core's own count of data-parallel ranks
    before = train.get("micro_batch_size", 0) * saved_dp  # one micro-batch on each of them
    if not before or before == run.global_batch_size:
        return None
    micro, ranks = run.config.train.micro_batch_size, run.dist.dp_size
    fits = "" if before % (micro * ranks) == 0 else f" (with a train.micro_batch_size that × {ranks} divides it)"
    return (
        f"resuming step {manifest.get('step')} with a global batch of {run.global_batch_size} ({micro} × {ranks} "
        f"data-parallel rank(s)); it was {before} ({train.get('micro_batch_size')} × {saved_dp}): "
        f"train.global_batch_size is unset, so it follows the ranks. Set train.global_batch_size = {before}{fits} "
        "to train on with the batch it had"
    )
