"""The config schema: one attrs class per TOML section.

Field names are the TOML keys users, docs and scripts rely on; keep them stable. Train keys
follow Megatron-Bridge's ``TrainingConfig`` where the two overlap. Loading, composition and
error messages live in :mod:`coretrain.configload`; this module only says what is valid.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import attrs
from attrs import define, field

from coretrain.errors import UserError, did_you_mean
from coretrain.validators import FieldValueError, fraction, in_range
from coretrain.validators import non_negative as _non_negative
from coretrain.validators import positive as _positive


def world_size_from_env() -> int:
    """Ranks torchrun started (1 outside torchrun); read without importing torch."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _signal_names(instance: object, attribute: attrs.Attribute[Any], value: list[str]) -> None:
    """Each name is a signal of this platform's (``SIGTERM``), so a typo fails at load, not when a job is preempted."""
    import signal

    for name in value:
        if not (name.startswith("SIG") and isinstance(getattr(signal, name, None), signal.Signals)):
            raise FieldValueError(attribute.name, f"{name!r} is not a signal name (e.g. 'SIGTERM', 'SIGUSR1')")


PRECISION_NAMES = {"bf16_mixed": "bf16", "bf16-mixed": "bf16", "fp16_mixed": "fp16", "16-mixed": "fp16"}


@define(kw_only=True)
class RunConfig:
    """Identity and placement of the run."""

    name: str = "coretrain"
    """What the run is called: ``{name}`` in output_dir, trackers' run names."""
    seed: int = field(default=1234, validator=in_range(0, 2**32 - 1))
    """Seeds Python, numpy and torch (numpy accepts 0 .. 2**32-1)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": CUDA when torch sees a GPU (the local rank's), else the CPU."""
    precision: Literal["fp32", "bf16", "fp16", "bf16_mixed", "fp16_mixed", "bf16-mixed", "16-mixed"] = "fp32"
    """Autocast dtype for forward, fp32 weights; fp16 adds a checkpointed grad scaler (and one sync
    per step for its overflow check, as in Megatron). Megatron-Bridge's recipe names
    (``bf16_mixed``, ``fp16_mixed``) and Lightning's (``bf16-mixed``, ``16-mixed``) are
    read as bf16 and fp16; FP8 is the ``fp8`` plugin's (``[plugins.fp8]``)."""
    output_dir: str = "runs/{name}"
    """Where config.toml, metrics.jsonl and checkpoints go; ``{name}`` is replaced by run.name."""
    threads: int | None = field(default=None, validator=_positive)
    """torch intra-op threads; unset leaves torch's default."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """What reaches the console (rank 0; other ranks print warnings and errors only);
    ``coretrain run --quiet`` / ``--verbose`` override it."""

    def __attrs_post_init__(self) -> None:
        self.precision = PRECISION_NAMES.get(self.precision, self.precision)  # type: ignore[assignment]


@define(kw_only=True)
class ModelConfig:
    """The model: a provider plugin's name or an import path ``pkg.mod:callable``, and its loss."""

    provider: str = ""
    """A model provider plugin's name (``gpt``, ``hf``) or ``pkg.mod:callable`` returning an ``nn.Module``."""
    options: dict[str, Any] = field(factory=dict)
    """The provider's own keys (the plugin's table: see its section of this reference)."""
    loss: str | None = None
    """For a model that returns outputs, not its loss: "cross_entropy", "mse", or an import path
    ``pkg.mod:fn`` called as fn(outputs, target). The batch's last item (or its "labels" key)
    is the target; the rest goes to the model. Unset: the model returns its loss."""


