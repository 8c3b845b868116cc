"""The schedule against Megatron's OptimizerParamScheduler (get_lr / get_wd transcribed below):
update u of a coretrain run uses Megatron's rates after u updates' samples, for every decay
style, warmup form and weight-decay style, in iterations and in samples."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from coretrain_schedule import Schedule as SchedulerConfig
from coretrain_schedule.scheduler import ParamScheduler

from coretrain import UserError, hookimpl, movedkeys
from coretrain.testing import run_steps


def megatron_lr(n: float, s: dict[str, Any]) -> float:
    """OptimizerParamScheduler.get_lr with init_lr 0; ``n`` is its num_steps (samples)."""
    max_lr, min_lr, warmup, decay = s["max_lr"], s["min_lr"], s["warmup"], s["decay"]
    if warmup > 0 and n <= warmup:
        return max_lr * float(n) / float(warmup)
    if s["style"] == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if s["style"] == "inverse-square-root":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
    ratio = float(n - warmup) / float(decay - warmup)
    assert 0.0 <= ratio <= 1.0
    if s["style"] == "linear":
        coeff = 1.0 - ratio
    elif s["style"] == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD
        anneal_start = decay - s["wsd"]
        if n <= anneal_start:
            coeff = 1.0
        else:
            r = float(n - anneal_start) / float(s["wsd"])
            coeff = {
                "linear": 1.0 - r,
                "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                "exponential": (2.0 * math.pow(0.5, r)) - 1.0,
                "minus_sqrt": 1.0 - math.sqrt(r),
            }[s["wsd_style"]]
    return min_lr + coeff * (max_lr - min_lr)


def megatron_wd(n: float, start: float, end: float, steps: float, style: str) -> float:
    """OptimizerParamScheduler.get_wd."""
    if n > steps:
        return end
    if style == "constant":
        return end
    ratio = float(n) / float(steps)
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


BATCH, ITERS = 8, 100
CASES = [
    ({"decay_style": "linear", "warmup_iters": 10, "min_lr": 1e-4}, {"style": "linear", "warmup": 80}),
    ({"decay_style": "cosine", "warmup_fraction": 0.05}, {"style": "cosine", "warmup": 40}),
    (
        {"decay_style": "cosine", "warmup_samples": 24, "decay_samples": 600},
        {"style": "cosine", "warmup": 24, "decay": 600},
    ),
    (
        {"decay_style": "inverse-square-root", "warmup_iters": 5, "min_lr": 2e-4},
        {"style": "inverse-square-root", "warmup": 40},
    ),
    ({"decay_style": "constant", "warmup_iters": 3}, {"style": "constant", "warmup": 24}),
    *[
        (
            {"decay_style": "WSD", "warmup_iters": 5, "wsd_decay_iters": 20, "wsd_decay_style": style, "min_lr": 1e-5},
            {"style": "WSD", "warmup": 40, "wsd": 160, "wsd_style": style},
        )
        for style in ("linear", "cosine", "exponential", "minus_sqrt")
    ],
    (
        {"decay_style": "WSD", "wsd_decay_samples": 200, "decay_iters": 90},
        {"style": "WSD", "warmup": 0, "wsd": 200, "decay": 720, "wsd_style": "exponential"},
    ),
]


@pytest.mark.parametrize(("options", "expected"), CASES, ids=[str(sorted(o.items())) for o, _ in CASES])
def test_every_update_uses_megatrons_rate_after_its_samples(options: dict[str, Any], expected: dict[str, Any]) -> None:
    cfg = SchedulerConfig(**options)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = ParamScheduler(optimizer, cfg, 1e-3, ITERS * BATCH, BATCH)
    reference = {"max_lr": 1e-3, "min_lr": cfg.min_lr, "decay": ITERS * BATCH, "wsd": 0, **expected}
    for update in range(1, ITERS + 11):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(megatron_lr(update * BATCH, reference), abs=1e-15)
        assert scheduler.lr_at(update) == optimizer.param_groups[0]["lr"]
        scheduler.step()


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_follows_megatrons_schedule_and_spares_groups_without_it(style: str) -> None:
    cfg = SchedulerConfig(start_weight_decay=0.0, end_weight_decay=0.1, weight_decay_incr_style=style)
    decayed, spared = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    groups = [{"params": [decayed], "weight_decay": 0.05}, {"params": [spared], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    scheduler = ParamScheduler(optimizer, cfg, 1e-3, ITERS * BATCH, BATCH)
    for update in range(1, ITERS + 1):
        expected = megatron_wd(update * BATCH, 0.0, 0.1, ITERS * BATCH, style)
        assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(expected, abs=1e-15)
        assert optimizer.param_groups[1]["weight_decay"] == 0.0
        scheduler.step()
    assert scheduler.last_weight_decay == pytest.approx(0.1)


def test_a_run_logs_the_scheduled_weight_decay_and_wsd_ends_at_min_lr(tmp_path: Path) -> None:
    scheduler = {
        "decay_style": "WSD",
        "wsd_decay_iters": 4,
        "wsd_decay_style": "linear",
        "min_lr": 0.001,
        "start_weight_decay": 0.0,
        "end_weight_decay": 0.1,
        "weight_decay_incr_style": "linear",
    }
    config = {"plugins": {"schedule": scheduler}, "train": {"log_interval": 1}}
    metrics = run_steps(tmp_path, 10, config=config).metrics
    assert [m["lr"] for m in metrics[:6]] == pytest.approx([0.01] * 6)  # stable until the last 4
    assert metrics[-1]["lr"] == pytest.approx(0.001)
    assert [m["weight_decay"] for m in metrics] == pytest.approx([0.01 * step for step in range(1, 11)])
    from coretrain_report.report import plot

    written = plot([("wsd", metrics)], tmp_path / "report", "wsd")
    assert {"lr.png", "weight_decay.png"} <= {path.name for path in written}


@pytest.mark.parametrize(
    ("scheduler", "message"),
    [
        ({"decay_style": "WSD"}, r"plugins\.schedule\.wsd_decay_iters: .*final decay"),
        ({"warmup_iters": 5, "warmup_fraction": 0.1}, r"plugins\.schedule\.warmup_fraction: set one of"),
        ({"start_weight_decay": 0.0}, r"plugins\.schedule\.end_weight_decay: set start_weight_decay and end"),
        ({"start_weight_decay": 0.0, "end_weight_decay": 0.1}, r"weight_decay_incr_style: .*\"linear\" or \"cosine\""),
        (
            {"decay_iters": 5, "decay_samples": 40},
            r"plugins\.schedule\.decay_samples: set decay_iters or decay_samples",
        ),
        ({"decay_style": "wsd"}, r"plugins\.schedule\.decay_style: .*did you mean 'WSD'"),
        ({"warmup_iters": 2, "decay_iters": 2}, r"not shorter than the decay it starts \(decay_iters / decay_samp"),
    ],
)
def test_an_inconsistent_schedule_is_one_error_naming_the_key(
    tmp_path: Path, scheduler: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        run_steps(tmp_path, 2, config={"plugins": {"schedule": scheduler}})


def test_a_run_shorter_than_its_warmup_warns_once_and_trains(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The decay spans the run when no decay_iters says otherwise: a short smoke run of a config
    with a long warmup is allowed (README's notebook example is one), and told."""
    with caplog.at_level("WARNING", logger="coretrain"):
        result = run_steps(tmp_path, 2, config={"plugins": {"schedule": {"warmup_iters": 5}}})
    assert result.exit_code == 0
    warned = [r.message for r in caplog.records if "not longer than its warmup" in r.message]
    assert warned == ["schedule: this run (16 samples) is not longer than its warmup (40): the rate never decays"]


