"""The hook contract between the core loop and plugins.

One run, drawn as the loop calls it (``run`` is the :class:`coretrain.run.Run`)::

    provide_datasets(run, context)          firstresult   train/valid/test datasets
    provide_model(run)                      firstresult   the nn.Module (sees run.datasets)
    configure_model(run)                    each, ordered  replace run.model: FP8 (tryfirst),
                                                           compile, DDP/FSDP (trylast)
    param_group_overrides(run, model)       collected     per-parameter lr_mult / weight_decay
    [resume: on_resume(run, step, state) for each plugin, with the state it saved]
    on_train_start(run)
    loop:
        num_micro_batches(run, step, consumed_samples)     firstresult, batch-size rampup
        pre_step(run, step)
        for each micro-batch:  forward, loss, backward      # no hooks here
        before_update(run, step, loss)      veto point: run.control.skip_update(reason)
        clip, optimizer.step(), scheduler.step()           # unless any rank vetoed
        post_step(run, step, outputs)       outputs hold device tensors; no sync required
        every log_interval:   on_log(run, step, metrics)   ONE host sync per interval
        every eval_interval:  on_eval(run, step, metrics)
        checkpoint due?       on_checkpoint(run, step, path) -> this plugin's state
                              on_checkpoint_saved(run, step, path)  once committed (async: later)
        signal agreed?        on_signal(run, signum) -> checkpoint -> exit 128+signum
        exit condition?       train_iters | exit_interval | exit_duration_in_mins |
                              run.control.request_stop(reason)
    on_train_end(run, outcome)              always, on every plugin even if one raises; also after
                                            an error in restore (outcome "error") or a signal
                                            before the first step, without on_train_start

Rules every implementation can rely on:

- Calls are keyword-only; an implementation may accept any subset of a spec's arguments.
- A hook no enabled plugin implements costs nothing: the loop resolves, once, which hooks
  have implementations and never calls the others.
- Plugins ask the loop for things only through ``run.control`` (stop, checkpoint now, skip
  this update); they never raise to steer the loop or reach into its locals. Requests are
  agreed across ranks: an update is skipped if any rank vetoes it, a checkpoint saved if any
  rank asks, the largest exit code wins.
- A hook that raises ends the run: ``error: plugin 'NAME' failed in HOOK at step N``, exit 1,
  the traceback in ``<output_dir>/traceback.log``. Raise :class:`coretrain.errors.UserError`
  for a mistake the user can fix (exit 2, the message as is).
- ``wrapper=True`` implementations may wrap any hook (e.g. to time it).
- Per-step hooks (``pre_step``, ``before_update``, ``post_step``) must not force a host-device
  sync in the common case; do it every N steps or at ``on_log``. A value a plugin measures on
  the device goes into ``run.log_tensors[name]``: the next ``on_log`` reads it with the loop's
  own host sync and hands it over in ``metrics``.
- Logging backends (TensorBoard, Comet, MLflow, W&B) subclass
  :class:`coretrain.backend.LoggingBackend`: their hooks run ``trylast`` (they record what every
  other plugin added), only on rank 0, and close on every way a run ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from coretrain.run import DatasetContext, Datasets, Run, StepOutputs

PROJECT = "coretrain"
hookspec = pluggy.HookspecMarker(PROJECT)


# --------------------------------------------------------------------------- providers


@hookspec(firstresult=True)
def provide_datasets(run: Run, context: DatasetContext) -> Datasets | None:
    """Build the train/valid/test datasets (Megatron's ``build_datasets(context)``).

    Called on the provider named by ``data.provider`` with its ``[data.options]`` as the
    plugin's config. A split is map-style (``__len__`` + ``__getitem__``, or a
    ``get_batch(indices)`` fast path fetching a whole micro-batch at once), a Hugging Face
    ``datasets.Dataset``, or a stream (an ``IterableDataset``); see README, "Bring your own
    model and data".
    """


@hookspec(firstresult=True)
def provide_model(run: Run) -> torch.nn.Module | None:
    """Build the model on CPU; the loop moves it to the run's device.

    Called after datasets, so ``run.datasets`` (vocab size, sequence length) may set defaults.
    ``model(*batch)`` (or ``model(**batch)`` for dict batches) returns the scalar loss, a dict
    or object with ``loss`` and other scalars to log, or — with ``model.loss`` set — outputs
    the configured loss turns into the loss (:mod:`coretrain.outputs`). A
    ``flops_per_token()`` method, when present, feeds throughput and MFU; otherwise the
    FLOPs are counted once (:mod:`coretrain.flops`).
    """


@hookspec
def configure_model(run: Run) -> None:
    """Replace ``run.model`` with a converted or wrapped one, in order.

    Order by pluggy's markers: ``tryfirst`` for numerics that change modules (FP8), plain
    for compilation, ``trylast`` for parallel wrappers (DDP, FSDP2) that must see the result.
    """


@hookspec
def param_group_overrides(run: Run, model: torch.nn.Module) -> dict[str, dict[str, float]] | None:
    """Map parameter names to optimizer overrides (``lr_mult``, ``weight_decay``, ...).

    Results from all plugins are merged (later plugins win per key); the core builds one
    param group per distinct set of overrides.
    """


@hookspec(firstresult=True)
def num_micro_batches(run: Run, step: int, consumed_samples: int) -> int | None:
    """Micro-batches (per data-parallel rank) for this step; None keeps the configured value."""


# --------------------------------------------------------------------------- lifecycle


@hookspec
def on_train_start(run: Run) -> None:
    """Everything is built and (if resuming) restored; the first step is next."""


@hookspec
def pre_step(run: Run, step: int) -> None:
    """Before the first micro-batch of ``step`` (1-based)."""


@hookspec
def before_update(run: Run, step: int, loss: torch.Tensor) -> None:
    """Gradients are ready; call ``run.control.skip_update(reason)`` to veto this update.

    ``loss`` is the step's mean loss over micro-batches, on device (reading it syncs).
    """


@hookspec
def post_step(run: Run, step: int, outputs: StepOutputs) -> None:
    """After the update (or its veto). ``outputs`` hold device tensors: don't sync each step."""