@define(kw_only=True)
class DataConfig:
    """The datasets: a provider plugin's name or an import path, and how batches are loaded."""

    provider: str = ""
    """A data provider plugin's name (``indexed``, ``hf-text``, ...) or ``pkg.mod:callable`` returning Datasets."""
    options: dict[str, Any] = field(factory=dict)
    """The provider's own keys (the plugin's table: see its section of this reference)."""
    num_workers: int = field(default=0, validator=_non_negative)
    """DataLoader worker processes preparing batches off the training thread; 0 reads them in
    the training loop (the in-memory fast path)."""
    prefetch_factor: int = field(default=2, validator=_positive)
    """Batches each worker prepares ahead."""
    pin_memory: bool = True
    """Page-locked host batches for faster copies to the GPU (only with workers and CUDA)."""
    persistent_workers: bool = True
    """Keep workers alive between evaluation passes."""
    collate_fn: str | None = None
    """Import path ``pkg.mod:fn`` turning a list of samples into a batch; unset = the
    datasets' own ``collate_fn``, else torch's default_collate."""


@define(kw_only=True)
class TokenizerConfig:
    """The run's one tokenizer (Megatron-Bridge's TokenizerConfig), for every plugin that needs one:
    the text providers tokenize with it, ``indexed`` takes its vocabulary from it, ``predict``
    encodes prompts with it, ``data prepare --config`` writes the data with it."""

    path: str | None = None
    """A local Hugging Face tokenizer directory (what ``save_pretrained`` writes); unset: a
    provider's own option (``data.options.tokenizer``), as before this section."""
    trust_remote_code: bool = False
    """Let transformers run code shipped in the tokenizer's (or the ``hf`` model's) directory, a
    custom architecture's; off: such a directory is one error naming this key."""


@define(kw_only=True)
class TrainConfig:
    """Batch sizes, duration and cadence (Megatron-Bridge TrainingConfig names)."""

    micro_batch_size: int = field(default=1, validator=_positive)
    """Samples per forward on one data-parallel rank; a step takes global_batch_size / (this ×
    data-parallel ranks) micro-batches."""
    global_batch_size: int | None = field(default=None, validator=_positive)
    """Samples per optimizer step over all data-parallel ranks; unset = micro × data-parallel size."""
    decrease_batch_size_if_needed: bool = False
    """When global_batch_size is not a multiple of micro × data-parallel size (a job resumed on
    fewer ranks), round it down to one, with a warning (Megatron's option); else an error."""
    train_iters: int | None = field(default=None, validator=_non_negative)
    """Optimizer steps to train; unset (and no train_samples) = 1000."""
    train_samples: int | None = field(default=None, validator=_positive)
    """Instead of train_iters: train on this many samples (Megatron's --train-samples), whole
    global batches; the steps follow from the global batch (and a rampup, if any)."""
    train_epochs: float | None = field(default=None, validator=[_positive, in_range(high=1_000_000)])
    """Instead of train_iters: this many passes over the train split (1.5 allowed), converted to
    samples once the split is built (its length × this), then trained as train_samples."""
    exit_interval: int | None = field(default=None, validator=_positive)
    """Checkpoint and exit when the step is a multiple of this."""
    exit_duration_in_mins: float | None = field(default=None, validator=_positive)
    """Stop (with a checkpoint) after this many minutes of the job, agreed over ranks (Megatron's)."""
    eval_interval: int | None = field(default=None, validator=_positive)
    """Validate every N steps; unset = validate only after training."""
    eval_iters: int = field(default=10, validator=_non_negative)
    """Global batches per validation (the same ones every time); 0 disables validation."""
    eval_full: bool = False
    """Validate on every sample of the split exactly once, split over ranks (eval_iters is
    then ignored); the test split, if any, is evaluated the same way after training."""
    eval_micro_batch_size: int | None = field(default=None, validator=_positive)
    """Samples per forward in evaluation; unset = micro_batch_size."""
    skip_train: bool = False
    """Only validate (after loading a checkpoint, if any) and test; no checkpoint is written."""
    log_interval: int = field(default=100, validator=_positive)
    """Steps per logged interval: its one host sync, then on_log (metrics.jsonl, progress, trackers)."""
    skip_train_metrics_log: bool = False
    """Megatron-Bridge's: the training metrics reach no logging backend and not the console
    (evaluations still do); the interval's own checks, a NaN loss among them, still run."""
    exit_signal_handler: bool = True
    """On a signal in exit_signals: checkpoint at the next step boundary, then exit 128+signum."""
    exit_signals: list[str] = field(factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"], validator=_signal_names)
    """The signals exit_signal_handler watches (names as in the signal module)."""
    clip_grad: float = field(default=1.0, validator=_non_negative)
    """Max global gradient norm; 0 disables clipping."""

    def __attrs_post_init__(self) -> None:
        """One way to say the run's length (none: 1,000 steps)."""
        lengths = [key for key in ("train_iters", "train_samples", "train_epochs") if getattr(self, key) is not None]
        if len(lengths) > 1:
            raise FieldValueError(lengths[1], f"set one of train_iters, train_samples and train_epochs, not {lengths}")
        if not lengths:
            self.train_iters = 1000


OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "adafactor")


