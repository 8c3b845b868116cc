"""First-party plugins tested as a third party tests theirs: in-process runs of
coretrain.testing, each plugin enabled by its TOML table."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from coretrain import UserError, hookimpl
from coretrain.testing import run_steps


class GCWatcher:
    def __init__(self) -> None:
        self.enabled_during: set[bool] = set()

    @hookimpl
    def pre_step(self) -> None:
        self.enabled_during.add(gc.isenabled())


def test_gc_turns_automatic_collection_off_collects_on_schedule_and_restores(tmp_path: Path) -> None:
    watcher = GCWatcher()
    result = run_steps(
        tmp_path,
        steps=10,
        tables={"gc": {"interval": 4}},
        plugins={"watcher": watcher},
        config={"train": {"eval_interval": 5, "eval_iters": 1}},
    )
    assert result.exit_code == 0 and gc.isenabled()
    assert watcher.enabled_during == {False}
    # at start, steps 4 and 8, before the evals at 5 and 10, after each eval (5, 10)
    assert result.run.plugins.get("gc").collections == 1 + 2 + 2 + 2  # type: ignore[union-attr]


def test_optimizer_overrides_set_groups_and_per_group_schedules(tmp_path: Path) -> None:
    rules = [{"pattern": "net.0.*", "lr_mult": 0.5}, {"pattern": "net.3.weight", "max_lr": 0.02, "min_lr": 0.002}]
    result = run_steps(
        tmp_path,
        steps=5,
        tables={"optimizer-overrides": {"rules": rules}},
        config={"scheduler": {"decay_style": "linear", "min_lr": 0.001}},
    )
    run = result.run
    names = {id(p): n for n, p in run.model.named_parameters()}
    groups = {tuple(sorted(names[id(p)] for p in g["params"])): g for g in run.optimizer.param_groups}
    assert groups[("net.0.weight",)]["lr_mult"] == 0.5 and groups[("net.0.weight",)]["weight_decay"] == 0.01
    assert groups[("net.0.bias",)]["weight_decay"] == 0.0 and groups[("net.0.bias",)]["lr_mult"] == 0.5
    assert groups[("net.3.bias",)]["weight_decay"] == 0.0
    # after the last update the schedule sits at each group's own min_lr (times its multiplier)
    assert groups[("net.3.weight",)]["lr"] == pytest.approx(0.002)
    assert groups[("net.0.weight",)]["lr"] == pytest.approx(0.5 * 0.001)


def decayed(run: Any) -> dict[str, float]:
    names = {id(p): n for n, p in run.model.named_parameters()}
    return {names[id(p)]: group["weight_decay"] for group in run.optimizer.param_groups for p in group["params"]}


def test_by_default_biases_and_norms_get_no_weight_decay_as_in_megatron_bridge(tmp_path: Path) -> None:
    """On by default: the gpt model's biases, norm gains (1-D) get none; matrices and embeddings get
    optimizer.weight_decay, also along a weight-decay schedule; ``enabled = false`` decays all."""
    gpt = {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "bias": True}}
    data = {"provider": "text-bytes", "options": {"seq_length": 16}}
    schedule = {"start_weight_decay": 0.01, "end_weight_decay": 0.1, "weight_decay_incr_style": "linear"}
    settings = {"model": gpt, "data": data, "scheduler": schedule}
    by_name = decayed(run_steps(tmp_path / "on", 3, config=settings, autoload=True).run)
    assert {name for name, decay in by_name.items() if decay == 0.0} == {
        name for name in by_name if name.endswith(".bias") or "ln" in name
    }
    assert any(name.endswith(".bias") for name in by_name) and by_name["wte.weight"] == pytest.approx(0.1)
    off = {"optimizer-overrides": {"enabled": False}}
    everything = decayed(run_steps(tmp_path / "off", 3, config={**settings, "plugins": off}, autoload=True).run)
    assert everything.keys() == by_name.keys() and all(v == pytest.approx(0.1) for v in everything.values())


def test_decoupled_lr_gives_the_embedding_and_the_output_layer_their_own_schedule(tmp_path: Path) -> None:
    """Megatron's decoupled_lr / decoupled_min_lr: the gpt model's token embedding (tied to its
    output layer) peaks at decoupled_lr and ends at decoupled_min_lr; the rest follows
    optimizer.lr to scheduler.min_lr. A model that names neither layer is one error."""
    gpt = {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}}
    data = {"provider": "text-bytes", "options": {"seq_length": 16}}
    schedule = {"decay_style": "linear", "min_lr": 1e-4, "warmup_iters": 2}
    tables = {"optimizer-overrides": {"decoupled_lr": 0.05, "decoupled_min_lr": 0.005}}
    seen: list[dict[str, float]] = []

    class Rates:
        @hookimpl
        def before_update(self, run: Any) -> None:
            names = {id(p): n for n, p in run.model.named_parameters()}
            seen.append({names[id(p)]: g["lr"] for g in run.optimizer.param_groups for p in g["params"]})

    settings = {"model": gpt, "data": data, "scheduler": schedule, "optimizer": {"lr": 1e-3}}
    run_steps(tmp_path / "on", 6, config=settings, tables=tables, autoload=True, plugins={"rates": Rates()})
    assert seen[1]["wte.weight"] == pytest.approx(0.05) and seen[1]["blocks.0.mlp.fc.weight"] == pytest.approx(1e-3)
    assert seen[-1]["wte.weight"] == pytest.approx(0.005) and seen[-1]["blocks.0.mlp.fc.weight"] == pytest.approx(1e-4)
    assert "lm_head.weight" not in seen[0]  # tied: one parameter, under its first name
    with pytest.raises(UserError, match="names no input embedding or output layer"):
        run_steps(tmp_path / "plain", 2, tables={"optimizer-overrides": {"decoupled_lr": 0.05}})
    with pytest.raises(UserError, match="set decoupled_lr too"):
        run_steps(tmp_path / "min", 2, tables={"optimizer-overrides": {"decoupled_min_lr": 0.05}})


def test_adafactor_trains_and_resumes_by_name(tmp_path: Path) -> None:
    """optimizer.name = "adafactor" is torch's Adafactor (factored second moments: a row and a
    column vector for each matrix, no first moment); it trains, and a resumed run continues as
    the uninterrupted one."""
    settings = {"optimizer": {"name": "adafactor", "lr": 1e-2}, "train": {"log_interval": 1}}
    whole = run_steps(tmp_path / "whole", 8, config=settings)
    optimizer = whole.run.optimizer
    assert isinstance(optimizer, torch.optim.Adafactor)
    matrix = next(p for p in whole.run.model.parameters() if p.ndim == 2)
    assert {"row_var", "col_var"} <= set(optimizer.state[matrix]) and "exp_avg" not in optimizer.state[matrix]
    losses = [row["loss"] for row in whole.metrics]
    assert losses[-1] < losses[0]
    run_steps(tmp_path / "split", 8, config={**settings, "train": {"log_interval": 1, "exit_interval": 4}})
    resumed = run_steps(tmp_path / "split", 8, config=settings)
    assert [row["loss"] for row in resumed.metrics][-4:] == losses[-4:]


def test_an_optimizer_class_by_import_path_gets_the_groups_lr_weight_decay_and_its_options(tmp_path: Path) -> None:
    """optimizer.name = "torch.optim:RMSprop" (or a library's Lion): built on optimizer-overrides'
    groups (no decay on biases) with lr, weight_decay and optimizer.options; a class without
    weight_decay (Rprop) gets none; options go to a built-in too (SGD's nesterov); an option the
    class does not take is one error naming it and what it takes."""
    rmsprop = {"name": "torch.optim:RMSprop", "lr": 1e-3, "weight_decay": 0.05, "options": {"alpha": 0.9}}
    result = run_steps(tmp_path / "rmsprop", 6, config={"optimizer": rmsprop, "train": {"log_interval": 1}})
    optimizer = result.run.optimizer
    assert isinstance(optimizer, torch.optim.RMSprop) and optimizer.defaults["alpha"] == 0.9
    assert sorted(group["weight_decay"] for group in optimizer.param_groups) == [0.0, 0.05]
    assert all(
        "square_avg" in optimizer.state[p] for group in optimizer.param_groups for p in group["params"]
    )  # it stepped
    rprop = run_steps(tmp_path / "rprop", 2, config={"optimizer": {"name": "torch.optim:Rprop", "lr": 1e-3}})
    assert isinstance(rprop.run.optimizer, torch.optim.Rprop) and "weight_decay" not in rprop.run.optimizer.defaults
    nesterov = {"name": "sgd", "momentum": 0.9, "options": {"nesterov": True}}
    assert run_steps(tmp_path / "sgd", 2, config={"optimizer": nesterov}).run.optimizer.defaults["nesterov"] is True
    with pytest.raises(UserError, match=r"optimizer.options: options do not fit torch.optim.rmsprop.RMSprop: .*alph"):
        run_steps(tmp_path / "bad", 2, config={"optimizer": {**rmsprop, "options": {"alph": 0.9}}})
    with pytest.raises(UserError, match="optimizer.name: cannot import 'torch.optim:RMSProp'"):
        run_steps(tmp_path / "missing", 2, config={"optimizer": {"name": "torch.optim:RMSProp"}})


def test_optimizer_overrides_pattern_that_matches_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="pattern 'encoder.*' matches no parameter"):
        run_steps(tmp_path, tables={"optimizer-overrides": {"rules": [{"pattern": "encoder.*"}]}})


class BatchLog:
    def __init__(self) -> None:
        self.batches: list[int] = []

    @hookimpl
    def post_step(self, outputs: object) -> None:
        self.batches.append(outputs.global_batch_size)  # type: ignore[attr-defined]


def test_batch_rampup_follows_megatrons_formula_and_the_schedule_counts_samples(tmp_path: Path) -> None:
    seen = BatchLog()
    result = run_steps(
        tmp_path,
        steps=8,
        tables={"batch-rampup": {"rampup_batch_size": [4, 4, 48]}},
        plugins={"seen": seen},
        config={
            "train": {"micro_batch_size": 4, "global_batch_size": 16},
            "scheduler": {"warmup_iters": 4, "decay_style": "constant"},
        },
    )
    # 3 increments of 4 over 48 samples: +4 per 16 samples consumed (0,4,8,12 | 16,24 | 32,44 | >48)
    assert seen.batches == [4, 4, 4, 4, 8, 8, 12, 12]
    assert result.run.state.consumed_samples == sum(seen.batches) == 56
    assert result.run.scheduler.position == 56 / 16  # 3.5 full batches: still warming up
    assert result.run.scheduler.last_lr == pytest.approx(0.01 * 3.5 / 4)
    assert [m["global_batch_size"] for m in result.metrics] == [4.0, 4.0, 8.0, 12.0]  # what on_log reports


def test_batch_rampup_rounds_down_when_allowed_and_counts_what_it_left_out(tmp_path: Path) -> None:
    settings = {"train": {"micro_batch_size": 4, "global_batch_size": 16}}
    with pytest.raises(UserError, match="wants a global batch of 6"):
        run_steps(tmp_path / "a", steps=6, config=settings, tables={"batch-rampup": {"rampup_batch_size": [6, 5, 20]}})
    seen = BatchLog()
    table = {"rampup_batch_size": [6, 5, 20], "decrease_batch_size_if_needed": True}
    result = run_steps(tmp_path / "b", steps=6, config=settings, tables={"batch-rampup": table}, plugins={"seen": seen})
    # wants 6, 6, 6 (rounded to 4), 11 (to 8), then 16
    assert seen.batches == [4, 4, 4, 8, 16, 16]
    assert result.run.plugins.get("batch-rampup").samples_left_out == 2 + 2 + 2 + 3  # type: ignore[union-attr]


def test_only_plugins_that_declare_a_veto_make_the_ranks_agree_on_updates(tmp_path: Path) -> None:
    """memory and model-stats implement before_update only to watch: no per-step agreement."""
    result = run_steps(tmp_path, steps=1, tables={"guards": {}, "memory": {}, "model-stats": {}})
    assert {"guards", "memory", "model-stats"} <= set(result.run.plugins.implementers("before_update"))
    assert result.run.plugins.vetoing() == ["guards"]


def test_timers_take_megatrons_switches_for_levels_ranks_units_and_memory(tmp_path: Path) -> None:
    config = {"train": {"log_interval": 3, "eval_interval": 3}}

    def last(name: str, **timers: Any) -> dict[str, float]:
        return [
            m for m in run_steps(tmp_path / name, 3, tables={"timers": timers}, config=config).metrics if "loss" in m
        ][-1]

    step_only = last("level0", timing_log_level=0)
    assert "time/data" not in step_only and "time/forward_backward" not in step_only and step_only["time/step"] > 0
    # the interval's wall time holds its steps, 2 and 3 (the first warms up), and any evaluation
    assert 2 * step_only["time/step"] <= step_only["time/total"]
    assert step_only["batches_per_second"] * step_only["iteration_time"] == pytest.approx(1)
    minmax = last("minmax", timing_log_option="minmax")
    assert minmax["time/data_min"] == minmax["time/data"] > 0  # one rank: its fastest is its slowest
    every = last("all", timing_log_option="all", time_unit="ms")
    assert every["time/optimizer/rank0"] == every["time/optimizer"] > 0
    assert every["time/step"] == pytest.approx(every["iteration_time"] * 1e3)  # the time/* values in ms
    picked = last("memory", memory_keys={"rss_bytes.peak": "mem/peak_gb"})
    assert picked["mem/peak_gb"] > 0.01 and not any(name.startswith("memory/") for name in picked)
    with pytest.raises(UserError, match=r"memory_keys: \['reserved_bytes.all.peak'\] are not memory statistics on cpu"):
        run_steps(tmp_path / "bad", 3, tables={"timers": {"memory_keys": {"reserved_bytes.all.peak": "reserved"}}})


def test_timers_report_where_the_time_went_from_the_phase_marks(tmp_path: Path) -> None:
    config = {"train": {"log_interval": 3, "eval_interval": 3}, "checkpoint": {"save_interval": 3}}
    result = run_steps(tmp_path / "on", steps=6, tables={"timers": {}}, config=config)
    logged = [m for m in result.metrics if "loss" in m]
    assert [m["step"] for m in logged] == [3, 6]
    for metrics in logged:
        assert 0 < metrics["time/data"] and 0 < metrics["time/forward_backward"] and 0 < metrics["time/optimizer"]
        assert (
            metrics["time/data"] + metrics["time/forward_backward"] + metrics["time/optimizer"] <= metrics["time/step"]
        )
        assert metrics["time/data_max"] == metrics["time/data"]
        assert metrics["iteration_time"] == metrics["time/step"] and metrics["samples_per_second"] > 0
        assert metrics["samples_per_second"] * metrics["iteration_time"] == pytest.approx(8)  # samples per step
    # step 3's evaluation and checkpoint came after its log: they are counted in the next interval
    assert logged[0]["time/eval"] == 0 and logged[0]["time/checkpoint"] == 0
    assert logged[1]["time/eval"] > 0 and logged[1]["time/checkpoint"] > 0
    off = run_steps(tmp_path / "off", steps=3, config=config)
    assert not any(name.startswith("time/") or name.endswith("_per_second") for name in off.metrics[-1])
    assert {"global_batch_size", "consumed_samples"} <= set(off.metrics[-1])  # the run's counters are the core's


def test_the_start_line_says_how_the_batch_is_made_the_precision_and_the_threads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coretrain")  # the level `coretrain run` sets
    settings = {"train": {"micro_batch_size": 2, "global_batch_size": 8}, "plugins": {"progress": {"plain": True}}}
    run_steps(tmp_path, 2, config=settings, autoload=("progress",))
    threads = torch.get_num_threads()
    out = capsys.readouterr().out
    assert (
        "global batch 8 (micro 2 × 4 accumulation × 1 data-parallel), 1 rank(s) on cpu, fp32, "
        f"{threads} thread(s)" in out
    )
    size = out.split(" parameters, global batch")[0].rsplit(": ", 1)[-1]
    assert size != "0.00M" and int(size.replace(",", "")) > 0  # the tiny model's own count, not "0.00M"


def test_a_models_size_reads_as_a_count_for_small_models_and_in_millions_or_billions_above() -> None:
    from coretrain_progress import parameter_count

    assert [parameter_count(n) for n in (161, 48_513, 99_999)] == ["161", "48,513", "99,999"]
    assert [parameter_count(n) for n in (100_000, 840_123, 124_439_808)] == ["0.10M", "0.84M", "124.44M"]
    assert parameter_count(1_235_814_400) == "1.24B"


def test_a_resumed_rampup_run_validates_on_the_uninterrupted_runs_samples(tmp_path: Path) -> None:
    """Validation reads the configured global batch (Megatron's: it does not ramp), so which
    samples it reads never depends on the batch of the step it runs at: stopped at 8 and resumed,
    the run logs the uninterrupted valid/loss (and loss) at every evaluation."""
    from coretrain.testing import stop_and_resume

    settings = {
        "train": {"micro_batch_size": 4, "global_batch_size": 16, "eval_interval": 4, "eval_iters": 2},
        "checkpoint": {"save_interval": 4},
    }
    tables = {"batch-rampup": {"rampup_batch_size": [4, 4, 96]}}
    whole = run_steps(tmp_path / "whole", steps=16, config=settings, tables=tables)
    _, resumed = stop_and_resume(tmp_path / "resumed", stop_at=8, steps=16, config=settings, tables=tables)
    expected = [(m["step"], m["valid/loss"]) for m in whole.evals if m["step"] in (4, 8, 12, 16)]
    after = [(m["step"], m["valid/loss"]) for m in resumed.evals if m["step"] in (12, 16)]
    assert len(expected) == 4 and after == expected[2:]  # the same floats
    trained = {m["step"]: m["loss"] for m in whole.metrics}
    assert all(trained[m["step"]] == m["loss"] for m in resumed.metrics) and resumed.metrics


def test_an_eta_beyond_what_a_timedelta_holds_is_said_not_raised() -> None:
    from coretrain_progress import eta

    assert eta(3725) == "1:02:05" and eta(-5) == "0:00:00"
    assert eta(1e30) == eta(float("inf")) == eta(float("nan")) == "over 100 years"


def test_throughput_and_flops_count_only_the_steps_that_ran(tmp_path: Path, faults: Any) -> None:
    """Steps skipped before they ran (their batch drawn, nothing computed) add no samples to the
    interval's rate, so neither to tokens/s, TFLOP/s nor MFU: rate × seconds per step × steps =
    the samples of the steps that ran."""
    skips = [faults.SkipStep(rank=0, at_step=step) for step in (5, 6, 7)]
    config = {"train": {"log_interval": 4}}
    result = run_steps(
        tmp_path, steps=8, config=config, tables={"timers": {}}, plugins={f"skip{i}": s for i, s in enumerate(skips)}
    )
    by_step = {m["step"]: m for m in result.metrics}
    for step, ran in ((4, 4), (8, 1)):
        rate, per_step = by_step[step]["samples_per_second"], by_step[step]["iteration_time"]
        assert rate * per_step * 4 == pytest.approx(ran * 8, rel=1e-6), step  # 8 samples a step
    assert by_step[8]["skipped_steps"] == 3


def test_skip_train_metrics_log_keeps_training_metrics_from_every_backend_and_the_console(tmp_path: Path) -> None:
    """Megatron-Bridge's switch: metrics.jsonl holds the evaluations alone, no progress line is
    printed; the interval still runs (its NaN check included), as on_log still sees the metrics."""
    from conftest import metrics_rows, run_here

    from coretrain.testing import tiny_config, write_config

    train = {"micro_batch_size": 8, "train_iters": 6, "log_interval": 2, "eval_interval": 3, "eval_iters": 1}
    train["skip_train_metrics_log"] = True
    config = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", train=train))
    job = run_here("run", str(config), cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    rows = metrics_rows(tmp_path / "out")
    assert [row["step"] for row in rows] == [3, 6] and all("valid/loss" in row and "loss" not in row for row in rows)
    said = job.stdout + job.stderr
    assert "step 2/6" not in said and "step 3: valid loss" in said
    shown = run_here(
        "run",
        str(config),
        "--set",
        "train.skip_train_metrics_log=false",
        "--set",
        'checkpoint.resume="never"',
        cwd=tmp_path,
    )
    assert "step 2/6 | loss" in shown.stdout + shown.stderr  # the same run without the switch shows them
