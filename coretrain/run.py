"""The ``run`` object every hook receives, and how it is built from a config.

Build order (each step may use what the previous ones put on ``run``): distributed init,
seeds, output dir + resolved config.toml, datasets, model (moved to the device),
``configure_model`` wrappers, optimizer with param-group overrides, LR schedule.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

import numpy as np
import torch
from attrs import define, field

from coretrain import hookimpl
from coretrain.config import Config, micro_batches_per_step
from coretrain.control import Control
from coretrain.dist import DistInfo, init_distributed
from coretrain.errors import UserError, did_you_mean
from coretrain.optim import WarmupDecayLR, build_optimizer
from coretrain.outputs import LossFn
from coretrain.pluginmanager import Plugins, is_import_path
from coretrain.rundir import OutputDirLock, check_shared
from coretrain.signals import SignalWatcher
from coretrain.tomlwrite import dumps


@define(kw_only=True)
class Datasets:
    """What a data provider returns. Only ``train`` is required."""

    train: Any
    valid: Any = None
    test: Any = None
    seq_length: int | None = None
    """Tokens per sample, for tokens/s and for model defaults."""
    vocab_size: int | None = None
    collate_fn: Any = None
    """Turns a list of samples into a batch; None = torch's default_collate (``data.collate_fn``
    in the config takes precedence)."""


@define(kw_only=True)
class DatasetContext:
    """What a data provider may need to size its datasets (Megatron's build_datasets context)."""

    train_samples: int
    valid_samples: int
    test_samples: int
    seed: int


@define(kw_only=True)
class StepOutputs:
    """One step's results, on device: reading them (``.item()``) forces a sync."""

    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    skipped: bool
    global_batch_size: int


@define(kw_only=True)
class TrainState:
    """Progress counters saved in every checkpoint."""

    step: int = 0
    consumed_samples: int = 0
    skipped_updates: int = 0


T = TypeVar("T")


class Built(Generic[T]):
    """A part of the run built in order: typed as always there, because every hook after the
    one that builds it sees it; reading it earlier is a clear error, not an ``AttributeError``
    on None three calls later."""

    def __init__(self, built_by: str) -> None:
        self.built_by = built_by

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}"

    @overload
    def __get__(self, run: None, owner: type) -> Built[T]: ...
    @overload
    def __get__(self, run: Run, owner: type) -> T: ...
    def __get__(self, run: Run | None, owner: type) -> Built[T] | T:
        if run is None:
            return self
        value: T | None = getattr(run, self.slot)
        if value is None:
            raise AttributeError(f"run.{self.name} is not built yet: it exists from {self.built_by} on")
        return value

    def __set__(self, run: Run, value: T) -> None:
        setattr(run, self.slot, value)

    def is_built(self, run: Run) -> bool:
        return getattr(run, self.slot) is not None


