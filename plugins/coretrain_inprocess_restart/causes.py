"""A failure in the few words every rank's restart line names it by."""

from __future__ import annotations

from coretrain import Run

PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")
"""Words of the errors a rank sees when a peer, not itself, failed (gloo's and NCCL's)."""


def described(run: Run | None, error: BaseException) -> str:
    """This rank's failure in a few words: where, and what was raised (a plugin's error by the
    plugin and hook, then its cause)."""
    step = getattr(error, "step", None) or (run.state.step + 1 if run is not None else None)
    where = f" at step {step}" if step is not None else " while the run was built"
    cause = getattr(error, "cause", None) if hasattr(error, "plugin") else None
    inner = cause if isinstance(cause, BaseException) else error
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    what = f"{type(inner).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if inner is not error:
        what = f"plugin '{getattr(error, 'plugin', '?')}' in {getattr(error, 'hook', '?')}: {what}"
    return f"raised{where}: {what}"
