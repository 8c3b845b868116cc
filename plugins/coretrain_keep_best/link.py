"""The ``checkpoints/best`` link: written only by keep-best, followed by the core (resume,
pretrained, export) as any named link to a committed step directory beside it; retention keeps
its step because keep-best says so (``protected_checkpoints``)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from coretrain import UserError, linked_step, read_manifest, step_dir

log = logging.getLogger("coretrain")
BEST = "best"
MANIFEST = "checkpoint.json"


def best_step(root: Path) -> int | None:
    """The step ``root/best`` points at (only a link to a committed step directory beside it).
    Formerly ``coretrain.best_step``, which still finds it here, with a deprecation warning."""
    return linked_step(root / BEST)


def require_best(root: Path, option: str) -> None:
    """``OPTION best`` (export's ``--step``, predict's ``--checkpoint``) needs the link: without
    it, one error saying which plugin makes it."""
    if root.is_dir() and best_step(root) is None:
        raise UserError(
            f"{option} best: {root} has no best checkpoint (the keep-best plugin keeps one: "
            '[plugins.keep-best] metric = "valid/loss")'
        )


def tidy_best(root: Path) -> None:
    """Before a run writes ``root/best``: what stands there must be coretrain's link.

    ``cp -rL``, ``rsync -L`` and ``shutil.copytree`` turn the link into a copy of the step it
    named; a run would then fail at every improving evaluation. A copy of a step that still
    exists is replaced by the link; a copy of one retention has deleted becomes that step
    again (renamed back), so no weights are lost. A link that leads outside the run is
    dropped (it is not trusted, see :func:`best_step`). Anything else is refused.
    """
    best = root / BEST
    if best.is_symlink():
        if best_step(root) is None:
            log.warning(
                "%s -> %s is not a link to a step of this run; ignoring and replacing it", best, os.readlink(best)
            )
            best.unlink()
        return
    if not best.exists():
        return
    step = _copied_step(best)
    if step is None:
        kind = "directory" if best.is_dir() else "file"
        raise UserError(
            f"{best} is not the link coretrain keeps to the best checkpoint (a {kind} it did not write); "
            "move it out of the checkpoints directory and run again"
        )
    original = step_dir(root, step)
    if original.exists():
        if _files(original) != _files(best):
            raise UserError(
                f"{best} is a directory that differs from {original.name}, the step its manifest names; "
                "move one of them out of the checkpoints directory and run again"
            )
        shutil.rmtree(best)
    else:
        os.replace(best, original)
    point_best(root, step)
    log.warning("%s was a copy of %s (cp -rL?); it is the link to it again", best, original.name)


def _copied_step(directory: Path) -> int | None:
    """The step a copied checkpoint directory holds, from its manifest (None: not a checkpoint)."""
    if not directory.is_dir():
        return None
    try:
        step = read_manifest(directory).get("step")
    except UserError:  # not a readable checkpoint
        return None
    return step if isinstance(step, int) and step >= 0 and (directory / MANIFEST).is_file() else None


def _files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` with its size, by relative path."""
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*") if p.is_file()}


def point_best(root: Path, step: int) -> None:
    """Make ``root/best`` point at ``step``'s directory (atomically: a reader sees the old or the new)."""
    tmp = root / f"{BEST}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(step_dir(root, step).name, tmp)
    os.replace(tmp, root / BEST)