@define(kw_only=True)
class Run:
    """Everything about the run in progress, handed to every hook as ``run``.

    ``datasets``, ``model``, ``optimizer`` and ``scheduler`` are built in that order
    (:func:`build_run`); every hook from ``on_train_start`` on sees all of them.
    """

    config: Config
    plugins: Plugins
    dist: DistInfo
    device: torch.device
    output_dir: Path
    control: Control = field(factory=Control)
    state: TrainState = field(factory=TrainState)
    _datasets: Datasets | None = field(default=None, alias="datasets")
    _model: torch.nn.Module | None = field(default=None, alias="model")
    _optimizer: torch.optim.Optimizer | None = field(default=None, alias="optimizer")
    _scheduler: WarmupDecayLR | None = field(default=None, alias="scheduler")
    grad_scaler: torch.amp.GradScaler | None = None
    """Present when run.precision = "fp16"."""
    micro_batches_per_step: int = 1
    started_at: float = 0.0
    """time.monotonic() when training (this process's part of it) started."""
    log_tensors: dict[str, torch.Tensor] = field(factory=dict)
    """Device scalars a plugin adds for the next ``on_log`` (e.g. a norm taken at the log step):
    read with the interval's one host sync, averaged over ranks, then cleared."""
    flops_per_sample: float | None = None
    """Training FLOPs (forward + backward) of one sample: the model's ``flops_per_token()`` ×
    seq_length, else counted once before training (:mod:`coretrain.flops`)."""
    loss_fn: LossFn | None = None
    """``model.loss`` resolved: turns the model's outputs and the batch's target into the loss."""
    output_lock: OutputDirLock | None = field(default=None, repr=False)
    """Rank 0's lock on output_dir: one run per directory, for as long as this run lives."""

    datasets = Built[Datasets]("provide_datasets")
    model = Built[torch.nn.Module]("provide_model")
    optimizer = Built[torch.optim.Optimizer]("the optimizer's build, after param_group_overrides")
    scheduler = Built[WarmupDecayLR]("the optimizer's build, after param_group_overrides")

    @property
    def samples_per_micro_batch(self) -> int:
        """Samples one micro-batch step reads over all ranks: micro_batch_size × data-parallel
        size (the ranks of a tensor-parallel group share their batch)."""
        return self.config.train.micro_batch_size * self.dist.dp_size

    @property
    def global_batch_size(self) -> int:
        """The configured samples per step (a plugin's ``num_micro_batches`` may vary it)."""
        return self.samples_per_micro_batch * self.micro_batches_per_step

    def device_mesh(self) -> Any:
        """The run's ``DeviceMesh``: dims ("dp",), or ("dp", "tp") with ``distributed.tp_size > 1``.

        Built on first use, shared by every parallelism plugin (FSDP2 shards over
        ``mesh["dp"]``, tensor parallelism splits over ``mesh["tp"]``); every rank must call it."""
        from coretrain.dist import device_mesh

        return device_mesh(self.device.type, self.dist)

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The model without DDP-style wrappers (whose state_dict keys gain a 'module.' prefix)."""
        module: torch.nn.Module = getattr(self.model, "module", self.model)
        return module


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device: 'cuda' requested but torch sees no CUDA device; use 'auto' or 'cpu'")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# --------------------------------------------------------------------------- import-path providers


def import_callable(path: str, key: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name.strip() or not attr.strip() or "" in attr.split("."):
        raise UserError(f"{key}: '{path}' is not an import path; expected 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raised as it loaded
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise UserError(f"{key}: cannot import '{path}': {type(exc).__name__}: {first}") from None
    if not callable(obj):
        raise UserError(f"{key}: '{path}' is not callable")
    return obj


def check_options(fn: Any, options: dict[str, Any], key: str, available: tuple[str, ...]) -> None:
    """The options fit ``fn``'s signature (``available`` names are passed by coretrain when asked for)."""
    signature = inspect.signature(fn)
    passed = {name: None for name in available if name in signature.parameters}
    try:
        signature.bind(**passed, **options)
    except TypeError as exc:
        accepted = [n for n in signature.parameters if n not in available]
        hint = "".join(did_you_mean(k, accepted) for k in options if k not in signature.parameters)
        raise UserError(
            f"{key}: options do not fit {fn.__module__}.{fn.__qualname__}: {exc}{hint}; "
            f"it accepts: {', '.join(accepted) or 'no options'}"
        ) from None


def _call_with(fn: Any, options: dict[str, Any], key: str, **available: Any) -> Any:
    """Call ``fn(**options)``, also passing ``run`` / ``context`` when its signature asks for them."""
    check_options(fn, options, key, tuple(available))
    parameters = inspect.signature(fn).parameters
    return fn(**{name: value for name, value in available.items() if name in parameters}, **options)


@define
class ImportedModelProvider:
    """Adapter: ``model.provider = "pkg.mod:fn"`` -> ``fn(**model.options)`` as a provide_model hook."""

    fn: Any
    options: dict[str, Any]

    @hookimpl
    def provide_model(self, run: Run) -> torch.nn.Module | None:
        model: torch.nn.Module | None = _call_with(self.fn, self.options, "model.options", run=run)
        return model


@define
class ImportedDataProvider:
    """Adapter: ``data.provider = "pkg.mod:fn"`` -> ``fn(context, **data.options)`` as provide_datasets."""

    fn: Any
    options: dict[str, Any]

    @hookimpl
    def provide_datasets(self, run: Run, context: DatasetContext) -> Datasets:
        result = _call_with(self.fn, self.options, "data.options", run=run, context=context)
        if isinstance(result, Datasets):
            return result
        if isinstance(result, tuple):
            if not 1 <= len(result) <= 3:
                raise UserError(
                    f"data.provider: returned a tuple of {len(result)} items; expected (train, valid, test)"
                )
            return Datasets(**dict(zip(("train", "valid", "test"), result)))
        return Datasets(train=result)


def register_import_path_providers(config: Config, plugins: Plugins) -> None:
    """Import ``pkg.mod:fn`` providers, check their options against their signatures, register them."""
    if is_import_path(config.model.provider):
        fn = import_callable(config.model.provider, "model.provider")
        check_options(fn, dict(config.model.options), "model.options", ("run",))
        plugins.register("model.provider", ImportedModelProvider(fn, dict(config.model.options)))
    if is_import_path(config.data.provider):
        fn = import_callable(config.data.provider, "data.provider")
        check_options(fn, dict(config.data.options), "data.options", ("run", "context"))
        plugins.register("data.provider", ImportedDataProvider(fn, dict(config.data.options)))
    if config.data.collate_fn:
        import_callable(config.data.collate_fn, "data.collate_fn")
    from coretrain.outputs import resolve_loss

    resolve_loss(config.model.loss)


# --------------------------------------------------------------------------- building


