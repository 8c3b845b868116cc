"""The hook contract between the core loop and plugins.

One run, drawn as the loop calls it (``run`` is the :class:`coretrain.Run`)::

    check_layout(config, world_size)        each          the layout fits the ranks (also in the launcher)
    join_process_group(config)              each          before the core forms the process group
                                                           (a replacement joins its survivors')
    configure_run(run)                      each          the run exists, nothing built: log files
    provide_datasets(run, context)          firstresult   train/valid/test datasets
    configure_datasets(run)                 each          wrap run.datasets' splits (hf-datasets)
    read_stream(run, dataset, ...)          firstresult   the loader of a stream split (streams)
    on_datasets(run)                        each          check or inspect run.datasets (data-checks)
    provide_model(run)                      firstresult   the nn.Module (sees run.datasets)
    configure_model(run)                    each, ordered  replace run.model: FP8 (tryfirst),
                                                           tensor parallel, compile, DDP/FSDP (trylast)
    param_group_overrides(run, model)       collected     per-parameter lr_mult / weight_decay
    configure_optimizer(run)                each          replace run.optimizer (master weights)
    configure_scheduler(run)                firstresult   the lr schedule (the schedule plugin)
    [resume: on_resume(run, step, state) for each plugin, with the state it saved]
    [or checkpoint.pretrained: read_pretrained(run, path)  firstresult  a file in another format]
    phase_listener(run)                     collected     marks: listener(step, phase) at every
                                                           phase boundary from here on
    on_train_start(run)
    loop:
        num_micro_batches(run, step, consumed_samples)     firstresult, batch-size rampup
        pre_step(run, step)                 may veto the step: run.control.skip_update(reason)
                                            draws its batch and runs nothing (agreed as below)
        for each micro-batch:  forward, loss, backward      # no hooks here, unless
        forward_backward(run, batches)      firstresult   runs them all (a pipeline schedule)
        before_update(run, step, loss)      veto point: run.control.skip_update(reason), by a
                                            plugin with coretrain_vetoes_updates = True
        clip, optimizer.step(), scheduler.step()           # unless any rank vetoed;
        clip_gradients(run, parameters, max_norm)  firstresult  the norm over every stage
        post_step(run, step, outputs)       outputs hold device tensors; no sync required
        every log_interval:   on_log(run, step, metrics)   ONE host sync per interval
        every eval_interval:  evaluate(run, split, dataset)  firstresult   the metrics (evaluation)
                              on_eval(run, step, metrics)
        checkpoint due?       checkpoint_target(run)  firstresult  where a non-persistent one goes
                              on_checkpoint(run, step, path) -> this plugin's state
                              on_checkpoint_saved(run, step, path)  once committed (async: later)
                              protected_checkpoints(run, root)  collected  what retention keeps
        signal agreed?        on_signal(run, signum) -> checkpoint -> exit 128+signum
        exit condition?       train_iters | exit_interval | exit_duration_in_mins |
                              run.control.request_stop(reason)
    explain_failure(run, error)             firstresult   an exception that ends the run, told in
                                                           one line (out-of-memory: the sizes)
    on_train_end(run, outcome)              always, on every plugin even if one raises; also after
                                            an error in restore (outcome "error") or a signal
                                            before the first step, without on_train_start
    close_run(run)                          always, on every plugin even if one raises, once
                                            per configure_run: also after a build that failed
                                            (a refused resume, a provider's error): undo it
    restart_in_process(run, error)          firstresult   after a failure, the process group
                                            left: True = build, resume and train again here

Rules every implementation can rely on:

- Calls are keyword-only; an implementation may accept any subset of a spec's arguments.
- A hook no enabled plugin implements costs nothing: the loop resolves, once, which hooks
  have implementations and never calls the others.
- Plugins ask the loop for things only through ``run.control`` (stop, checkpoint now, skip
  this update); they never raise to steer the loop or reach into its locals. Requests are
  agreed across ranks: an update is skipped if any rank vetoes it (a plugin that may veto
  declares ``coretrain_vetoes_updates = True``; only then do the ranks agree every step), a
  checkpoint saved if any rank asks, the largest exit code wins. A stop or checkpoint asked
  for at step N is honoured after step N on one rank, after N+1 on several (agreed without
  blocking), after N when N is a save step, an evaluation step or the last (so a decision
  taken in ``on_eval`` acts at the same step on every rank). A stop asked for in ``on_resume``
  ends the run before its first step.
- A hook that raises ends the run: ``error: plugin 'NAME' failed in HOOK at step N``, exit 1,
  the traceback in ``<output_dir>/traceback.log``. Raise :class:`coretrain.UserError`
  for a mistake the user can fix (exit 2, the message as is).
- ``wrapper=True`` implementations (pluggy's new-style wrappers) may wrap any hook, e.g. to
  time it. ``on_checkpoint``, ``on_resume`` and ``on_train_end`` are called plugin by plugin
  (their results and failures belong to one plugin): a wrapper wraps each of those calls.
- Every spec below says, in the same order: its arguments, what an implementation may
  change, what it returns, on which ranks it runs, and whether it runs every step.
- Per-step hooks (``pre_step``, ``before_update``, ``post_step``) must not force a host-device
  sync in the common case; do it every N steps or at ``on_log``. A value a plugin measures on
  the device goes into ``run.log_tensors[name]``: the next ``on_log`` reads it with the loop's
  own host sync and hands it over in ``metrics``.
- Logging backends (TensorBoard, Comet, MLflow, W&B) subclass
  :class:`coretrain_backends.LoggingBackend` (coretrain-plugins): their hooks run ``trylast`` (they record what every
  other plugin added), only on rank 0, and close on every way a run ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol

from coretrain.markers import hookspec

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import torch

    from coretrain.config import Config
    from coretrain.run import DatasetContext, Datasets, Run, Scheduler, StepOutputs


HOOK_API = (1, 15)
"""The version of this contract, (major, minor). A minor release adds hooks or arguments; a
major one changes or removes them. A plugin class may set ``coretrain_hook_api = (1, 0)`` (the
version it was written for): a plugin written for another major, or for a newer minor, is
refused with one error naming it. A hook or argument that is to change or go is first marked in
its spec with pluggy's ``warn_on_impl`` (``warn_on_impl_args``), naming its replacement, for at
least one minor before the major that changes it. CHANGELOG.md lists what each minor added and
the release that ships it."""

Outcome = Literal["completed", "exit_interval", "exit_duration", "stopped", "signal", "error"]
"""How a run ended, as ``on_train_end`` is told."""


class HookSpecs(Protocol):
    """Every hook, written once: pluggy reads the specs from this class (``add_hookspecs``), the
    core calls plugins through it (``Plugins.hook`` is typed as this class, so mypy checks every
    call's arguments and result), and tests/test_contract.py checks each first-party
    implementation's annotations against it. Hooks marked "collected" return one value per
    plugin; the core calls those through :class:`coretrain.hookcalls.HookCalls`."""

    # --------------------------------------------------------------------------- providers

    @hookspec
    def check_layout(self, config: Config, world_size: int, hooks: Any) -> None:
        """Refuse a layout this plugin cannot run, from the config and the number of ranks alone
        (hook API 1.13): a pipeline split the model's blocks cannot take, more tensor-parallel
        ranks than heads. ``coretrain run --nproc-per-node`` asks it once for the job, before
        any rank starts (one error line, not one per rank); every run asks it again.

        Args: ``config`` — the run's config; ``world_size`` — the ranks the job will have;
        ``hooks`` — every plugin's hooks (``hooks.NAME(...)``), to ask another what it knows
        from the config (the pipeline asks the model provider how many blocks it cuts).
        May change: nothing; raise :class:`coretrain.UserError` naming the keys to change.
        Returns: nothing.
        Ranks: the launcher (no process group), and every rank before the run is built.
        """

    @hookspec
    def join_process_group(self, config: Config) -> None:
        """A run is being built and the core is about to form the process group (torchrun's
        ``env://`` rendezvous), unless one is formed by then (hook API 1.12): form it another way.

        Args: ``config`` — the run's config.
        May change: the process group (``torch.distributed.init_process_group``): a process that
        replaces one that died joins the group its surviving peers re-form (``inprocess-restart``).
        Returns: nothing.
        Ranks: every rank, at every build (also after an in-process restart, the group formed
        then); before anything else of the run exists. Not every step.
        """

    @hookspec
    def configure_run(self, run: Run) -> None:
        """The run exists and nothing is built yet: set up what the whole run needs first (hook API 1.10).

        Args: ``run`` — its config, ``run.dist``, ``run.device`` and ``run.output_dir`` (not
        necessarily created yet); no datasets, model or optimizer.
        May change: process-wide settings this plugin owns (log handlers: the ``console-log``
        plugin routes libraries' lines to ``run.log`` from here on).
        Returns: nothing.
        Ranks: every rank, once, before ``provide_datasets``; not for a run only built to be
        checked (``coretrain config validate``, ``coretrain.prepare``).
        """

    @hookspec(firstresult=True)
    def provide_datasets(self, run: Run, context: DatasetContext) -> Datasets | None:
        """Build the train/valid/test datasets (Megatron's ``build_datasets(context)``).

        Args: ``run`` — config, dist, device and output_dir are set; datasets, model and optimizer
        are not built yet (reading them raises). ``context`` — samples each split will need and the
        seed.
        May change: nothing on ``run``.
        Returns: :class:`coretrain.Datasets`; the first non-None answer wins. Called on the provider
        named by ``data.provider`` with its ``[data.options]`` as the plugin's config. A split is
        map-style (``__len__`` + ``__getitem__``, or a ``get_batch(indices)`` fast path fetching a
        whole micro-batch at once), a Hugging Face ``datasets.Dataset`` (read by the batch by the
        built-in ``hf-datasets``), or a stream (an ``IterableDataset``); what it returns is checked
        before step 1 (docs/guides/your-model-and-data.md).
        Ranks: every rank, once, before training.
        """

    @hookspec
    def configure_datasets(self, run: Run) -> None:
        """The datasets are built: wrap or replace their splits before they are checked and read
        (hook API 1.11) — an adapter for a library's dataset type (coretrain-plugins'
        ``hf-datasets`` reads a Hugging Face dataset one Arrow slice per micro-batch), sequence
        packing, a filter.

        Args: ``run`` — ``run.datasets`` is set, ``data.collate_fn`` resolved.
        May change: ``run.datasets`` (its splits, ``collate_fn``); the result is checked as the
        provider's is. Returns: nothing.
        Ranks: every rank, once, before training (``coretrain config validate`` too).
        """

    @hookspec
    def on_datasets(self, run: Run) -> None:
        """The datasets are built: check or inspect them before anything reads them (hook API 1.4).

        Args: ``run`` — ``run.datasets`` is set (``configure_datasets`` has run,
        ``data.collate_fn`` is resolved); the model is not built yet.
        May change: plugin-owned state only; raise :class:`coretrain.UserError` to refuse the
        datasets (``coretrain config validate`` runs this too, and nothing is written).
        Returns: nothing.
        Ranks: every rank, once, before training; the random streams are put back afterwards,
        so samples read here (a random augmentation, a stream) leave the model's initialization
        as it would be without the plugin.
        """

    @hookspec(firstresult=True)
    def read_stream(self, run: Run, dataset: Any, micro_batch_size: int, training: bool) -> Any | None:
        """A loader of this rank's micro-batches of a stream split (hook API 1.11): a split that is
        iterated, not indexed, has no sample order for the core to deal out.

        Args: ``dataset`` — the stream; ``micro_batch_size``; ``training`` — the train split (read
        step by step across passes, checkpointed: the loader has ``state_dict()`` and
        ``load_state_dict()``, a partial last batch is dropped) or an evaluation's pass (from
        the start, the partial last batch kept).
        May change: nothing on ``run``.
        Returns: an iterable of collated micro-batches (on the host; iterating it again starts
        another pass); the first non-None answer wins (coretrain-plugins' ``streams`` answers
        last: every rank takes every (ranks × workers)-th item).
        Ranks: every rank, when the loop or an evaluation first reads the split.
        """

    @hookspec(firstresult=True)
    def provide_model(self, run: Run) -> torch.nn.Module | None:
        """Build the model on CPU; the loop moves it to the run's device.

        Args: ``run`` — as for provide_datasets, plus ``run.datasets`` (vocab size, sequence
        length may set defaults).
        May change: nothing on ``run``.
        Returns: the ``nn.Module``; the first non-None answer wins. ``model(*batch)`` (or
        ``model(**batch)`` for dict batches) returns the scalar loss, a dict or object with
        ``loss`` and other scalars to log, or — with ``model.loss`` set — outputs the configured
        loss turns into the loss (:mod:`coretrain.outputs`). A ``flops_per_token()`` method, when
        present, feeds throughput and MFU; otherwise the ``timers`` plugin counts the FLOPs once.
        Ranks: every rank, once, before training; seeded identically on every rank.
        """

    @hookspec
    def configure_model(self, run: Run) -> None:
        """Convert or wrap the model.

        Args: ``run`` — ``run.model`` is on the device; optimizer and scheduler are not built yet.
        May change: ``run.model`` (assign the converted or wrapped module). Order by pluggy's
        markers: ``tryfirst`` for numerics that change modules (FP8), plain for compilation,
        ``trylast`` for parallel wrappers (DDP, FSDP2) that must see the result.
        Returns: nothing.
        Ranks: every rank, once, before training; every rank must wrap the same way.
        """

    @hookspec
    def param_group_overrides(self, run: Run, model: torch.nn.Module) -> dict[str, dict[str, float]] | None:
        """Per-parameter optimizer settings.

        Args: ``run``; ``model`` — the configured model, whose ``named_parameters()`` names the keys.
        May change: nothing.
        Returns: parameter name -> overrides (``lr_mult``, ``weight_decay``, ``lr``, ...), or None.
        Results from all plugins are merged (later plugins win per key); the core builds one
        param group per distinct set of overrides.
        Ranks: every rank, once, before the optimizer is built.
        """

    @hookspec
    def configure_optimizer(self, run: Run) -> None:
        """Convert or wrap the optimizer (an fp32 master copy of low-precision weights).

        Args: ``run`` — ``run.optimizer`` is built on the configured model's parameters, with the
        param-group overrides; the schedule is not built yet (it is built on what this leaves).
        May change: ``run.optimizer`` (its ``state_dict`` is what checkpoints hold); with
        ``run.precision = "fp16"``, ``run.grad_scaler`` (1.14: a ``torch.amp.GradScaler`` of the
        plugin's, e.g. Megatron's with hysteresis; unset: torch's).
        Returns: nothing.
        Ranks: every rank, once, before training (and before a resume loads the optimizer state).
        """

    @hookspec(firstresult=True)
    def configure_scheduler(self, run: Run) -> Scheduler | None:
        """The learning-rate (and weight-decay) schedule (hook API 1.10).

        Args: ``run`` — ``run.optimizer`` is final (after ``configure_optimizer``); ``run.train_iters``
        and ``run.global_batch_size`` size the run.
        May change: the optimizer's param groups (the rates of the first update).
        Returns: an object with ``step(samples)`` (called after each update that was not vetoed,
        with its samples), ``state_dict()`` and ``load_state_dict(state)`` (checkpointed by the
        core), or None when this plugin does not schedule; the first answer wins (the ``schedule``
        plugin answers with Megatron's schedule). None from every plugin: ``optimizer.lr`` throughout.
        Ranks: every rank, once, before training (and before a resume restores its state).
        """

    @hookspec(firstresult=True)
    def num_micro_batches(self, run: Run, step: int, consumed_samples: int) -> int | None:
        """Micro-batches per data-parallel rank for ``step`` (batch-size rampup).

        Args: ``step`` — 1-based; ``consumed_samples`` — samples consumed before this step.
        May change: nothing. It is asked ahead of the step (data workers plan their batches), so it
        must be a pure function of its arguments and the config.
        Returns: a positive int, or None to keep the configured value; the first answer wins.
        Ranks: every rank, with the same answer. Per step: yes, host arithmetic only.
        """

    # --------------------------------------------------------------------------- lifecycle

    @hookspec
    def phase_listener(self, run: Run) -> Callable[[int, str], None] | None:
        """A function the loop calls at each phase boundary, ``listener(step, phase)``: how the
        watchdog sees where a rank is, and how timers measure where a step's time goes.

        Args: ``run`` — built, not yet restored.
        Phases (:mod:`coretrain.phases`): ``restore`` (step = the checkpoint's, 0 when
        fresh; covers restore and on_train_start); per step ``pre_step`` (when a plugin implements
        it), ``data``, ``forward_backward``, ``update``, ``post_step``, then ``log``, ``eval``,
        ``checkpoint`` when they happen, and ``agreement`` while the ranks agree on stopping (on
        several ranks); ``end`` once, before on_train_end. A phase lasts until the next mark.
        May change: nothing; the listener runs on the training thread.
        Returns: the listener (a callable), or None.
        Ranks: every rank, once, before restore. Per step: the listener is called 4 to 7 times per
        step — keep it to a few attribute writes or a clock read; never a device sync.
        """

    @hookspec
    def on_train_start(self, run: Run) -> None:
        """Everything is built and, if resuming, restored; step ``run.state.step + 1`` is next.

        Args: ``run`` — complete: model, optimizer, scheduler, datasets.
        May change: plugin-owned state; open files and connections here, not in ``__init__``.
        Returns: nothing.
        Ranks: every rank, once (not at all if a signal or a failed restore ends the run first).
        """

    @hookspec
    def pre_step(self, run: Run, step: int) -> None:
        """Before the first micro-batch of ``step``.

        Args: ``step`` — 1-based, the step about to run.
        May change: plugin-owned state; ``run.control`` requests; ``run.control.skip_update(reason)``
        here skips the whole step (hook API 1.7): its batch is drawn, so the data order holds,
        but no forward, backward or update runs (Megatron's ``iterations_to_skip``), and it
        counts as a skipped update. Agreed across ranks as ``before_update``'s veto.
        Returns: nothing.
        Ranks: every rank. Per step: yes — no host-device sync.
        """

    @hookspec(firstresult=True)
    def forward_backward(self, run: Run, batches: list[Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """Run the step's forward and backward passes yourself (hook API 1.11): a pipeline
        schedule, whose stages each hold a part of the model, does so for all its micro-batches.

        Args: ``batches`` — this rank's micro-batches of the step, on the run's device.
        May change: gradients (accumulated as the core's own loop would: the step's mean over
        micro-batches); ``run.reports_loss`` is false on a rank whose part computes no loss.
        Returns: (the step's mean loss, the model's named scalar values), device tensors; on a
        rank that reports no loss, any finite placeholder (it is not logged); None to leave the
        step to the core.
        Ranks: every rank. Per step: yes — no host-device sync.
        """

    @hookspec(firstresult=True)
    def clip_gradients(self, run: Run, parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor | None:
        """Clip the gradients to a global norm of ``max_norm`` yourself (hook API 1.11): the norm
        over every pipeline stage, each rank holding the parameters of its own.

        Args: ``parameters`` — this rank's trainable parameters; ``max_norm`` — ``train.clip_grad``.
        May change: gradients, in place.
        Returns: the global norm before clipping (a device scalar, the same on every rank), or
        None to leave clipping to the core (``coretrain.gradient_norm`` and ``coretrain.clip_to``).
        Ranks: every rank, each step that updates with clipping on.
        """

    @hookspec
    def before_update(self, run: Run, step: int, loss: torch.Tensor) -> None:
        """Gradients are ready; the optimizer has not stepped.

        Args: ``loss`` — the step's mean loss over micro-batches, a device tensor (reading it
        syncs).
        May change: gradients (``p.grad``, in place); ``run.control.skip_update(reason)`` vetoes
        this update — on every rank when any rank vetoes; ``skip_update(reason, rerun=True)``
        (1.14) runs the step's forward and backward again on the same batches, the gradients
        dropped, and calls this hook again with the new loss (Megatron's rerun). The ranks agree with one blocking
        collective per step, paid only while an enabled plugin declares the class attribute
        ``coretrain_vetoes_updates = True``; an undeclared veto on several ranks stops the run
        (exit 1) naming the attribute, since the ranks could not have agreed on it.
        Returns: nothing.
        Ranks: every rank. Per step: yes — a sync here costs every step; guards that must read
        the loss do so knowingly.
        """

    @hookspec
    def post_step(self, run: Run, step: int, outputs: StepOutputs) -> None:
        """After the update (or its veto); ``run.state`` already counts this step.

        Args: ``outputs`` — the step's loss (NaN when ``pre_step`` skipped the step), grad norm
        (None when not clipped or skipped), whether the update was skipped and the global batch
        size; device tensors.
        May change: plugin-owned state; ``run.log_tensors[name]`` (a device scalar for the next
        ``on_log``); ``run.control`` requests (stop, checkpoint), honoured at the end of this step
        on one rank and of the next on several (agreed without blocking; at once on a save,
        evaluation or the last step).
        Returns: nothing.
        Ranks: every rank. Per step: yes — don't read ``outputs`` on the host every step.
        """

    @hookspec
    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        """Every ``train.log_interval`` steps: the interval's metrics as host floats.

        Args: ``metrics`` — loss, lr, grad_norm, the run's counters (``consumed_samples``,
        ``global_batch_size``), the model's ``train/*`` values and ``run.log_tensors``
        entries, averaged over the interval and over ranks (one device sync per interval, the
        loop's). Loss, grad norm and ``train/*`` are means over the steps that updated
        (absent when none did); ``skipped_steps`` counts the interval's others,
        ``skipped_updates`` all so far.
        May change: ``metrics`` — ``tryfirst`` implementations may add entries that the ones
        recording or displaying metrics see (the built-in ``timers`` adds the rates —
        ``iteration_time``, ``samples_per_second``, ``tokens_per_second`` —, ``time/*``, per-device
        throughput, TFLOP/s, MFU and memory; ``stragglers`` its scores).
        Returns: nothing.
        Ranks: every rank, the same values; loggers write on rank 0 only.
        """

    @hookspec(firstresult=True)
    def evaluate(self, run: Run, split: str, dataset: Any) -> dict[str, float] | None:
        """Evaluate the model on one split (hook API 1.5; the built-in ``evaluation`` answers last).

        Args: ``split`` — ``"valid"`` at the eval steps and after training, ``"test"`` once after
        it; ``"valid/NAME"`` / ``"test/NAME"`` once per set when the provider named several
        (hook API 1.8); ``dataset`` — that split (or set) of ``run.datasets`` (never None here).
        May change: nothing on ``run``; leave the model in the mode it came in.
        Returns: ``{"<split>/NAME": value}`` (``valid/loss``, ``valid/wiki/loss``), the same on
        every rank; the first non-None answer
        wins; None (from every plugin) means the split is not evaluated now.
        Ranks: every rank, at the same steps: collectives are allowed.
        """

    @hookspec
    def on_eval(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        """After an evaluation pass of one split (every named set of it together).

        Args: ``metrics`` — ``valid/...`` during and after training, ``test/...`` once after it
        (loss, the model's named values, ppl for token losses; ``valid/NAME/...`` per named
        set), averaged over ranks.
        May change: ``metrics`` (``tryfirst`` implementations, as for on_log); ``run.control``
        requests (stop, checkpoint), honoured at this step on every rank (``early-stopping``).
        Returns: nothing.
        Ranks: every rank, the same values. The model is back in train mode.
        """

    @hookspec
    def on_checkpoint(self, run: Run, step: int, path: str) -> dict[str, Any] | None:
        """A checkpoint of ``step`` is being written to ``path`` (not yet committed).

        May change: nothing the checkpoint holds (model, optimizer) — it is being copied.
        Returns: this plugin's own state — tensors, numbers, str, bool, None, lists and dicts of
        these; anything else stops the run naming the plugin, before anything reaches the disk. It
        is saved under the plugin's name, per rank, and handed back to :func:`on_resume`. A plugin
        may declare what it looks like as the class attribute ``coretrain_state = AttrsClass`` (hook
        API 1.9): a
        resume then checks the saved state against it as strictly as a config table (types,
        missing or unknown keys, the class's validators; no NaN) and treats a state that does not
        fit as a damaged file, named with its key path — an automatic resume falls back past it.
        Ranks: every rank (each saves its own state). Called plugin by plugin.
        """

    @hookspec(firstresult=True)
    def checkpoint_target(self, run: Run) -> str | None:
        """Where this rank's checkpoints requested with ``run.control.request_checkpoint(
        persistent=False)`` go (hook API 1.15; ``local-checkpoint``'s folder in host memory).

        Returns: a directory (absolute) of this plugin's own, or None. A save goes there when
        every request for it allowed it and nothing else (the cadence, the end, a stop) is due
        at that step: written at once, only the newest kept, and skipped on every rank (with a
        warning) when any rank cannot write it, since the durable checkpoints still protect the
        run. A resume takes the newest complete step of it and ``checkpoints/``. None: such
        requests save to ``checkpoints/``.
        Ranks: every rank (each its own directory), at each save that may go there and at resume.
        """

    @hookspec
    def protected_checkpoints(self, run: Run, root: Path) -> list[int] | None:
        """Steps under ``root`` that retention (``checkpoint.keep_last``) must not delete (hook API
        1.15; ``keep-best``'s best step).

        Args: ``root`` — the directory of step directories being pruned (``checkpoints/``).
        May change: nothing.
        Returns: step numbers, or None. Collected: every plugin's steps are kept.
        Ranks: rank 0, on the training thread: as each save into ``checkpoints/`` begins (its commit,
        later for an async save, keeps them) and after the final save.
        """

    @hookspec
    def on_checkpoint_saved(self, run: Run, step: int, path: str) -> None:
        """The checkpoint of ``step`` is durable and committed at ``path``.

        May change: plugin-owned state (e.g. upload the directory, prune elsewhere).
        Returns: nothing.
        Ranks: every rank, on the training thread: right after a synchronous save, or at the first
        step boundary after an asynchronous save finished.
        """

    @hookspec
    def check_resume(self, run: Run, manifest: dict[str, Any], path: Path) -> None:
        """A checkpoint is about to be resumed: refuse it before anything of the run changes
        (hook API 1.11) — the built-in ``resume-checks`` refuses a changed seed, model or dataset.

        Args: ``manifest`` — the checkpoint's ``manifest.json`` (``config`` as it was saved,
        ``step``, ``world_size``, ...); ``path`` — its directory.
        May change: nothing; raise :class:`coretrain.UserError` to refuse (exit 2, nothing written).
        Returns: nothing.
        Ranks: every rank, once, on resume (not for ``checkpoint.pretrained``).
        """

    @hookspec(firstresult=True)
    def read_pretrained(self, run: Run, path: Path) -> dict[str, Any] | None:
        """The weights in ``checkpoint.pretrained``'s file when it is in a format this plugin
        reads (hook API 1.15): ``safetensors`` reads such files on any torch and under any name,
        ``script-weights`` a training script's ``torch.save`` (nanoGPT's ``ckpt.pt``).

        Args: ``path`` — the file or directory named (a link such as ``latest`` followed).
        May change: nothing. The file is another program's: read it without running code from it.
        Returns: the state dict (parameter name -> tensor), or None: not this plugin's format
        (coretrain's checkpoints and torch's own files are the core's). Checked as any pretrained
        weights are: the names and shapes must fit the model.
        Ranks: every rank, once, at a start that does not resume.
        """

    @hookspec
    def on_resume(self, run: Run, step: int, state: dict[str, Any]) -> None:
        """The run resumed from ``step``, before ``on_train_start``.

        Args: ``state`` — what this plugin returned from on_checkpoint on this rank ({} when it
        saved nothing, e.g. it was not enabled then), checked against ``coretrain_state`` when the
        plugin declares one.
        May change: plugin-owned state; ``run.control.request_stop`` ends the run before its
        first step (a run that had already stopped, resubmitted).
        Returns: nothing.
        Ranks: every rank, once. Called plugin by plugin.
        """

    @hookspec
    def on_signal(self, run: Run, signum: int) -> None:
        """All ranks agreed that ``signum`` arrived; a checkpoint and exit(128+signum) follow.

        May change: plugin-owned state (note why the run stops).
        Returns: nothing.
        Ranks: every rank, at the same step, once.
        """

    @hookspec(firstresult=True)
    def explain_failure(self, run: Run, error: BaseException) -> str | None:
        """An exception from the model, the data or torch is ending the run: say what it means in
        one line (hook API 1.11) — the built-in ``out-of-memory`` names the sizes that decide memory.

        Args: ``error`` — what was raised (not a plugin's own failure nor a ``UserError``).
        May change: nothing.
        Returns: the line (the run then fails with it, exit 1, the exception kept as its cause
        in the traceback file), or None for an exception this plugin does not know.
        Ranks: the rank that raised it, once, before ``on_train_end``.
        """

    @hookspec(firstresult=True)
    def restart_in_process(self, run: Run | None, error: BaseException) -> bool | None:
        """The run failed — on this rank, or as a peer's failure seen here (a collective whose
        peer left) — and the process group has been left (hook API 1.12): train again in this
        process instead of ending it (the ``inprocess-restart`` plugin).

        Args: ``run`` — the failed run (None when building it failed); ``error`` — what was raised.
        May change: the process group: form the next one (``torch.distributed.init_process_group``
        through the launcher's store) before returning True; the core then builds the run again
        (imports, and everything a process keeps, stay) and resumes it from the newest checkpoint.
        Returns: True to train again; None to let the failure end the process.
        Ranks: every rank that failed; the ranks must answer alike (a peer of a failing rank
        fails at its next collective, so every rank is asked once per failure).
        """

    @hookspec
    def on_train_end(self, run: Run, outcome: Outcome) -> None:
        """The run is over: flush and close here.

        Args: ``outcome`` — "completed", "exit_interval", "exit_duration", "stopped" (a plugin's
        request), "signal" or "error".
        May change: plugin-owned state only; nothing the loop does after this. Keep nothing
        that holds the run (the run, its model, an object made with it) past this: after an
        in-process restart the next run is built while this one must already be freed.
        Returns: nothing; a raise is reported after every other plugin's on_train_end ran.
        Ranks: every rank, exactly once, on every way a run ends — also when ``on_train_start``
        was not called (restore failed, or a signal arrived before the first step). Called plugin
        by plugin, so one plugin's failure does not skip another's.
        """

    @hookspec
    def close_run(self, run: Run) -> None:
        """The run is let go, however far it got: undo what ``configure_run`` changed in the
        process (hook API 1.13) — environment variables, torch's global modes, log handlers — so
        that the next run in this process (a notebook's, a test's) starts as the first did.

        Args: ``run`` — as ``configure_run`` saw it, plus whatever was built before the end (a
        build that failed has no model or optimizer).
        May change: process-wide settings this plugin changed; plugin-owned state.
        Returns: nothing; a raise is reported after every other plugin's close_run ran.
        Ranks: every rank, once for each ``configure_run``: after ``on_train_end``, and also when
        the build failed once ``configure_run`` had been called (a provider's error, a refused
        resume, Ctrl-C in start-up) — then without ``on_train_end``. Also for a plugin whose own
        ``configure_run`` did not run because another's raised first: undo only what was done.
        Called plugin by plugin, so one plugin's failure does not skip another's.
        """
