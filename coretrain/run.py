"""The run's data: what every hook receives (``Run``) and what providers hand back.

Plain types only — this module imports none of the core's behaviour, so everything else may
import it without a circle. Building a run is :mod:`coretrain.build`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast, overload

import torch
from attrs import define, field

from coretrain.cadence import Cadence
from coretrain.control import Control

if TYPE_CHECKING:
    from coretrain.config import Config
    from coretrain.dist import DistInfo, RunGroups
    from coretrain.rundir import OutputDirLock


class Scheduler(Protocol):
    """What ``configure_scheduler`` returns (the ``schedule`` plugin's ParamScheduler): the core
    advances it by each update's samples (vetoed updates do not move it) and checkpoints it."""

    def step(self, samples: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Unscheduled:
    """No plugin schedules: ``optimizer.lr`` throughout; counts the samples as a schedule would."""

    def __init__(self) -> None:
        self.samples = 0

    def step(self, samples: int) -> None:
        self.samples += samples

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = int(state.get("samples", 0))


LossFn = Callable[[Any, Any], Any]
"""``model.loss`` resolved: (the model's outputs, the batch's target) -> the loss."""


class PluginSet(Protocol):
    """``run.plugins``, the enabled plugins (:class:`coretrain.pluginmanager.Plugins`), as far as
    a hook may use them. Declared here, not imported, so the run's types sit below the plugin
    manager and the hook contract, which take a ``Run``."""

    calls: Any
    """Typed hook calls (``HookCalls``); the core reaches them through ``pluginmanager.hook_calls``."""
    running: list[tuple[str, str]]
    """(plugin, hook) of the implementations running now, innermost last."""

    def get(self, name: str) -> object | None: ...
    def names(self) -> list[str]: ...
    def implemented(self, hook_name: str) -> bool: ...
    def implementers(self, hook_name: str) -> list[str]: ...
    def vetoing(self) -> list[str]: ...


@define(kw_only=True)
class Datasets:
    """What a data provider returns. Only ``train`` is required."""

    train: Any
    valid: Any = None
    """A dataset, or several by name (``{"wiki": a, "code": b}``): each is evaluated on its own
    and reported as ``valid/NAME/loss``, ``valid/NAME/...``."""
    test: Any = None
    """As ``valid``: one dataset, or several by name (``test/NAME/...``)."""
    seq_length: int | None = None
    """Tokens per sample, for tokens/s and for model defaults."""
    vocab_size: int | None = None
    tokenizer: Any = None
    """What turns text into these token ids and back (``encode``, ``decode``): a transformers
    tokenizer or a provider's own (``text-bytes``: UTF-8 bytes), for commands given text
    (``predict --data``). None: no known one (the ``tokenizer`` plugin fills in ``[tokenizer]``)."""
    collate_fn: Any = None
    """Turns a list of samples into a batch; None = torch's default_collate (``data.collate_fn``
    in the config takes precedence)."""
    in_order: bool = False
    """The datasets' own order is their training order (Megatron's GPTDataset shuffles its
    samples itself): training and evaluation read them in it, without a shuffle of their own."""

    def sets(self, split: str) -> list[tuple[str, Any]]:
        """The datasets of ``split`` as (name, dataset): ``[("valid", d)]`` for one dataset,
        ``[("valid/wiki", a), ("valid/code", b)]`` for named ones, ``[]`` for none."""
        value = getattr(self, split)
        if value is None:
            return []
        if isinstance(value, dict):
            return [(f"{split}/{name}", dataset) for name, dataset in value.items()]
        return [(split, value)]


@define(kw_only=True)
class DatasetContext:
    """What a data provider may need to size its datasets (Megatron's build_datasets context)."""

    train_samples: int
    valid_samples: int
    test_samples: int
    seed: int
    tokenizer: Any = None
    """The run's tokenizer (``[tokenizer]``), a transformers tokenizer whatever its type, loaded
    once by coretrain-plugins' ``tokenizer`` plugin; None when the config names none."""


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
        """The built part, or an AttributeError saying which build phase makes it (a plugin that
        reads ``run.model`` in ``configure_datasets`` learns why, not that it is None)."""
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
    (:func:`coretrain.build.build_run`); every hook from ``on_train_start`` on sees all of them.
    """

    config: Config
    plugins: PluginSet
    dist: DistInfo
    device: torch.device
    output_dir: Path
    groups: RunGroups
    """The process groups this run made (its device mesh, its decisions' group)."""
    control: Control = field(factory=Control)
    cadence: Cadence = field(factory=Cadence)
    """Which steps log, evaluate and save: ask it (``run.cadence.logs(step)``) rather than
    computing ``step % interval`` (set from the config once the datasets are built)."""
    state: TrainState = field(factory=TrainState)
    _datasets: Datasets | None = field(default=None, alias="datasets")
    _model: torch.nn.Module | None = field(default=None, alias="model")
    _optimizer: torch.optim.Optimizer | None = field(default=None, alias="optimizer")
    _scheduler: Scheduler | None = field(default=None, alias="scheduler")
    grad_scaler: torch.amp.GradScaler | None = None
    """Present when run.precision = "fp16"."""
    micro_batches_per_step: int = 1
    train_iters: int = 0
    """Steps this run trains: ``train.train_iters``, or the whole global batches
    ``train.train_samples`` comes to (under a rampup, as many as it takes); set once built."""
    started_at: float = 0.0
    """time.monotonic() when training (this process's part of it) started."""
    log_tensors: dict[str, torch.Tensor] = field(factory=dict)
    """Device scalars a plugin adds for the next ``on_log`` (e.g. a norm taken at the log step):
    read with the interval's one host sync, averaged over ranks, then cleared."""
    flops_per_sample: float | None = None
    """Training FLOPs (forward + backward) of one sample, for plugins that report throughput; set
    before any wrapper by the plugin that counts them (``timers``), None when none does."""
    model_parts: list[torch.nn.Module] = field(factory=list)
    """The modules the model's forward runs through when it is not ``run.model`` itself (a
    pipeline's stages on this rank, sharing ``run.model``'s submodules, which keep the names):
    plugins that wrap a forward (FSDP's roots, compile) wrap each. Empty: ``run.model``."""
    reports_loss: bool = True
    """False on a rank whose part of the model computes no loss (a pipeline's stages before the
    last, ``forward_backward``): its step's loss is a placeholder, left out of the logged means."""
    loss_fn: LossFn | None = None
    """``model.loss`` resolved: turns the model's outputs and the batch's target into the loss."""
    output_lock: OutputDirLock | None = field(default=None, repr=False)
    """Rank 0's lock on output_dir: one run per directory, for as long as this run lives."""

    datasets = Built[Datasets]("provide_datasets")
    model = Built[torch.nn.Module]("provide_model")
    optimizer = Built[torch.optim.Optimizer]("the optimizer's build, after param_group_overrides")
    scheduler = Built[Scheduler]("configure_scheduler, after the optimizer's build")

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
        return self.groups.mesh(self.device.type, self.dist)

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The model without DDP-style wrappers (whose state_dict keys gain a 'module.' prefix)."""
        return cast(torch.nn.Module, getattr(self.model, "module", self.model))