def build_run(config: Config, plugins: Plugins, write_config: bool = True, signals: SignalWatcher | None = None) -> Run:
    """Construct everything the loop needs, in the documented order.

    With ``write_config`` (a real run, not `config show`) rank 0 first locks the output dir;
    ``signals`` is checked between phases so a Ctrl-C during start-up ends it.
    """
    check_signals = signals.check if signals is not None else (lambda: None)
    for section in ("model", "data"):
        if not getattr(config, section).provider:
            raise UserError(
                f"{section}.provider: not set; name a provider plugin (see `coretrain plugins`) "
                f"or an import path 'pkg.module:function'"
            )
    register_import_path_providers(config, plugins)
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    device = resolve_device(config.run.device)
    dist_info = init_distributed(
        device.type,
        config.distributed.backend,
        config.distributed.init_timeout_seconds,
        config.distributed.tp_size,
    )
    if device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
        torch.cuda.set_device(device)
    micro = micro_batches_per_step(config.train, dist_info.dp_size)
    seed_everything(config.run.seed)

    output_dir = Path(config.output_dir)
    run = Run(
        config=config,
        plugins=plugins,
        dist=dist_info,
        device=device,
        output_dir=output_dir,
        micro_batches_per_step=micro,
    )
    if dist_info.is_main and write_config:
        run.output_lock = OutputDirLock(output_dir).acquire()
    try:
        _build_parts(run, write_config, check_signals)
    except BaseException:  # the lock is the run's to hold; a run that failed to build lets go of it
        if run.output_lock is not None:
            run.output_lock.release()
        raise
    return run


def _build_parts(run: Run, write_config: bool, check_signals: Callable[[], None]) -> None:
    """Datasets, model, optimizer and schedule, in the documented order, onto ``run``."""
    from coretrain.datachecks import check_datasets, check_model
    from coretrain.flops import flops_per_sample
    from coretrain.outputs import resolve_loss

    config, plugins, dist_info, device, output_dir = run.config, run.plugins, run.dist, run.device, run.output_dir
    if write_config and dist_info.world_size > 1:
        check_shared(output_dir, dist_info.rank)
    check_signals()

    train = config.train
    global_batch = run.global_batch_size
    eval_runs = (train.train_iters // train.eval_interval if train.eval_interval else 0) + 1
    context = DatasetContext(
        train_samples=global_batch * train.train_iters,
        valid_samples=global_batch * train.eval_iters * eval_runs,
        test_samples=global_batch * train.eval_iters,
        seed=config.run.seed,
    )
    datasets = plugins.calls.provide_datasets(run=run, context=context)
    if datasets is None:
        raise UserError(f"data.provider '{config.data.provider}' returned no datasets")
    run.datasets = datasets
    if config.data.collate_fn:
        run.datasets.collate_fn = import_callable(config.data.collate_fn, "data.collate_fn")
    from coretrain.loader import adapt

    adapt(run.datasets)
    # a full pass needs a sample per rank; eval_iters batches need one global batch
    eval_needed = dist_info.dp_size if train.eval_full else global_batch if train.eval_iters else 1
    check_datasets(
        run.datasets,
        config.data.provider,
        global_batch=global_batch,
        micro_batch=train.micro_batch_size,
        eval_needed=eval_needed,
    )
    check_signals()
    from coretrain.loader import is_stream

    if is_stream(run.datasets.train) and dist_info.is_main:
        logging.getLogger("coretrain").warning(
            "the train split is a stream: each rank and worker reads every %d-th item of it, and a checkpoint "
            "resumes exactly only on %d rank(s) with data.num_workers = %d (the stream's position is saved per "
            "rank and worker)",
            dist_info.dp_size * max(config.data.num_workers, 1),
            dist_info.dp_size,
            config.data.num_workers,
        )

    model = plugins.calls.provide_model(run=run)
    if model is None:
        raise UserError(f"model.provider '{config.model.provider}' returned no model")
    check_model(model, config.model.provider)
    run.model = model.to(device)
    run.loss_fn = resolve_loss(config.model.loss)
    run.flops_per_sample = flops_per_sample(run, run.loss_fn)
    plugins.calls.configure_model(run=run)
    check_signals()

    overrides = plugins.calls.param_group_overrides(run=run, model=run.model)
    run.optimizer = build_optimizer(config.optimizer, run.model, overrides)
    run.scheduler = WarmupDecayLR(
        run.optimizer, config.scheduler, config.optimizer.lr, train.train_iters, run.global_batch_size
    )
    if config.run.precision == "fp16":
        run.grad_scaler = torch.amp.GradScaler(device.type)
    if dist_info.is_main and write_config:  # only a run that built is recorded: a rejected one leaves none
        (output_dir / "config.toml").write_text(dumps(config_as_dict(config)), encoding="utf-8")


def config_as_dict(config: Config) -> dict[str, Any]:
    from coretrain.configload import CONVERTER

    unstructured: dict[str, Any] = CONVERTER.unstructure(config)
    return unstructured
