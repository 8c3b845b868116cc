"""The hooks ``coretrain checkpoint`` asks (its ``coretrain.hookspecs`` entry point): a format
plugin writes a checkpoint's weights (``export_model``, a spec of coretrain-plugins since hook API
1.10, in the core 1.1–1.9); a plugin that keeps checkpoints elsewhere lists them
(``describe_checkpoints``, since coretrain-plugins' hook API 1.13)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from coretrain import hookspec

if TYPE_CHECKING:
    from pathlib import Path

    import torch


class CheckpointSpecs(Protocol):
    """What ``coretrain checkpoint list | export`` asks of plugins."""

    @hookspec(firstresult=True)
    def export_model(
        self,
        state: dict[str, torch.Tensor],
        config: dict[str, Any],
        run_dir: Path,
        checkpoint: Path,
        export_format: str,
        to: Path,
        options: dict[str, Any],
    ) -> str | None:
        """Write a checkpoint's model weights in ``export_format`` (``coretrain checkpoint export
        --format NAME``): e.g. the ``hf`` provider writes a ``save_pretrained`` directory.

        Args: ``state`` — the full (unsharded) model state dict, keys as the provided model names
        them; ``config`` — the run's resolved config as plain data; ``run_dir`` — the run's output
        dir (files the plugin wrote there while training); ``checkpoint`` — the step directory the
        weights come from (hook API 1.4); ``to`` — the destination the user named;
        ``options`` — the command's flags (``merge_lora``, ``trust_remote_code``). Trust comes
        from ``options`` alone: ``config`` and ``run_dir`` were read from a directory, and a
        crafted one must run none of its code (``[tokenizer] trust_remote_code`` there is ignored).
        May change: nothing but ``to``.
        Returns: a one-line description of what was written, or None when this plugin does not
        write ``export_format`` (the first answer wins; none is an error naming the format).
        Ranks: one process, no run: the plugins of the run's saved config are loaded, not started.
        """

    @hookspec
    def describe_checkpoints(self, run_dir: Path) -> list[str] | None:
        """Lines ``coretrain checkpoint list RUN_DIR`` prints below its table: checkpoints of the
        run a plugin keeps outside ``checkpoints/`` on this host (``local-checkpoint``: the run's
        folder in ``local_dir``, left by a job that failed or is running).

        Args: ``run_dir`` — the run's output dir.
        May change: nothing.
        Returns: one line per place (collected from every plugin), or None.
        Ranks: one process, no run: the plugins of the run's config.toml are loaded, not started.
        """


ExportSpecs = CheckpointSpecs
"""Its name before it held ``describe_checkpoints``."""