@hookspec
def on_log(run: Run, step: int, metrics: dict[str, float]) -> None:
    """Every ``train.log_interval`` steps with host floats (one device sync per interval).

    ``tryfirst`` implementations may add entries to ``metrics`` (e.g. straggler scores);
    the ones that record or display metrics see them.
    """


@hookspec
def on_eval(run: Run, step: int, metrics: dict[str, float]) -> None:
    """After an evaluation pass of one split: ``valid/...`` during and after training,
    ``test/...`` once after it (loss, the model's named values, ppl for token losses)."""


@hookspec
def on_checkpoint(run: Run, step: int, path: str) -> dict[str, Any] | None:
    """A checkpoint of ``step`` is being written to ``path``.

    Return this plugin's own state (tensors, numbers, str, bool, None, lists and dicts of
    these; anything else stops the run naming the plugin): it is saved under the plugin's
    name and handed back to :func:`on_resume`.
    """


@hookspec
def on_checkpoint_saved(run: Run, step: int, path: str) -> None:
    """The checkpoint of ``step`` is durable and committed at ``path``.

    Called on the training thread: right after a synchronous save, or at the first step
    boundary after an asynchronous save finished.
    """


@hookspec
def on_resume(run: Run, step: int, state: dict[str, Any]) -> None:
    """The run resumed from ``step``; ``state`` is what this plugin returned from on_checkpoint."""


@hookspec
def on_signal(run: Run, signum: int) -> None:
    """All ranks agreed that ``signum`` arrived; a checkpoint and exit(128+signum) follow."""


@hookspec
def on_train_end(run: Run, outcome: str) -> None:
    """Always called once: outcome is "completed", "exit_interval", "exit_duration",
    "stopped" (a plugin's request), "signal" or "error". Flush and close here.

    Also called when ``on_train_start`` was not (restore failed, or a signal arrived before
    the first step), and on every plugin even when another one's raises."""
