"""Building a run from a config, in the order the hook contract documents: import-path
providers, device, process group, seeds, output dir lock, datasets (checked), model (checked,
moved to the device, ``configure_model`` wrappers), optimizer with param-group overrides, LR
schedule, and the resolved config.toml."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from attrs import define

from coretrain.cadence import Cadence
from coretrain.checkpoint.state import keeping_rng
from coretrain.config import Config, micro_batches_per_step
from coretrain.configload import config_as_dict, toml_text
from coretrain.dist import init_distributed
from coretrain.errors import UserError
from coretrain.loader import is_stream
from coretrain.markers import hookimpl
from coretrain.optim import build_optimizer
from coretrain.outputs import resolve_loss
from coretrain.pluginmanager import Plugins, hook_calls, is_import_path
from coretrain.providerchecks import check_datasets, check_model
from coretrain.run import DatasetContext, Datasets, Run, Scheduler, Unscheduled
from coretrain.rundir import RECORDED_CONFIG, RECORDED_HEADER, OutputDirLock, check_shared
from coretrain.signals import SignalWatcher
from coretrain.usercode import call_with, check_options, import_callable

log = logging.getLogger("coretrain")


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device: 'cuda' requested but torch sees no CUDA device; use 'auto' or 'cpu'")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# --------------------------------------------------------------------------- import-path providers


@define
class ImportedModelProvider:
    """Adapter: ``model.provider = "pkg.mod:fn"`` -> ``fn(**model.options)`` as a provide_model hook."""

    fn: Any
    options: dict[str, Any]

    @hookimpl
    def provide_model(self, run: Run) -> torch.nn.Module | None:
        return cast("torch.nn.Module | None", call_with(self.fn, self.options, "model.options", run=run))


SPLIT_NAMES = {"train": "train", "validation": "valid", "valid": "valid", "test": "test"}
"""A dict of splits by these names (Hugging Face's ``DatasetDict``) is the run's splits."""


@define
class ImportedDataProvider:
    """Adapter: ``data.provider = "pkg.mod:fn"`` -> ``fn(context, **data.options)`` as provide_datasets."""

    fn: Any
    options: dict[str, Any]

    @hookimpl
    def provide_datasets(self, run: Run, context: DatasetContext) -> Datasets:
        result = call_with(self.fn, self.options, "data.options", run=run, context=context)
        if isinstance(result, Datasets):
            return result
        if isinstance(result, dict) and "train" in result and set(result) <= set(SPLIT_NAMES):  # a DatasetDict
            return Datasets(**{SPLIT_NAMES[name]: dataset for name, dataset in result.items()})
        if isinstance(result, tuple) or splits_list(result):  # (train, valid[, test]), random_split's list
            if not 1 <= len(result) <= 3:
                raise UserError(f"data.provider: a tuple of {len(result)} items; expected (train, valid, test)")
            return Datasets(**dict(zip(("train", "valid", "test"), result)))
        return Datasets(train=result)


def splits_list(result: Any) -> bool:
    """A list of 2 or 3 datasets — what ``random_split`` returns — is (train, valid[, test]), not
    one dataset of 2 samples (a list of samples holds tensors, tuples, lists, dicts, numbers)."""
    samples = (torch.Tensor, np.ndarray, tuple, list, dict, str, int, float)
    return (
        isinstance(result, list)
        and 2 <= len(result) <= 3
        and all(
            isinstance(item, torch.utils.data.Dataset) or (hasattr(item, "__len__") and not isinstance(item, samples))
            for item in result
        )
    )


def register_import_path_providers(config: Config, plugins: Plugins) -> None:
    """Import ``pkg.mod:fn`` providers, check their options against their signatures, register them."""
    if is_import_path(config.model.provider) and plugins.get("model.provider") is None:  # (an in-process restart's)
        fn = import_callable(config.model.provider, "model.provider")
        check_options(fn, dict(config.model.options), "model.options", ("run",))
        plugins.register("model.provider", ImportedModelProvider(fn, dict(config.model.options)))
    if is_import_path(config.data.provider) and plugins.get("data.provider") is None:
        fn = import_callable(config.data.provider, "data.provider")
        check_options(fn, dict(config.data.options), "data.options", ("run", "context"))
        plugins.register("data.provider", ImportedDataProvider(fn, dict(config.data.options)))
    if config.data.collate_fn:
        import_callable(config.data.collate_fn, "data.collate_fn")
    resolve_loss(config.model.loss)


# --------------------------------------------------------------------------- building


def build_run(config: Config, plugins: Plugins, write_config: bool = True, signals: SignalWatcher | None = None) -> Run:
    """Construct everything the loop needs, in the documented order.

    With ``write_config`` (a real run, not `config show`) rank 0 first locks the output dir (the
    run writes its config.toml there once it is accepted, :func:`record_config`);
    ``signals`` is checked between phases so a Ctrl-C during start-up ends it.
    """
    check_signals = signals.check if signals is not None else (lambda: None)
    check_providers_named(config)
    register_import_path_providers(config, plugins)
    run = _start(config, plugins)
    if run.dist.is_main and write_config:  # before any plugin touches the directory (a second job is refused)
        run.output_lock = OutputDirLock(run.output_dir).acquire()
    try:
        if write_config and plugins.implemented("configure_run"):  # a run that trains, not a check of one
            hook_calls(run).hook.configure_run(run=run)
        # a first count, to size the datasets by; the loop plans the steps ahead once it knows where it resumes
        run.train_iters = config.train.train_iters or (config.train.train_samples or 0) // run.global_batch_size
        if write_config and run.dist.world_size > 1:
            check_shared(run.output_dir, run.dist.rank)
        for build_part in (_build_datasets, _build_model, _build_optimizer):
            check_signals()
            build_part(run)
    except BaseException:  # a run that failed to build is closed here: its caller never holds it
        close_run(run, failing=True, configured=write_config)
        raise
    return run


def close_run(run: Run, failing: bool, configured: bool = True) -> None:
    """The end of every run: ``close_run`` on every plugin (``configured``: configure_run was
    called), even past one that raises, then the output dir let go. A plugin's error is raised
    unless the run already fails for another reason; then it is logged, and that one goes on."""
    errors: list[BaseException] = []
    try:
        if configured and run.plugins.implemented("close_run"):
            errors = hook_calls(run).close_run(run)
    finally:
        if run.output_lock is not None:
            run.output_lock.release()
    raise_first(errors, failing)


def raise_first(errors: list[BaseException], failing: bool) -> None:
    """The first error of plugins called past one another's failures is raised, unless the run
    already fails for another reason; the others (then all of them) are logged, not lost."""
    first = errors.pop(0) if errors and not failing else None
    for error in errors:
        log.error("also: %s", error)
    if first is not None:
        raise first


def record_config(run: Run) -> None:
    """``OUTPUT_DIR/config.toml``, the resolved config, written by the run holding the directory
    once it is accepted — built, and resumable from its checkpoints: a refused run leaves the
    file describing the checkpoints beside it."""
    if run.output_lock is not None:
        text = RECORDED_HEADER + toml_text(config_as_dict(run.config))
        (run.output_dir / RECORDED_CONFIG).write_text(text, encoding="utf-8")


def planned_steps(run: Run) -> int:
    """``train.train_iters``, or the last step ``train.train_samples`` (or ``train_epochs``) comes
    to in whole global batches — Megatron's update_train_iters: a rampup's steps counted one by one, the rest at
    the full batch (a partial last batch is left out). Planned from where the run stands (a
    resumed one on other ranks asks only about the steps ahead of it)."""
    samples = samples_to_train(run)
    if samples is None:
        return run.config.train.train_iters or 0
    full, step, consumed = run.global_batch_size, run.state.step, run.state.consumed_samples
    calls = hook_calls(run)
    while calls.implemented("num_micro_batches"):  # pure host arithmetic, asked as the loop will ask it
        micro = calls.hook.num_micro_batches(run=run, step=step + 1, consumed_samples=consumed)
        batch = (micro or run.micro_batches_per_step) * run.samples_per_micro_batch
        if batch >= full or consumed + batch > samples:
            break
        step, consumed = step + 1, consumed + batch
    step += max(samples - consumed, 0) // full
    if step == 0:
        epochs = run.config.train.train_epochs
        what = f"train.train_epochs ({epochs}: {samples} samples)" if epochs else f"train.train_samples ({samples})"
        raise UserError(f"{what} is less than one global batch ({full})")
    return step


def samples_to_train(run: Run) -> int | None:
    """``train.train_samples``, or ``train.train_epochs`` passes over the train split in samples."""
    train, dataset = run.config.train, run.datasets.train
    if train.train_epochs is None:
        return train.train_samples
    if is_stream(dataset):
        raise UserError("train.train_epochs: the train split is a stream, of no known length; set train_iters")
    return math.ceil(train.train_epochs * len(dataset))


def check_providers_named(config: Config) -> None:
    for section in ("model", "data"):
        if not getattr(config, section).provider:
            raise UserError(f"{section}.provider: not set; name a provider (`coretrain plugins`) or 'module:function'")


def _start(config: Config, plugins: Plugins) -> Run:
    """Threads, device, process group, seeds: the empty run the parts are built onto."""
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    device = resolve_device(config.run.device)
    if plugins.implemented("join_process_group"):
        plugins.calls.hook.join_process_group(config=config)
    info, groups = init_distributed(device.type, config.distributed)
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    output_dir = Path(config.output_dir)
    run = Run(config=config, plugins=plugins, dist=info, groups=groups, device=device, output_dir=output_dir)
    # (the job warns once, on rank 0)
    run.micro_batches_per_step = micro_batches_per_step(config.train, info.dp_size, warn=info.is_main)
    seed_everything(config.run.seed)
    return run


def _build_datasets(run: Run) -> None:
    """provide_datasets, sized by Megatron's context; checked; the cadence follows from them."""
    config, train, global_batch = run.config, run.config.train, run.global_batch_size
    eval_runs = (run.train_iters // train.eval_interval if train.eval_interval else 0) + 1
    context = DatasetContext(
        train_samples=train.train_samples or global_batch * run.train_iters,
        valid_samples=global_batch * train.eval_iters * eval_runs,
        test_samples=global_batch * train.eval_iters,
        seed=config.run.seed,
    )
    datasets = hook_calls(run).hook.provide_datasets(run=run, context=context)
    if datasets is None:
        raise UserError(f"data.provider '{config.data.provider}' returned no datasets")
    run.datasets = datasets
    if config.data.collate_fn:
        run.datasets.collate_fn = import_callable(config.data.collate_fn, "data.collate_fn")
    if hook_calls(run).implemented("configure_datasets"):
        hook_calls(run).hook.configure_datasets(run=run)
    run.cadence = Cadence.of(config, has_valid=run.datasets.valid is not None)
    check_datasets(run.datasets, config.data.provider)
    if hook_calls(run).implemented("on_datasets"):  # its reads must not move the RNG the model's init draws from
        keeping_rng(hook_calls(run).hook.on_datasets)(run=run)
    if train.train_epochs:  # the steps they come to, now that the split's length is known
        run.train_iters = planned_steps(run)


def _build_model(run: Run) -> None:
    """provide_model, checked, on the device; its loss; the configure_model wrappers."""
    config = run.config
    model = hook_calls(run).hook.provide_model(run=run)
    if model is None:
        raise UserError(f"model.provider '{config.model.provider}' returned no model")
    check_model(model, config.model.provider)
    run.model = model.to(run.device)
    run.loss_fn = resolve_loss(config.model.loss)
    if hook_calls(run).implemented("configure_model"):
        hook_calls(run).hook.configure_model(run=run)


def scheduler_of(run: Run) -> Scheduler:
    """The schedule a plugin answers with (checked: the loop calls what it promises), or none."""
    calls = hook_calls(run)
    scheduler = calls.hook.configure_scheduler(run=run) if calls.implemented("configure_scheduler") else None
    if scheduler is None:
        return Unscheduled()
    missing = [
        name for name in ("step", "state_dict", "load_state_dict") if not callable(getattr(scheduler, name, None))
    ]
    if missing:
        who = ", ".join(run.plugins.implementers("configure_scheduler"))
        raise UserError(
            f"configure_scheduler ({who}) returned {type(scheduler).__name__}, which has no {', '.join(missing)}; "
            "return an object with step(samples), state_dict() and load_state_dict(state)"
        )
    return scheduler


def _build_optimizer(run: Run) -> None:
    """The optimizer with the plugins' param-group overrides, the schedule, fp16's scaler."""
    config = run.config
    overrides = hook_calls(run).param_group_overrides(run=run, model=run.model)
    run.optimizer = build_optimizer(config.optimizer, run.model, overrides)
    if hook_calls(run).implemented("configure_optimizer"):
        hook_calls(run).hook.configure_optimizer(run=run)
    run.scheduler = scheduler_of(run)
    if config.run.precision == "fp16" and run.grad_scaler is None:  # a plugin's own (configure_optimizer)
        run.grad_scaler = torch.amp.GradScaler(run.device.type)