def _optimizer_name(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    """A built-in optimizer's name or an import path (checked when the optimizer is built)."""
    if value not in OPTIMIZER_NAMES and ":" not in value:
        raise FieldValueError(
            attribute.name,
            f"must be {', '.join(OPTIMIZER_NAMES)} or 'package.module:Class', got {value!r}"
            + did_you_mean(value, OPTIMIZER_NAMES),
        )


@define(kw_only=True)
class OptimizerConfig:
    """A torch.optim optimizer by name, or any optimizer class by import path."""

    name: str = field(default="adamw", validator=_optimizer_name)
    """torch.optim's AdamW, Adam, SGD or Adafactor (Shazeer & Stern: factored second moments, no
    first; ``betas`` and ``eps`` are Adam's, Adafactor keeps torch's own decay and epsilons); or a
    class by import path (``"torch.optim:RMSprop"``, ``"lion_pytorch:Lion"``), given the param
    groups, ``lr``, ``weight_decay`` if it takes one, and ``options``."""
    options: dict[str, Any] = field(factory=dict)
    """More keyword arguments of the optimizer (``{nesterov = true}``, ``{fused = true}``, a
    class's own), checked against its signature."""
    lr: float = field(default=3e-4, validator=_non_negative)
    """Peak learning rate (the schedule's ``max_lr`` unless a param group overrides it)."""
    weight_decay: float = field(default=0.01, validator=_non_negative)
    """Decoupled weight decay (AdamW's); 1-D parameters get none with optimizer-overrides' default."""
    betas: tuple[float, float] = field(default=(0.9, 0.999), validator=fraction)
    """Adam's moment decay rates, each in [0, 1)."""
    eps: float = field(default=1e-8, validator=_positive)
    """Adam's epsilon."""
    momentum: float = field(default=0.0, validator=fraction)
    """SGD only."""


@define(kw_only=True)
class CheckpointConfig:
    """When and where to save, what to resume from."""

    save_interval: int | None = field(default=None, validator=_positive)
    """Save every N steps (and at the end of training); unset saves only at the end."""
    save: bool = True
    """Set false to never write checkpoints."""
    keep_last: int | None = field(default=None, validator=_positive)
    """Keep only this many newest checkpoints (plugins may protect others, e.g. keep-best's); unset keeps all."""
    resume: str = "auto"
    """"auto" (newest complete checkpoint in the output dir), "never", or a checkpoint path (a
    run's output directory: its newest complete checkpoint)."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint's async save for
    sharded ones) while training goes on."""
    storage_writers_per_rank: int = field(default=1, validator=in_range(1, 64))
    """Threads, each writing a file of its own, with which every rank writes a sharded (DCP)
    checkpoint: torch.distributed.checkpoint's ``thread_count`` (Megatron-Bridge's key); at
    most 64 (more files per save than a file system serves well)."""
    pretrained: str | None = None
    """Load model weights only from this checkpoint (fine-tuning: step 0, fresh optimizer); a
    run's output directory (or its ``checkpoints/``) means its newest complete checkpoint."""
    pretrained_exclude: list[str] = field(factory=list)
    """Parameters that keep the model's own initialisation instead of the pretrained weights: names
    or globs, a module's name covering its parameters (``["head"]``: a classifier's new head; NeMo's
    ``init_from_pretrained_model.exclude``). Each must match a parameter of the model or the checkpoint."""
    save_frozen: bool = True
    """Save the parameters that do not train (requires_grad false) too; false saves only what
    trains (e.g. LoRA adapters), and a resume takes the rest from the model provider again
    (the same pretrained path)."""
    load_optimizer: bool = True
    """On resume, load the optimizer's state; false starts it afresh (e.g. after changing
    optimizer.name), keeping weights, step, schedule position and data position."""


@define(kw_only=True)
class DistributedConfig:
    """How ranks cooperate; the wrapping itself (DDP, FSDP2) comes from plugins."""

    strategy: str = "auto"
    """The data-parallel plugin's name ("ddp", "fsdp"), "none", or "auto": with more than one
    data-parallel replica "ddp", or "fsdp" when tp_size, dp_replicate or ep_size > 1, and always with
    pp_size > 1; else none. Its settings go in [plugins.NAME]."""
    pp_size: int = field(default=1, validator=_positive)
    """Pipeline-parallel degree: the model's layers cut into this many stages, each held by other
    ranks, micro-batches flowing through them (the ``pipeline-parallel`` plugin, on FSDP);
    the outermost split of the ranks: data parallel = ranks / pp_size / tp_size / cp_size."""
    tp_size: int = field(default=1, validator=_positive)
    """Tensor-parallel degree: each group of tp_size neighbouring ranks splits every layer of
    one model replica (the ``tensor-parallel`` plugin; settings in [plugins.tensor-parallel]);
    data parallel = ranks / tp_size."""
    cp_size: int = field(default=1, validator=_positive)
    """Context-parallel degree: the ranks that split each sequence of a batch (the
    ``context-parallel`` plugin); data parallel = ranks / tp_size / cp_size."""
    ep_size: int = field(default=1, validator=_positive)
    """Expert-parallel degree: a mixture of experts' experts spread over this many ranks — a
    divisor of one replica's data-parallel ranks × cp_size, taking whole context groups —, tokens
    sent to them by all-to-all, each spread copy sharded by FSDP over the rest (the
    ``expert-parallel`` plugin, on FSDP)."""
    dp_replicate: int = field(default=1, validator=_positive)
    """HSDP: data-parallel replicas, each sharding the model over dp_shard ranks (FSDP2 on a 2-D
    mesh: gradients all-reduced across replicas, reduce-scattered within one). 1 = plain FSDP."""
    dp_shard: int | None = field(default=None, validator=_positive)
    """Ranks each replica shards over; unset = the rest (ranks / tp_size / dp_replicate)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto = nccl on CUDA, gloo on CPU."""
    init_timeout_seconds: float = field(default=600.0, validator=_positive)
    """Start-up and the first step (compilation, loading, a slow filesystem), evaluation and
    checkpoints: a rank that makes no progress for this long is named and the job ends."""

    def resolved_strategy(self, world_size: int) -> str | None:
        """The data-parallel plugin to enable, if any (DDP cannot hold tensor-parallel weights)."""
        if self.strategy == "auto":
            if self.pp_size > 1:  # a stage's weights as DTensors: checkpoints sharded by name on any layout
                return "fsdp"
            if world_size // self.tp_size <= 1:
                return None
            return "fsdp" if self.tp_size > 1 or self.dp_replicate > 1 or self.ep_size > 1 else "ddp"
        return None if self.strategy == "none" else self.strategy

    def check_layout(self, world_size: int) -> None:
        """The ranks make a (dp_replicate × dp_shard × tp_size) grid, and HSDP runs on fsdp."""
        tp, replicas = self.tp_size, self.dp_replicate
        if world_size % tp:
            fits = max(t for t in range(1, tp + 1) if world_size % t == 0)
            raise UserError(
                f"distributed.tp_size ({tp}) must divide the number of ranks ({world_size}); "
                f"start a multiple of {tp} ranks, or set distributed.tp_size = {fits}"
            )
        data_parallel = world_size // tp
        splits = (("cp_size", self.cp_size, "ranks / tp_size"), ("pp_size", self.pp_size, "ranks / tp_size / cp_size"))
        for key, size, what in splits:
            if data_parallel % size:
                raise UserError(f"distributed.{key} ({size}) must divide {what} ({data_parallel})")
            data_parallel //= size
        if data_parallel % replicas or (self.dp_shard or data_parallel // replicas) * replicas != data_parallel:
            raise UserError(
                f"distributed.dp_replicate ({replicas}) × dp_shard ({self.dp_shard or 'unset'}) must be the "
                f"data-parallel ranks: {world_size} ranks / tp_size {tp} / cp_size {self.cp_size} / pp_size "
                f"{self.pp_size} = {data_parallel}"
            )
        for key, size, what in (("dp_replicate", replicas, "HSDP"), ("pp_size", self.pp_size, "pipelined")):
            if size > 1 and self.resolved_strategy(world_size) != "fsdp":
                raise UserError(
                    f'distributed.{key} = {size} is {what}, a layout of FSDP2: set distributed.strategy = "fsdp"'
                )


@define(kw_only=True)
class Config:
    """The whole run, as read from TOML."""

    run: RunConfig = field(factory=RunConfig)
    model: ModelConfig = field(factory=ModelConfig)
    data: DataConfig = field(factory=DataConfig)
    tokenizer: TokenizerConfig = field(factory=TokenizerConfig)
    train: TrainConfig = field(factory=TrainConfig)
    optimizer: OptimizerConfig = field(factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(factory=CheckpointConfig)
    distributed: DistributedConfig = field(factory=DistributedConfig)
    plugins: dict[str, dict[str, Any]] = field(factory=dict)
    """Raw ``[plugins.NAME]`` tables; each is structured into its plugin's class on load."""

    @property
    def output_dir(self) -> str:
        return self.run.output_dir.replace("{name}", self.run.name)

    def check_world(self, world_size: int) -> None:
        """The layout and the batch sizes fit ``world_size`` ranks, or one error naming the keys."""
        self.distributed.check_layout(world_size)
        layout = self.distributed
        split = layout.tp_size * layout.cp_size * layout.pp_size  # ranks that share one batch
        micro_batches_per_step(self.train, world_size // split, warn=False)


def micro_batches_per_step(train: TrainConfig, data_parallel_size: int, warn: bool = True) -> int:
    """Gradient-accumulation steps: global / (micro × data-parallel); must divide exactly,
    unless ``decrease_batch_size_if_needed`` rounds the global batch down (``warn``: say so)."""
    per_pass = train.micro_batch_size * data_parallel_size
    global_batch = train.global_batch_size or per_pass
    if global_batch % per_pass == 0:
        return global_batch // per_pass
    where = (
        f"train.global_batch_size ({global_batch}) is not a multiple of train.micro_batch_size × "
        f"data-parallel size ({train.micro_batch_size} × {data_parallel_size} = {per_pass})"
    )
    if global_batch < per_pass:
        raise UserError(f"{where}, and not even one such pass fits in it; lower train.micro_batch_size")
    rounded = global_batch // per_pass * per_pass
    if not train.decrease_batch_size_if_needed:
        raise UserError(
            f"{where}; set train.decrease_batch_size_if_needed = true to train with a global batch "
            f"of {rounded} on these ranks (as when resuming on fewer ranks), or set global_batch_size = {rounded}"
        )
    if warn:
        logging.getLogger("coretrain").warning("%s: training with a global batch of %d instead", where, rounded)
    return rounded // per_pass
