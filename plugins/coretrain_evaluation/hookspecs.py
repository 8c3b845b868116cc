"""The hook the ``evaluation`` plugin asks (its ``coretrain.hookspecs`` entry point): who runs a
batch's forward when the model cannot be called on it whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from coretrain import hookspec

if TYPE_CHECKING:
    import torch

    from coretrain import Run


class EvaluationSpecs(Protocol):
    """Hooks for plugins that run the model's forward themselves."""

    @hookspec(firstresult=True)
    def forward_batch(self, run: Run, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The loss and named values of one evaluation batch (a spec of coretrain-plugins since hook API 1.11).

        Args: ``batch`` — this rank's micro-batch, on the run's device, under ``torch.no_grad()``
        with the model in eval mode.
        May change: nothing.
        Returns: (loss, named scalar values) as ``coretrain.forward`` gives them, the same on every
        rank that computes one batch together (a pipeline's stages: the last stage's loss); None
        to leave the forward to ``coretrain.forward`` (a plain model).
        Ranks: every rank, for each evaluation batch.
        """
