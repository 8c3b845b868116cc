"""The hooks ``coretrain predict`` asks (its ``coretrain.hookspecs`` entry point): a model
provider answers a batch (``predict_step``), a format plugin writes the records
(``write_predictions``). Specs of coretrain-plugins since hook API 1.10 (in the core 1.8–1.9)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from coretrain import hookspec

if TYPE_CHECKING:
    from pathlib import Path

    from coretrain import Run


class PredictSpecs(Protocol):
    """What ``coretrain predict`` asks of plugins."""

    @hookspec(firstresult=True)
    def predict_step(self, run: Run, batch: Any, options: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The model's predictions for one batch, one record per sample (``coretrain predict``;
        hook API 1.8).

        Args: ``batch`` — a collated batch of the split on this rank's device (with ``--data
        FILE``: ``{"prompt": [texts], "index": [their record numbers]}``); ``options`` — the
        command's generation options (``max_new_tokens``, ``temperature``, ``top_p``,
        ``do_sample``; None where not given).
        May change: nothing on ``run``; the model is in eval mode, gradients off.
        Returns: a list of JSON-able dicts, one per sample in batch order, or None when this
        plugin does not predict this batch (the first answer wins: the ``hf`` provider answers
        prompts with ``generate``; the built-in answer writes the model's outputs per sample, and
        continues prompts with any causal LM through ``Datasets.tokenizer``).
        Ranks: every rank, its own share of the samples.
        """

    @hookspec(firstresult=True)
    def predict_outputs(self, run: Run, batch: Any) -> tuple[Any, Any] | None:
        """The model's outputs for one batch, for a model that cannot be called on it whole (a
        spec of coretrain-plugins since hook API 1.11: a pipeline's stages).

        Args: ``batch`` — as ``predict_step`` gets it (not prompts).
        May change: nothing; the model is in eval mode, gradients off.
        Returns: (outputs, target or None) as ``coretrain.model_outputs`` gives them; on a rank
        whose part of the model produces no outputs (``run.reports_loss`` false: a pipeline's
        stages before the last), (None, target) — its records are not written. None leaves the
        forward to ``coretrain.model_outputs``.
        Ranks: every rank, for each batch (the stages of a pipeline run it together).
        """

    @hookspec(firstresult=True)
    def write_predictions(self, run: Run, records: list[dict[str, Any]], path: Path) -> str | None:
        """Write every sample's record to ``path`` (``coretrain predict --out PATH``; hook API 1.8).

        Args: ``records`` — all ranks' records gathered, in sample order, each with its
        ``index`` in the split.
        May change: nothing but ``path``.
        Returns: a one-line description of what was written, or None when this plugin does not
        write such a path (the built-in answer writes ``.jsonl`` and ``.parquet``).
        Ranks: rank 0 only, once.
        """
