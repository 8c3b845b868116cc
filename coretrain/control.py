"""The one way plugins steer the loop: requests recorded here, honoured at defined points."""

from __future__ import annotations

from attrs import define


@define
class Control:
    """Requests from plugins to the loop.

    Plugins never raise to steer the loop; they call these methods and the loop acts at the
    next defined point: an update veto before the optimizer step (agreed at once, for plugins
    that declare ``coretrain_vetoes_updates``); a stop or checkpoint at a step boundary — the
    end of this step on one rank, the end of the next on several (the request is agreed
    without blocking, one step late), or this step's end when it is a save, an evaluation or
    the last step; a stop asked for on resume, before the first step.
    """

    stop_reason: str | None = None
    exit_code: int = 0
    checkpoint_requested: bool = False
    checkpoint_persistent: bool = False
    """Whether a request for the pending checkpoint wants it in ``checkpoints/``; when none does,
    it goes where a plugin's ``checkpoint_target`` says (a fast tier), if one answers."""
    skip_reason: str | None = None
    rerun: bool = False
    non_persistent_dir: str | None = None
    """Deprecated since hook API 1.15 (a plugin for 1.12 sets it in ``configure_run``): answer the
    ``checkpoint_target`` hook instead. Honoured until 2.0, with a warning."""

    def request_stop(self, reason: str, *, checkpoint: bool = True, exit_code: int = 0) -> None:
        """End training at the next step boundary (see the class; with a checkpoint unless
        ``checkpoint=False``); the process exits with ``exit_code`` (the largest one requested wins)."""
        self.stop_reason = reason
        self.exit_code = max(self.exit_code, exit_code)
        if checkpoint:
            self.request_checkpoint()

    def request_checkpoint(self, persistent: bool = True) -> None:
        """Save a checkpoint at the next step boundary (see the class); ``persistent=False``: where
        a plugin's ``checkpoint_target`` says, unless a persistent one is due or asked for then."""
        self.checkpoint_persistent = persistent or self.checkpoint_persistent
        self.checkpoint_requested = True

    def skip_update(self, reason: str, *, rerun: bool = False) -> None:
        """Veto this step's optimizer update (only meaningful in ``before_update``). With
        ``rerun``, run the step's forward and backward again on the same batches instead, its
        gradients dropped, then ``before_update`` again (the plugin restores whatever random
        state the step should see again); with several ranks, any rank's rerun is every rank's."""
        self.skip_reason, self.rerun = reason, rerun
