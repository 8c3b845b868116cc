"""The hook the ``pipeline-parallel`` plugin asks model providers (its ``coretrain.hookspecs``
entry point): how their model cuts into stages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from coretrain import hookspec

if TYPE_CHECKING:
    import torch

    from coretrain import Config, Run


class PipelineSpecs(Protocol):
    """Hooks for model providers whose models a pipeline can cut into stages."""

    @hookspec(firstresult=True)
    def pipeline_split(self, run: Run, model: torch.nn.Module) -> dict[str, Any] | None:
        """How ``model`` cuts into pipeline stages (a spec of coretrain-plugins since hook API 1.11).

        Args: ``run`` — ``run.dist.pp_size`` stages; ``model`` — the module ``provide_model``
        returned (before any wrapper).
        May change: nothing (the stage built from the answer reuses the model's modules).
        Returns: None when this plugin does not know the model, else a dict: ``layers`` — the
        number of repeated blocks to place; ``stage(layers, first: bool, last: bool)`` — the
        module holding the blocks ``layers`` (their indices, in order), with the embeddings when
        ``first``, the output head when ``last`` (a rank holding several stages asks for one
        module over all of them, then one per stage: they share its modules), its parameters
        named as in the whole model so checkpoints stay layout-free;
        it takes the batch's inputs on the first stage, the previous stage's output on the
        others; ``loss(output, target)`` — the last stage's loss; ``tied`` — pairs of parameter
        names (first stage's, last stage's) that are one weight in the whole model (a tied
        output head), whose gradients the two stages sum; optionally ``values(model)`` — this
        rank's stages' share of the model's named values since the last call (a dict of scalar
        tensors, the same names on every stage: the pipeline sums them over the stages and logs
        them), ``adds_to_loss`` — the names among them that the stages added to what they
        optimize (a mixture of experts' routers' losses: added to the logged training loss), and
        ``loss_value`` — the name under which the last stage's loss is logged too. Raise
        :class:`coretrain.UserError` for a model that cannot be split.
        Ranks: every rank, once, during ``configure_model``.
        """

    @hookspec(firstresult=True)
    def pipeline_blocks(self, config: Config) -> int | None:
        """How many blocks the model ``config`` describes cuts into (``pipeline_split``'s
        ``layers``), known from the config alone (hook API 1.13): a launcher then checks the
        split once for the job, before any rank starts.

        Args: ``config`` — the run's config (the provider's own options among it).
        May change: nothing.
        Returns: the number of blocks, or None when only the built model tells.
        Ranks: the launcher, and every rank before its run is built.
        """
