"""The loop's contract, in process: accumulation, updates, vetoes, stops, eval cadence, logging."""

from __future__ import annotations

import math
import random
import sys
from typing import Any

import numpy
import pytest
import torch
from coretrain_backends import LoggingBackend
from helpers_inprocess import build, config, train

from coretrain import hookimpl
from coretrain.errors import UserError
from coretrain.loop import ResolvedHooks
from coretrain.step import StepNumerics
from coretrain.testing import run_steps


class Recorder:
    """Records what the loop hands to plugins."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, float]]] = []
        self.evals: list[int] = []
        self.step_losses: list[float] = []
        self.outcome: str | None = None

    @hookimpl
    def post_step(self, outputs: Any) -> None:
        self.step_losses.append(outputs.loss.item())

    @hookimpl
    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        self.logs.append((step, metrics))

    @hookimpl
    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.evals.append(step)

    @hookimpl
    def on_train_end(self, outcome: str) -> None:
        self.outcome = outcome


def weights(run: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Any, no_autoload: None) -> None:
    big, _ = train(config(tmp_path / "a", train={"micro_batch_size": 16, "global_batch_size": 16}))
    accumulated, _ = train(config(tmp_path / "b", train={"micro_batch_size": 4, "global_batch_size": 16}))
    assert accumulated.micro_batches_per_step == 4
    for a, b in zip(weights(big), weights(accumulated)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert accumulated.state.consumed_samples == 16 * 10


def test_global_batch_must_divide(tmp_path: Any, no_autoload: None) -> None:
    with pytest.raises(UserError, match=r"global_batch_size \(10\) is not a multiple of .*4 × 1 = 4.*decrease_batch"):
        build(config(tmp_path, train={"micro_batch_size": 4, "global_batch_size": 10}))


def test_decrease_batch_size_if_needed_rounds_the_global_batch_down_with_one_warning(
    tmp_path: Any, no_autoload: None, caplog: pytest.LogCaptureFixture
) -> None:
    train_table = {"micro_batch_size": 4, "global_batch_size": 10, "decrease_batch_size_if_needed": True}
    run, code = train(config(tmp_path, train={**train_table, "train_iters": 3}))
    assert code == 0 and run.global_batch_size == 8 and run.state.consumed_samples == 24
    warnings = [r.getMessage() for r in caplog.records if "instead" in r.getMessage()]
    assert warnings == [
        "train.global_batch_size (10) is not a multiple of train.micro_batch_size × data-parallel size "
        "(4 × 1 = 4): training with a global batch of 8 instead"
    ]


def test_logged_loss_is_mean_of_the_interval_and_lr_follows_schedule(tmp_path: Any, no_autoload: None) -> None:
    recorder = Recorder()
    cfg = config(
        tmp_path,
        train={"train_iters": 6, "log_interval": 3},
        scheduler={"warmup_iters": 2, "decay_style": "linear", "min_lr": 0.001},
    )
    run, _ = train(cfg, ("recorder", recorder))
    assert [step for step, _ in recorder.logs] == [3, 6]
    for (_, metrics), chunk in zip(recorder.logs, (recorder.step_losses[:3], recorder.step_losses[3:])):
        assert metrics["loss"] == pytest.approx(sum(chunk) / 3, rel=1e-6)
    assert run.scheduler.lr_at(1) == pytest.approx(0.005)  # warmup 1/2 of 0.01
    assert run.scheduler.lr_at(2) == pytest.approx(0.01)  # warmup's last update reaches the peak
    assert run.scheduler.lr_at(3) == pytest.approx(0.01 - 0.009 / 4)  # Megatron: 1 of 4 decay steps done
    assert run.scheduler.lr_at(6) == pytest.approx(0.001)  # decay_iters = train_iters -> min_lr
    assert recorder.logs[-1][1]["lr"] == pytest.approx(0.001)


def test_cosine_schedule_midpoint(tmp_path: Any, no_autoload: None) -> None:
    run = build(config(tmp_path, train={"train_iters": 11}, scheduler={"decay_style": "cosine", "min_lr": 0.0}))
    assert run.scheduler.lr_at(0) == pytest.approx(0.01)
    assert run.scheduler.lr_at(5.5) == pytest.approx(0.005)
    assert run.scheduler.lr_at(11) == pytest.approx(0.0, abs=1e-12)


class Veto:
    """Skips the update of chosen steps and stops the run at a chosen step."""

    def __init__(self, skip: set[int], stop_at: int | None = None, exit_code: int = 0) -> None:
        self.skip, self.stop_at, self.exit_code = skip, stop_at, exit_code
        self.before: dict[int, list[torch.Tensor]] = {}

    @hookimpl
    def before_update(self, run: Any, step: int) -> None:
        self.before[step] = weights(run)
        if step in self.skip:
            run.control.skip_update("test veto")

    @hookimpl
    def post_step(self, run: Any, step: int, outputs: Any) -> None:
        changed = any(not torch.equal(a, b) for a, b in zip(self.before[step], weights(run)))
        assert changed == (step not in self.skip) and outputs.skipped == (step in self.skip)
        if step == self.stop_at:
            run.control.request_stop("test stop", exit_code=self.exit_code)


def test_a_vetoed_update_leaves_weights_and_schedule_alone(tmp_path: Any, no_autoload: None) -> None:
    run, code = train(config(tmp_path), ("veto", Veto(skip={2, 5})))
    assert code == 0 and run.state.step == 10
    assert run.state.skipped_updates == 2
    assert run.scheduler.position == 8


class Inputs:
    """The first input of every training forward, and each step's outputs."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []
        self.outputs: dict[int, Any] = {}

    @hookimpl
    def on_train_start(self, run: Any) -> None:
        def seen(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if module.training:
                self.inputs.append(args[0].detach().clone())

        run.model.register_forward_pre_hook(seen)

    @hookimpl
    def post_step(self, step: int, outputs: Any) -> None:
        self.outputs[step] = outputs


def test_iterations_to_skip_draw_the_batch_and_run_nothing(tmp_path: Any, no_autoload: None) -> None:
    """Megatron's dummy step: no forward (a batch that crashes the model is stepped over), no
    update, and every later step reads the batch it would have read."""
    plain, skipping = Inputs(), Inputs()
    reference, _ = train(config(tmp_path / "ref", train={"train_iters": 6}), ("inputs", plain))
    guards = {"guards": {"iterations_to_skip": [2, 5]}}
    run, code = train(config(tmp_path / "skip", train={"train_iters": 6}, plugins=guards), ("inputs", skipping))
    assert code == 0 and len(plain.inputs) == 6 and len(skipping.inputs) == 4
    for kept, seen in zip([plain.inputs[i] for i in (0, 2, 3, 5)], skipping.inputs):
        assert torch.equal(kept, seen)
    assert run.state.skipped_updates == 2 and run.state.consumed_samples == reference.state.consumed_samples
    assert [step for step, out in skipping.outputs.items() if out.skipped] == [2, 5]
    assert math.isnan(skipping.outputs[2].loss.item()) and skipping.outputs[2].grad_norm is None
    assert run.scheduler.position == 4  # the schedule advanced by the 4 updates only


def test_the_logged_loss_is_the_mean_over_the_steps_that_updated(tmp_path: Any, no_autoload: None) -> None:
    """A NaN step the guards skipped is left out of the interval's mean and counted instead."""
    recorder = Recorder()
    faulty = {"provider": "faulty_models:make_faulty", "options": {"nan_at": [2]}}
    cfg = config(tmp_path, model=faulty, train={"train_iters": 6, "log_interval": 3}, plugins={"guards": {}})
    run, code = train(cfg, ("recorder", recorder))
    assert code == 0 and math.isnan(recorder.step_losses[1])
    (_, first), (_, second) = recorder.logs
    assert first["loss"] == pytest.approx((recorder.step_losses[0] + recorder.step_losses[2]) / 2, rel=1e-6)
    assert (first["skipped_steps"], second["skipped_steps"]) == (1.0, 0.0)
    assert second["loss"] == pytest.approx(sum(recorder.step_losses[3:]) / 3, rel=1e-6)
    assert run.state.skipped_updates == 1


def test_an_interval_without_an_update_logs_no_loss(tmp_path: Any, no_autoload: None) -> None:
    recorder = Recorder()
    train(config(tmp_path, train={"train_iters": 6, "log_interval": 3}), ("veto", Veto({1, 2, 3})), ("r", recorder))
    (_, first), (_, second) = recorder.logs
    assert "loss" not in first and "grad_norm" not in first and first["skipped_steps"] == 3.0
    assert second["skipped_steps"] == 0.0 and math.isfinite(second["loss"])


def test_a_resume_inside_an_interval_keeps_its_skipped_steps_out_of_the_mean(tmp_path: Any, no_autoload: None) -> None:
    whole, resumed = Recorder(), Recorder()
    sections = {"train": {"train_iters": 6, "log_interval": 3}, "checkpoint": {"save_interval": 2}}
    train(config(tmp_path / "whole", **sections), ("veto", Veto({1})), ("r", whole))
    stopping = Veto({1}, stop_at=2)
    train(config(tmp_path / "resumed", **sections), ("veto", stopping), ("r", Recorder()))
    train(config(tmp_path / "resumed", **sections), ("veto", Veto(set())), ("r", resumed))
    assert resumed.logs[0][0] == 3 and resumed.logs[0][1]["skipped_steps"] == 1.0
    assert resumed.logs[0][1]["loss"] == pytest.approx(whole.logs[0][1]["loss"], rel=1e-6)


def test_a_plugin_stop_request_ends_the_run_with_a_checkpoint_and_its_exit_code(
    tmp_path: Any, no_autoload: None
) -> None:
    recorder = Recorder()
    run, code = train(config(tmp_path), ("veto", Veto(skip=set(), stop_at=4, exit_code=3)), ("recorder", recorder))
    assert (run.state.step, code, recorder.outcome) == (4, 3, "stopped")
    assert (tmp_path / "out" / "checkpoints" / "step_00000004").is_dir()


@pytest.mark.parametrize(
    ("eval_interval", "eval_iters", "expected"),
    [
        (None, 2, [10]),  # unset interval: validate only after training
        (4, 2, [4, 8, 10]),  # every 4 steps, and once more at the end
        (5, 2, [5, 10]),  # the end coincides with an interval: not twice
        (4, 0, []),  # eval_iters = 0 disables validation
    ],
)
def test_eval_cadence(
    tmp_path: Any, no_autoload: None, eval_interval: int | None, eval_iters: int, expected: list[int]
) -> None:
    recorder = Recorder()
    train_cfg: dict[str, Any] = {"eval_iters": eval_iters}
    if eval_interval:
        train_cfg["eval_interval"] = eval_interval
    train(config(tmp_path, train=train_cfg), ("recorder", recorder))
    assert recorder.evals == expected


def test_exit_interval_then_resume_reproduces_the_uninterrupted_run(tmp_path: Any, no_autoload: None) -> None:
    model_opts = {"options": {"dropout": 0.1}}  # dropout: the RNG state must be restored too
    full, _ = train(config(tmp_path / "full", model=model_opts))
    interrupted, code = train(config(tmp_path / "split", model=model_opts, train={"exit_interval": 4}))
    assert code == 0 and interrupted.state.step == 4
    resumed, _ = train(config(tmp_path / "split", model=model_opts))
    assert resumed.state.step == 10 and resumed.state.consumed_samples == full.state.consumed_samples
    for a, b in zip(weights(full), weights(resumed)):
        assert torch.equal(a, b)


class DrawsOnFirstCall:
    """Draws from every random stream the first time each host-side hook runs in a process, as a
    plugin that imports a library lazily does (rich draws a random id when imported)."""

    def __init__(self) -> None:
        self.drawn: set[str] = set()

    def _draw(self, hook: str) -> None:
        if hook not in self.drawn:
            self.drawn.add(hook)
            random.getrandbits(24), numpy.random.rand(), torch.rand(1)

    @hookimpl
    def on_train_start(self) -> None:
        self._draw("on_train_start")

    @hookimpl
    def on_resume(self) -> None:
        self._draw("on_resume")

    @hookimpl
    def on_log(self) -> None:
        self._draw("on_log")

    @hookimpl
    def on_eval(self) -> None:
        self._draw("on_eval")

    @hookimpl
    def on_checkpoint(self) -> None:
        self._draw("on_checkpoint")


@pytest.mark.parametrize("workers", [0, 2])
def test_plugins_and_loaders_drawing_at_start_leave_a_resumed_run_on_the_same_random_numbers(
    tmp_path: Any, no_autoload: None, workers: int
) -> None:
    """A resumed process starts its plugins and loaders at another step than the uninterrupted run
    did: what they draw must not move the streams dropout draws from (every resume diverged)."""
    sections = {
        "model": {"options": {"dropout": 0.1}},
        "data": {"num_workers": workers},
        "train": {"eval_iters": 1, "eval_interval": 3},
    }
    full, _ = train(config(tmp_path / "full", **sections), ("draws", DrawsOnFirstCall()))
    stop = {**sections, "train": {**sections["train"], "exit_interval": 4}}
    train(config(tmp_path / "split", **stop), ("draws", DrawsOnFirstCall()))
    resumed, _ = train(config(tmp_path / "split", **sections), ("draws", DrawsOnFirstCall()))
    assert resumed.state.step == 10
    for a, b in zip(weights(full), weights(resumed)):
        assert torch.equal(a, b)


def test_hooks_nobody_implements_are_never_called(tmp_path: Any) -> None:
    """Through pluggy's own call monitoring, over a whole run with resume: every hook the run
    called has an implementation (a hook nobody implements costs nothing, not even a call)."""

    class OnlyPostStep:
        @hookimpl
        def post_step(self) -> None:
            pass

    stop = {"train": {"exit_interval": 2}}
    first = run_steps(tmp_path, 4, config=stop, plugins={"mine": OnlyPostStep()}, autoload=())
    resumed = run_steps(tmp_path, 4, plugins={"mine": OnlyPostStep()}, autoload=())
    for result in (first, resumed):
        called = set(result.hooks())
        assert {"post_step", "on_log"} <= called  # on_log: the harness's metrics observer
        assert not [hook for hook in called if not result.run.plugins.implemented(hook)]
    hooks = ResolvedHooks(resumed.run)
    assert (
        hooks.pre_step is None and StepNumerics(resumed.run).before_update is None and hooks.num_micro_batches is None
    )


def test_import_path_provider_options_are_checked(tmp_path: Any, no_autoload: None) -> None:
    with pytest.raises(UserError, match="model.options: options do not fit .*tiny_model"):
        build(config(tmp_path, model={"options": {"widht": 3}}))


def test_training_reduces_the_loss(tmp_path: Any, no_autoload: None) -> None:
    recorder = Recorder()
    train(config(tmp_path, train={"train_iters": 60, "log_interval": 10}), ("recorder", recorder))
    first, last = recorder.logs[0][1]["loss"], recorder.logs[-1][1]["loss"]
    assert math.isfinite(last) and last < 0.5 * first


def test_exit_duration_stops_early_with_a_checkpoint(tmp_path: Any, no_autoload: None) -> None:
    recorder = Recorder()
    run, code = train(
        config(tmp_path, train={"train_iters": 100000, "exit_duration_in_mins": 0.002}), ("recorder", recorder)
    )
    assert code == 0 and recorder.outcome == "exit_duration" and 0 < run.state.step < 100000
    assert (tmp_path / "out" / "checkpoints" / f"step_{run.state.step:08d}").is_dir()


def test_skip_train_only_validates_the_loaded_checkpoint(tmp_path: Any, no_autoload: None) -> None:
    train(config(tmp_path, train={"train_iters": 4}))
    recorder = Recorder()
    run, _ = train(
        config(tmp_path, train={"train_iters": 8, "skip_train": True, "eval_iters": 2}), ("recorder", recorder)
    )
    assert run.state.step == 4 and recorder.evals == [4] and recorder.logs == []


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_resumes_exactly(tmp_path: Any, no_autoload: None, precision: str) -> None:
    recorder = Recorder()
    full, _ = train(config(tmp_path / "full", run={"precision": precision}, train={"train_iters": 40}), ("r", recorder))
    assert recorder.logs[-1][1]["loss"] < 0.5 * recorder.logs[0][1]["loss"]
    assert (full.grad_scaler is not None) == (precision == "fp16")
    if precision == "fp16":  # the scale is logged, as Megatron's loss-scale is
        assert recorder.logs[-1][1]["loss_scale"] == full.grad_scaler.get_scale()
    else:
        assert "loss_scale" not in recorder.logs[-1][1]
    train(config(tmp_path / "split", run={"precision": precision}, train={"train_iters": 40, "exit_interval": 15}))
    resumed, _ = train(config(tmp_path / "split", run={"precision": precision}, train={"train_iters": 40}))
    if precision == "fp16":
        assert resumed.grad_scaler.get_scale() == full.grad_scaler.get_scale()  # scaler state restored
    for a, b in zip(weights(full), weights(resumed)):
        assert torch.equal(a, b)


class Overflow:
    """Makes the gradients of one step infinite, as an fp16 overflow would."""

    @hookimpl
    def before_update(self, run: Any, step: int) -> None:
        if step == 3:
            next(run.model.parameters()).grad.fill_(float("inf"))


def test_fp16_overflow_skips_the_update_and_counts_it(tmp_path: Any, no_autoload: None) -> None:
    clean, _ = train(config(tmp_path / "a", run={"precision": "fp16"}, train={"train_iters": 6}))
    run, _ = train(
        config(tmp_path / "b", run={"precision": "fp16"}, train={"train_iters": 6}), ("overflow", Overflow())
    )
    # the scaler starts at 2**16 and may back off on its own first; the injected overflow adds one
    assert run.state.skipped_updates == clean.state.skipped_updates + 1
    assert run.scheduler.position == 6 - run.state.skipped_updates
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


class RecordingBackend(LoggingBackend):
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.outcome: str | None = None

    def open(self, run: Any) -> None:
        self.rows.clear()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append((step, dict(metrics)))

    def close(self, outcome: str) -> None:
        self.outcome = outcome


class AddsAMetric:
    @hookimpl
    def on_log(self, metrics: dict[str, float]) -> None:
        metrics["added_by_a_plain_plugin"] = 1.0


def test_a_logging_backend_sees_what_every_other_plugin_added_and_is_closed(tmp_path: Any, no_autoload: None) -> None:
    backend = RecordingBackend()
    # registered after the backend, a plain plugin would run before it anyway (pluggy calls the
    # newest first); registered before it, only trylast keeps the backend last
    _, code = train(
        config(tmp_path, train={"train_iters": 4, "log_interval": 2}), ("adder", AddsAMetric()), ("backend", backend)
    )
    assert code == 0 and backend.outcome == "completed"
    assert [step for step, _ in backend.rows] == [2, 4]
    assert all(metrics["added_by_a_plain_plugin"] == 1.0 for _, metrics in backend.rows)


def test_the_loss_is_found_in_every_shape_a_model_returns_it() -> None:
    """A tensor; a dict or an object with ``loss`` (the other single values logged, numbers the model
    took off the device too, not a flag); a namedtuple
    by its names; a tuple by its one single value, nanoGPT's ``(logits, loss)`` or transformers'
    ``(loss, logits)``; two unnamed single values are one error."""
    from collections import namedtuple

    from coretrain.outputs import split_output

    loss, accuracy, logits = torch.tensor(0.5), torch.tensor(0.75), torch.zeros(4, 3)
    named = namedtuple("Named", ["logits", "loss", "accuracy"])
    shapes = [
        (loss, {}),
        ({"loss": loss, "accuracy": accuracy, "logits": logits}, {"accuracy": accuracy}),
        ({"loss": loss, "accuracy": 0.75, "correct": 3, "done": True}, {"accuracy": accuracy, "correct": 3.0}),
        (named(logits, loss, accuracy), {"accuracy": accuracy}),
        ((logits, loss), {}),
        ((loss, logits, None), {}),
        ([logits, loss], {}),
    ]
    for output, values in shapes:
        found, named_values = split_output(output)
        assert found is loss and named_values == values, output
    with pytest.raises(UserError, match="a tuple holding 2 single values, so which is the loss is unclear"):
        split_output((loss, accuracy))
    with pytest.raises(UserError, match="the model returned a tuple without a loss"):
        split_output((logits, None))


def handed_over_in_eval_mode(dropout: float) -> torch.nn.Module:
    """A model provider that returns its model in eval mode, as ``from_pretrained`` does."""
    from coretrain.testing import tiny_model

    return tiny_model(dropout=dropout).eval()


sys.modules.setdefault("test_loop", sys.modules[__name__])  # its provider, by this name


def test_a_model_handed_over_in_eval_mode_trains_with_its_dropout(tmp_path: Any, no_autoload: None) -> None:
    """``from_pretrained`` returns a model in eval mode; the steps train it in train mode, as the
    Trainer's and Lightning's do (its dropout drops, a batch norm takes the batch's statistics):
    the same losses as the model handed over in train mode, not those of the model without dropout."""
    options = {"dropout": 0.5}
    handed = {"model": {"provider": "test_loop:handed_over_in_eval_mode", "options": options}}
    training = {"model": {"provider": "coretrain.testing:tiny_model", "options": options}}
    without = {"model": {"provider": "coretrain.testing:tiny_model", "options": {"dropout": 0.0}}}
    losses = {
        name: [row["loss"] for row in run_steps(tmp_path / name, steps=4, config=sections).metrics]
        for name, sections in {"handed": handed, "training": training, "without": without}.items()
    }
    assert losses["handed"] == losses["training"] != losses["without"]
    assert len(losses["handed"]) == 2