def test_a_resume_past_the_end_of_its_decay_says_that_the_steps_left_train_at_min_lr(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint of a larger global batch (2 ranks, the batch following them) resumed on a
    smaller one with more steps: its samples are already past the decay the run's steps x batch
    spans, so the steps left train at min_lr. Said once, with what keeps the decay; a finished
    run started again, or a resume that is not past it, says nothing."""
    base = {"train": {"micro_batch_size": 4, "log_interval": 1}, "checkpoint": {"save_interval": 4}}
    larger = {**base, "train": {**base["train"], "global_batch_size": 8}}
    run_steps(tmp_path, 4, config=larger)  # 32 samples
    allow = {"plugins": {"resume-checks": {"allow_changes": ["train"]}}}
    with caplog.at_level("WARNING", logger="coretrain"):
        resumed = run_steps(tmp_path, 6, config={**base, **allow})  # decays over 6 x 4 = 24 samples
    assert [m["lr"] for m in resumed.metrics] == [0.0, 0.0]
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("schedule: the rate decays")]
    assert warned == [
        "schedule: the rate decays over the run's 24 samples (train_iters 6 x global batch 4), but it resumed at "
        "32 samples consumed (the checkpoint's batch was larger?): its 2 step(s) left train at min_lr 0.0. Set "
        "train.global_batch_size to the checkpoint's batch, or [plugins.schedule] decay_samples"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="coretrain"):
        run_steps(tmp_path / "same", 4, config=base)
        run_steps(tmp_path / "same", 4, config=base)  # a finished run, at its decay's end: no step left
        run_steps(tmp_path / "same", 8, config={**base, **allow})
    assert not [r for r in caplog.records if r.getMessage().startswith("schedule: the rate decays")]


def test_train_samples_counts_whole_global_batches_and_resume_agrees(tmp_path: Path) -> None:
    by_samples = {"train": {"train_samples": 100, "micro_batch_size": 8}, "checkpoint": {"save_interval": 5}}
    whole = run_steps(tmp_path / "whole", 0, config=by_samples)
    assert whole.run.train_iters == 12 and whole.run.state.consumed_samples == 96  # Megatron: 100 // 8
    assert whole.run.scheduler.decay == 100  # the schedule spans the samples, as Megatron's decay_samples default
    stopped = {**by_samples, "train": {**by_samples["train"], "exit_interval": 5}}
    run_steps(tmp_path / "split", 0, config=stopped)
    resumed = run_steps(tmp_path / "split", 0, config=by_samples)
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in whole.metrics if m["step"] > 5]
    assert resumed.run.state.consumed_samples == 96


def test_train_epochs_are_passes_over_the_train_split_in_whole_global_batches_and_resume_agrees(tmp_path: Path) -> None:
    """train.train_epochs = 1.5 over tiny_data's 256 samples is 384 samples: 48 global batches of
    8, each sample read once in the first pass and half of them again in the second; the
    schedule spans those samples, and a resumed run plans the same steps."""
    seen: list[int] = []

    class Reads:
        @hookimpl
        def configure_datasets(self, run: Any) -> None:
            train = run.datasets.train
            run.datasets.train = Counting(train, seen)

    by_epochs = {"train": {"train_epochs": 1.5, "micro_batch_size": 8}, "checkpoint": {"save_interval": 10}}
    whole = run_steps(tmp_path / "whole", 0, config=by_epochs, plugins={"reads": Reads()})
    assert whole.run.train_iters == 48 and whole.run.state.consumed_samples == 384
    assert sorted(seen[:256]) == list(range(256)) and len(set(seen[256:])) == 128  # one pass, then half of one
    assert whole.run.scheduler.decay == 48 * 8
    stopped = {**by_epochs, "train": {**by_epochs["train"], "exit_interval": 20}}
    run_steps(tmp_path / "split", 0, config=stopped)
    resumed = run_steps(tmp_path / "split", 0, config=by_epochs)
    assert resumed.run.train_iters == 48 and resumed.run.state.consumed_samples == 384
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in whole.metrics if m["step"] > 20]


class Counting(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A split that records which of its samples are read, in order."""

    def __init__(self, dataset: Any, seen: list[int]) -> None:
        self.dataset, self.seen = dataset, seen

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.seen.append(index)
        return self.dataset[index]


def test_train_epochs_of_a_stream_is_one_error(tmp_path: Path) -> None:
    config = {
        "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
        "data": {"provider": "workloads:digit_stream"},
        "train": {"train_epochs": 1},
    }
    with pytest.raises(UserError, match=r"train\.train_epochs: the train split is a stream, of no known length"):
        run_steps(tmp_path, 0, config=config)


def test_train_samples_under_a_rampup_counts_the_ramp_steps_one_by_one(tmp_path: Path) -> None:
    train = {"train_samples": 200, "micro_batch_size": 4, "global_batch_size": 16, "log_interval": 1}
    rampup = {"batch-rampup": {"rampup_batch_size": [4, 4, 48]}}
    result = run_steps(tmp_path, 0, config={"train": train}, tables=rampup)
    batches = [int(m["global_batch_size"]) for m in result.metrics]
    assert batches[:4] == [4, 4, 4, 4] and batches[-1] == 16 and len(batches) == result.run.train_iters
    assert result.run.state.consumed_samples == sum(batches) and 200 - 16 < sum(batches) <= 200


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"train_iters": 10, "train_samples": 80}, r"train\.train_samples: set one of train_iters, train_samples and"),
        ({"train_samples": 80, "train_epochs": 2}, r"train\.train_epochs: set one of train_iters, train_samples and"),
        (
            {"train_epochs": 0.01, "micro_batch_size": 8},
            r"train\.train_epochs \(0\.01: 3 samples\) is less than one global batch \(8\)",
        ),
        ({"train_epochs": 0}, r"train\.train_epochs: must be > 0"),
        (
            {"train_samples": 5, "micro_batch_size": 8},
            r"train\.train_samples \(5\) is less than one global batch \(8\)",
        ),
    ],
)
def test_train_samples_mistakes_are_one_error(tmp_path: Path, train: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        run_steps(tmp_path, 0, config={"train": train})


def test_the_old_scheduler_table_still_works_with_one_warning_and_errors_point_at_its_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(movedkeys, "_warned", set())
    old = {"scheduler": {"decay_style": "constant"}, "train": {"log_interval": 1}}
    with caplog.at_level("WARNING", logger="coretrain"):
        metrics = run_steps(tmp_path / "a", 3, config={**old, "optimizer": {"lr": 0.02}}).metrics
        run_steps(tmp_path / "b", 3, config=old)
    assert [m["lr"] for m in metrics] == pytest.approx([0.02] * 3)  # "constant": the schedule plugin read it
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(said) == 1 and "scheduler is deprecated: it is plugins.schedule now" in said[0]
    with pytest.raises(UserError, match=r"config.toml:\d+: plugins\.schedule\.decay_style: .*did you mean 'WSD'"):
        run_steps(tmp_path / "c", 2, config={"scheduler": {"decay_style": "wsd"}})


def test_without_the_schedule_plugin_the_rate_is_optimizer_lr_throughout(tmp_path: Path) -> None:
    config = {"plugins": {"schedule": {"enabled": False}}, "train": {"log_interval": 1}}
    result = run_steps(tmp_path, 4, config=config)
    assert result.exit_code == 0 and "lr" not in result.metrics[-1]
    assert [g["lr"] for g in result.run.optimizer.param_groups] == [0.01] * len(result.run.optimizer.param_groups)


class HalvingSchedule:
    """A user's own schedule: halve the rate at every update; its state is its count."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.updates = optimizer, 0

    def step(self, samples: int) -> None:
        self.updates += 1
        for group in self.optimizer.param_groups:
            group["lr"] = 0.01 * 0.5**self.updates

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = state["updates"]
        self.step(0)
        self.updates -= 1


class Halving:
    @hookimpl
    def configure_scheduler(self, run: Any) -> Any:
        return HalvingSchedule(run.optimizer)


def test_a_plugins_own_schedule_is_stepped_checkpointed_and_resumed(tmp_path: Path) -> None:
    options = {"plugins": {"halving": Halving()}, "autoload": ("evaluation",)}
    first = run_steps(tmp_path, 6, config={"train": {"exit_interval": 3}}, **options)
    assert first.run.scheduler.updates == 3  # type: ignore[attr-defined]
    resumed = run_steps(tmp_path, 6, **options)
    assert resumed.run.scheduler.updates == 6  # type: ignore[attr-defined]
    assert resumed.run.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**6)


class Broken:
    @hookimpl
    def configure_scheduler(self) -> Any:
        return 0.1


def test_a_schedule_without_step_or_state_is_one_error_naming_the_plugin(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"configure_scheduler \(broken\) returned float, which has no step"):
        run_steps(tmp_path, 2, plugins={"broken": Broken()}, autoload=("evaluation",))
