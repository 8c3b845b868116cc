"""The contract a third-party plugin builds on: the testing harness, wrappers on every hook,
the hook API version, on_train_end on every way a run ends."""

from __future__ import annotations

import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
from attrs import define, field

from coretrain import HOOK_API, Every, Run, UserError, hookimpl, hookspec
from coretrain.errors import PluginError
from coretrain.hookspecs import HookSpecs
from coretrain.pluginmanager import Plugins
from coretrain.testing import BEHAVIOUR, Result, run_steps, run_until_signal, stop_and_resume

SPECS = sorted(caller.name for caller in Plugins().manager.hook.__dict__.values() if caller.has_spec())
"""Every hook: the core's contract and those the installed plugin distributions add."""


@define
class Counter:
    """A small plugin: counts steps, logs its count, keeps it across resume."""

    every: int = 1
    steps: int = 0
    ends: list[str] = field(factory=list)
    signals: list[int] = field(factory=list)

    @hookimpl
    def post_step(self, step: int) -> None:
        self.steps += 1

    @hookimpl
    def on_log(self, run: Run, metrics: dict[str, float]) -> None:
        metrics["counter/steps"] = float(self.steps)

    @hookimpl
    def on_checkpoint(self) -> dict[str, Any]:
        return {"steps": self.steps}

    @hookimpl
    def on_resume(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))

    @hookimpl
    def on_signal(self, signum: int) -> None:
        self.signals.append(signum)

    @hookimpl
    def on_train_end(self, outcome: str) -> None:
        self.ends.append(outcome)


def test_run_steps_returns_the_metrics_and_every_hook_call(tmp_path: Path) -> None:
    counter = Counter()
    result = run_steps(tmp_path, steps=6, plugins={"counter": counter})
    assert result.exit_code == 0
    assert [m["step"] for m in result.metrics] == [2, 4, 6]
    assert [m["counter/steps"] for m in result.metrics] == [2.0, 4.0, 6.0]  # what the plugin added
    assert result.metrics[-1]["loss"] < result.metrics[0]["loss"]  # the tiny workload learns
    assert result.hooks("post_step") == [1, 2, 3, 4, 5, 6]
    order = result.hooks()  # hooks no plugin implements are never called (before_update here)
    assert order[:4] == ["provide_datasets", "configure_datasets", "on_datasets", "provide_model"]  # built-ins
    assert "before_update" not in order
    assert order.index("post_step") < order.index("on_log") and order[-1] == "on_train_end"
    assert counter.ends == ["completed"]
    assert result.evals and result.evals[-1]["step"] == 6  # the final validation


def test_stop_and_resume_hands_each_plugin_its_state(tmp_path: Path) -> None:
    first, second = stop_and_resume(tmp_path, stop_at=4, steps=8, plugins={"counter": Counter()})
    assert first.exit_code == 0 and first.run.state.step == 4
    assert second.run.state.step == 8
    assert second.hooks("on_resume") == [4]
    assert second.hooks("post_step") == [5, 6, 7, 8]
    # the instance was reused, but on_resume set the count from the checkpoint: 4 saved + 4 new
    assert second.metrics[-1]["counter/steps"] == 8.0


def test_a_real_signal_checkpoints_and_exits_128_plus_signum(tmp_path: Path) -> None:
    counter = Counter()
    result = run_until_signal(tmp_path, step=3, steps=10, plugins={"counter": counter})
    assert result.exit_code == 128 + signal.SIGTERM
    assert result.hooks("on_signal") == [3]
    assert result.hooks("on_checkpoint") == [3]
    assert counter.signals == [signal.SIGTERM] and counter.ends == ["signal"]


def _wrapper(name: str) -> Any:
    def wrap(self: Any) -> Any:
        self.entered.append(name)
        result = yield
        self.left.append(name)
        return result

    wrap.__name__ = name
    return hookimpl(wrapper=True)(wrap)


def wrapping_plugin() -> Any:
    """A plugin with a new-style wrapper on every hook of the spec."""
    members = {name: _wrapper(name) for name in SPECS}
    cls = type("WrapEverything", (), members)
    plugin = cls()
    plugin.entered, plugin.left = [], []
    return plugin


def test_wrappers_wrap_every_hook(tmp_path: Path) -> None:
    """Including the hooks called plugin by plugin (on_checkpoint, on_resume, on_train_end)."""
    wrapper = wrapping_plugin()
    stopped = run_until_signal(tmp_path, step=3, steps=6, plugins={"counter": Counter(), "wrap": wrapper})
    assert stopped.exit_code == 128 + signal.SIGTERM
    resumed = run_steps(tmp_path, steps=6, plugins={"counter": Counter(), "wrap": wrapper})
    assert resumed.exit_code == 0
    # after training; with tensor parallelism only; asked plugin by plugin and none here listens;
    # by `coretrain predict` only; for a stream split only; when the run fails
    not_in_this_run = {"export_model", "tensor_parallel_plan", "phase_listener", "predict_step", "write_predictions"}
    not_in_this_run |= {
        "read_stream",
        "explain_failure",
        "pipeline_split",
        "pipeline_blocks",
        "predict_outputs",
    }  # pipelines
    not_in_this_run |= {"expert_layers"}  # expert parallelism only
    not_in_this_run |= {"restart_in_process"}  # a failure, restarted in-process
    not_in_this_run |= {"close_run"}  # asked plugin by plugin, and none of this run's implements it
    not_in_this_run |= {"describe_checkpoints"}  # by `coretrain checkpoint list` only
    not_in_this_run |= {"launch_job"}  # by `coretrain run --nproc-per-node`, before any rank
    not_in_this_run |= {"read_pretrained"}  # a run that starts from checkpoint.pretrained
    assert sorted(set(wrapper.entered)) == [name for name in SPECS if name not in not_in_this_run]
    assert wrapper.entered.count("on_train_end") == wrapper.left.count("on_train_end") >= 2
    # each wrapped per-plugin call still delivered the plugin's own state
    assert resumed.metrics[-1]["counter/steps"] == 6.0


def test_a_wrapper_sees_the_per_plugin_result(tmp_path: Path) -> None:
    @define
    class Rewrite:
        @hookimpl(wrapper=True)
        def on_checkpoint(self) -> Any:
            states = yield  # pluggy's list of results: here, of one plugin's call
            return [{**state, "wrapped": True} for state in states]

    first, second = stop_and_resume(tmp_path, stop_at=2, steps=4, plugins={"counter": Counter(), "rewrite": Rewrite()})
    resumes = [call for call in second.calls if call.hook == "on_resume"]
    assert resumes and second.metrics[-1]["counter/steps"] == 4.0
    import torch

    saved = torch.load(tmp_path / "out/checkpoints/step_00000002/rank_00000.pt", weights_only=True)
    assert saved["plugins"]["counter"] == {"steps": 2, "wrapped": True}


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        ((HOOK_API[0] + 1, 0), "was written for hook API 2.0"),
        ((HOOK_API[0], HOOK_API[1] + 1), "install a newer coretrain"),
        ((0, 9), "install a version of the plugin written for this coretrain"),
        ("1.0", "coretrain_hook_api must be (major, minor)"),
    ],
)
def test_a_plugin_for_another_hook_api_is_one_error_naming_it(wanted: Any, message: str) -> None:
    @define
    class Old:
        coretrain_hook_api = wanted

        @hookimpl
        def on_log(self) -> None:
            pass

    with pytest.raises(UserError) as caught:
        Plugins().register("old-plugin", Old())
    assert "plugin 'old-plugin'" in str(caught.value) and message in str(caught.value)


def test_a_plugin_for_this_hook_api_registers() -> None:
    @define
    class Current:
        coretrain_hook_api = HOOK_API

        @hookimpl
        def on_log(self) -> None:
            pass

    plugins = Plugins()
    plugins.register("current", Current())
    assert plugins.implemented("on_log")


@pytest.mark.parametrize("minor", range(HOOK_API[1] + 1))
def test_a_plugin_written_for_an_older_minor_still_runs(tmp_path: Path, minor: int) -> None:
    """The promise of a minor version: what a plugin for 1.N implemented, 1.N+k still calls —
    hooks that moved to the plugin distribution that asks them (1.10) included."""

    @define
    class Older:
        coretrain_hook_api = (HOOK_API[0], minor)
        logged: list[int] = field(factory=list)

        @hookimpl
        def on_log(self, step: int) -> None:
            self.logged.append(step)

        @hookimpl
        def tensor_parallel_plan(self) -> None:  # 1.2, a spec of coretrain-plugins' tensor-parallel since 1.10
            return None

        @hookimpl
        def predict_step(self) -> None:  # 1.8, coretrain-plugins' predict since 1.10
            return None

    older = Older()
    result = run_steps(tmp_path, steps=4, plugins={"older": older})
    assert result.exit_code == 0 and older.logged == [2, 4]


def test_a_deprecated_hook_warns_each_plugin_that_implements_it_naming_the_replacement() -> None:
    """The path a hook takes before a major removes it: its spec is marked with pluggy's
    ``warn_on_impl`` and a plugin implementing it hears so when it is registered; one that does
    not implement it hears nothing."""

    class Specs:
        @hookspec(warn_on_impl=DeprecationWarning("on_old is deprecated since hook API 1.10: implement on_new"))
        def on_old(self, run: Run) -> None:
            """A hook on its way out."""

    plugins = Plugins()
    plugins.manager.add_hookspecs(Specs)

    class UsesIt:
        @hookimpl
        def on_old(self, run: Run) -> None:
            pass

    with pytest.warns(DeprecationWarning, match="implement on_new"):
        plugins.register("uses-it", UsesIt())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugins.register("current", Counter())
    assert plugins.implementers("on_old") == ["uses-it"]


def test_configure_datasets_wraps_the_splits_before_they_are_checked_and_read(tmp_path: Path) -> None:
    class Counted:
        """The train split, counting the samples read through it."""

        def __init__(self, dataset: Any) -> None:
            self.dataset, self.reads = dataset, 0

        def __len__(self) -> int:
            return len(self.dataset)

        def __getitem__(self, index: int) -> Any:
            self.reads += 1
            return self.dataset[index]

    class Wraps:
        @hookimpl
        def configure_datasets(self, run: Run) -> None:
            run.datasets.train = Counted(run.datasets.train)

    result = run_steps(tmp_path, steps=3, plugins={"wraps": Wraps()})
    assert result.exit_code == 0 and isinstance(result.run.datasets.train, Counted)
    assert result.run.datasets.train.reads == 3 * 8  # every sample of every step came through it


@pytest.mark.parametrize("target", ["labels", "label", "label_ids"])  # the names transformers' collators take
def test_a_hugging_face_dataset_is_read_by_the_batch_through_the_built_in_hf_datasets(
    tmp_path: Path, target: str
) -> None:
    config = {
        "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
        "data": {"provider": "workloads:hf_digits", "options": {"target": target}},
        "train": {"micro_batch_size": 16, "eval_iters": 1},
    }
    result = run_steps(tmp_path, steps=3, config=config)
    assert result.exit_code == 0 and result.metrics[-1]["loss"] > 0
    assert type(result.run.datasets.train).__name__ == "Columns"  # one Arrow slice per micro-batch
    assert "hf-datasets" in result.run.plugins.implementers("configure_datasets")  # (streams: DataLoaders)


@pytest.mark.parametrize("target", ["labels", "label"])
def test_a_hugging_face_stream_yields_tensors_and_its_label_as_labels(tmp_path: Path, target: str) -> None:
    """``streaming=True`` gives python rows, which torch's collate turns a list column of into a
    list of tensors ("linear(): argument 'input' must be Tensor, not list"): hf-datasets formats
    the stream as torch, as a Dataset split is read, and hands its label over as labels."""
    config = {
        "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
        "data": {"provider": "workloads:hf_digit_stream", "options": {"target": target}},
        "train": {"micro_batch_size": 16, "eval_iters": 1, "log_interval": 5},
    }
    result = run_steps(tmp_path, steps=30, config=config)
    losses = [row["loss"] for row in result.metrics]
    assert result.exit_code == 0 and losses[-1] < 0.5 * losses[0], losses


def test_a_stream_is_read_by_the_plugin_that_answers_read_stream_first(tmp_path: Path) -> None:
    """The built-in ``streams`` answers last: a reader of your own (one that shards by file, say)
    is asked first, for training and for each evaluation pass."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    asked: list[bool] = []

    class WholeStream:
        @hookimpl
        def read_stream(self, run: Run, dataset: Any, micro_batch_size: int, training: bool) -> Any:
            asked.append(training)
            return StatefulDataLoader(dataset, batch_size=micro_batch_size, drop_last=training)

    config = {
        "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
        "data": {"provider": "workloads:digit_stream"},
        "train": {"micro_batch_size": 16, "eval_iters": 1, "eval_interval": 2},
    }
    result = run_steps(tmp_path, steps=4, plugins={"whole": WholeStream()}, config=config)
    assert result.exit_code == 0 and [m["step"] for m in result.evals] == [2, 4]
    assert asked[0] is True and asked.count(False) == 2  # training once; each validation pass
    with pytest.raises(UserError, match="no plugin reads streams: coretrain-plugins' `streams` does"):
        run_steps(tmp_path / "none", steps=4, config=config, autoload=("evaluation",))


def test_hooks_between_plugins_are_specified_by_their_distribution_not_the_core() -> None:
    plugins = Plugins()
    for hook in ("tensor_parallel_plan", "predict_step", "write_predictions"):
        assert not hasattr(HookSpecs, hook)
        assert getattr(plugins.manager.hook, hook).has_spec()  # from coretrain-plugins' coretrain.hookspecs


def test_a_misspelled_plugin_hook_is_named_with_the_plugins_own_hook_suggested() -> None:
    @define
    class Typo:
        @hookimpl
        def tensor_paralel_plan(self) -> None:
            return None

    plugins = Plugins()
    plugins.register("typo", Typo())
    with pytest.raises(UserError, match="'tensor_paralel_plan'.*tensor_parallel_plan"):
        plugins.check_pending()


def test_on_train_end_runs_when_restore_fails(tmp_path: Path) -> None:
    counter = Counter()
    run_steps(tmp_path, steps=4, plugins={"counter": counter})
    (tmp_path / "out/checkpoints/step_00000004/rank_00000.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "out/checkpoints/step_00000004/model.pt").write_bytes(b"not a checkpoint")
    explicit = {"checkpoint": {"resume": str(tmp_path / "out/checkpoints/step_00000004")}}
    with pytest.raises(UserError, match="cannot load checkpoint file"):
        run_steps(tmp_path, steps=6, plugins={"counter": counter}, config=explicit)
    assert counter.ends == ["completed", "error"]


class Marks:
    """Records the loop's phase marks, as a timer or the watchdog sees them."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    @hookimpl
    def phase_listener(self, run: Run) -> Any:
        return lambda step, phase: self.seen.append((step, phase))


def test_phase_marks_tell_a_listener_where_the_loop_is(tmp_path: Path) -> None:
    marks = Marks()
    config = {"train": {"log_interval": 2, "eval_interval": 2}, "checkpoint": {"save_interval": 2}}
    run_steps(tmp_path, steps=2, plugins={"marks": marks}, config=config)
    step = ["data", "forward_backward", "update", "post_step"]  # pre_step only with pre_step hooks
    assert marks.seen == [
        (0, "restore"),
        *((1, phase) for phase in step),
        *((2, phase) for phase in [*step, "log", "eval", "checkpoint"]),  # agreement: several ranks only
        (2, "end"),
    ]


def test_a_phase_listener_that_is_not_a_function_is_its_plugins_error(tmp_path: Path) -> None:
    class NotAFunction:
        @hookimpl
        def phase_listener(self) -> object:
            return 5

    with pytest.raises(PluginError, match=r"plugin 'odd' failed in phase_listener: .*returned int, expected a func"):
        run_steps(tmp_path, steps=1, plugins={"odd": NotAFunction()})


@pytest.mark.parametrize(
    "name",
    [
        "watchdog",
        "timers",
        "data-checks",
        "safetensors",
        "evaluation",
        "progress",
        "metrics-file",
        "progress-file",
        "schedule",
        "console-log",
        "optimizer-overrides",
    ],
)
def test_each_built_in_plugin_can_be_turned_off_and_the_run_works(tmp_path: Path, name: str) -> None:
    on = run_steps(tmp_path / "on", steps=2, autoload=True)
    assert name in on.run.plugins.names()
    off = run_steps(tmp_path / "off", steps=2, autoload=True, tables={name: {"enabled": False}})
    assert off.exit_code == 0 and off.run.state.step == 2
    assert name not in off.run.plugins.names()


def test_a_plugin_of_yours_evaluates_instead_of_the_built_in_evaluation(tmp_path: Path) -> None:
    class CountsSamples:
        @hookimpl
        def evaluate(self, split: str, dataset: Any) -> dict[str, float]:
            return {f"{split}/samples": float(len(dataset))}

    result = run_steps(tmp_path, steps=4, plugins={"mine": CountsSamples()}, config={"train": {"eval_interval": 2}})
    assert [row["step"] for row in result.evals] == [2, 4]
    assert all(set(row) == {"step", "valid/samples"} for row in result.evals)


def test_with_evaluation_off_nothing_is_evaluated_and_the_run_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"train": {"eval_interval": 2}}
    on = run_steps(tmp_path / "on", steps=4, config=config)
    assert [row["step"] for row in on.evals] == [2, 4] and "valid/loss" in on.evals[0]
    off = run_steps(tmp_path / "off", steps=4, config=config, tables={"evaluation": {"enabled": False}})
    assert off.exit_code == 0 and off.evals == []
    assert "no plugin evaluates (is `evaluation` disabled?)" in caplog.text


class AsksTheCadence:
    """Predicts from run.cadence what the loop will do at each step, and records what it did."""

    def __init__(self) -> None:
        self.predicted: dict[str, list[int]] = {"log": [], "eval": [], "save": []}
        self.done: dict[str, list[int]] = {"log": [], "eval": [], "save": []}

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        for kind, asks in (("log", run.cadence.logs), ("eval", run.cadence.evaluates), ("save", run.cadence.saves)):
            if asks(step):
                self.predicted[kind].append(step)

    @hookimpl
    def on_log(self, step: int) -> None:
        self.done["log"].append(step)

    @hookimpl
    def on_eval(self, step: int) -> None:
        self.done["eval"].append(step)

    @hookimpl
    def on_checkpoint(self, step: int) -> None:
        self.done["save"].append(step)


def test_the_run_cadence_is_what_the_loop_does(tmp_path: Path) -> None:
    asks = AsksTheCadence()
    config = {"train": {"log_interval": 3, "eval_interval": 4}, "checkpoint": {"save_interval": 5}}
    run_steps(tmp_path, steps=10, plugins={"asks": asks}, config=config)
    assert asks.predicted == {"log": [3, 6, 9], "eval": [4, 8], "save": [5, 10]}
    # the loop does the same, plus what ends a run: the final validation and the last checkpoint
    assert asks.done == {"log": [3, 6, 9], "eval": [4, 8, 10], "save": [5, 10]}


def test_every_n_is_due_at_multiples_of_n_and_zero_or_none_is_never() -> None:
    assert [step for step in range(1, 10) if Every(3)(step)] == [3, 6, 9]
    assert not any(Every(n)(step) for n in (0, None) for step in range(1, 10))


def test_the_hook_api_this_core_ships_is_in_the_changelog_history() -> None:
    """A new minor is listed, with what it adds, before it can be released."""
    changelog = (Path(__file__).parents[1] / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"| {HOOK_API[0]}.{HOOK_API[1]} |" in changelog


def test_a_stream_resumes_only_with_the_ranks_and_workers_that_saved_its_position(tmp_path: Path) -> None:
    """The built-in ``streams`` refuses, through ``check_resume``, a resume that would redeal a
    stream's saved per-worker positions to another number of workers."""
    config = {
        "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
        "data": {"provider": "workloads:digit_stream"},
        "train": {"micro_batch_size": 16, "eval_iters": 0, "exit_interval": 2},
    }
    assert run_steps(tmp_path, steps=4, config=config).run.state.step == 2
    more_workers = {**config, "data": {**config["data"], "num_workers": 1}}
    with pytest.raises(UserError, match=r"on 1 rank\(s\) with data.num_workers = 0, and this run has 1 with 1"):
        run_steps(tmp_path, steps=4, config=more_workers)
    assert run_steps(tmp_path, steps=4, config=config).run.state.step == 4  # the same counts resume


@pytest.mark.parametrize("stateful", [True, "lagging"])
def test_a_streams_state_is_checked_to_resume_where_it_stands_and_the_run_reads_it_from_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, stateful: bool | str
) -> None:
    """``data-checks`` reads a few items of a train stream with a ``state_dict()``, loads the state
    and reads again: a stream whose state lags the item it yielded is one warning before the first
    step. Either way the run then reads the stream from its first item: the same losses as with
    the check off. And the lagging one's resume reads an item twice: the warning is right."""
    config = cnn_on({"provider": "workloads:digit_stream", "options": {"stateful": stateful}})
    checked = {*BEHAVIOUR, "data-checks"}
    with caplog.at_level("WARNING", logger="coretrain"):
        with_check = run_steps(tmp_path / "checked", steps=4, config=config, autoload=checked)
    said = [r.getMessage() for r in caplog.records if "state_dict()" in r.getMessage()]
    if stateful == "lagging":
        assert said == [
            "data.provider 'workloads:digit_stream': the train stream's state_dict() does not resume where it "
            "stands: after 3 items, a stream loaded with it yields item 3 again instead of item 4: its position is "
            "counted after the yield; count it before (position += 1, then yield); a run resumed from a checkpoint "
            "would not read what an uninterrupted one reads"
        ]
    else:
        assert said == []
    uninterrupted = losses(run_steps(tmp_path / "unchecked", steps=4, config=config))
    assert losses(with_check) == uninterrupted and len(uninterrupted) == 4
    stopped = {**config, "train": {**config["train"], "exit_interval": 2}}
    first = losses(run_steps(tmp_path / "resumed", steps=4, config=stopped))
    resumed = first + losses(run_steps(tmp_path / "resumed", steps=4, config=config))
    assert (resumed == uninterrupted) == (stateful is True)


def test_samples_read_in_on_datasets_leave_the_runs_random_streams_as_they_were(tmp_path: Path) -> None:
    """``data-checks`` reads samples of a dataset whose reads draw fresh noise from torch's global
    generator (as torchvision's random transforms do), before the model is built: the model's
    initialization, and so every loss, is the same as with the plugin off."""
    config = cnn_on({"provider": "workloads:digits", "options": {"augment": True}})
    checked = run_steps(tmp_path / "checked", steps=3, config=config, autoload={*BEHAVIOUR, "data-checks"})
    assert "on_datasets" in checked.hooks()
    assert losses(checked) == losses(run_steps(tmp_path / "unchecked", steps=3, config=config))


def cnn_on(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The test workloads' CNN on ``data`` (a [data] table), every step logged."""
    model = {"provider": "workloads:cnn", "loss": "cross_entropy"}
    return {"model": model, "data": data, "train": {"micro_batch_size": 16, "eval_iters": 0, "log_interval": 1}}


def losses(result: Result) -> list[float]:
    return [row["loss"] for row in result.metrics]


@pytest.mark.parametrize(("workers", "warned"), [(0, False), (2, True)])
def test_a_stream_dealt_to_several_readers_is_said_once_and_to_one_reader_not_at_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, workers: int, warned: bool
) -> None:
    """Several readers change the order a stream's items are read in, and a resume must have
    as many: worth a warning. One reader (a laptop's run) reads it in order: nothing to say."""
    from coretrain.cli import main
    from coretrain.testing import tiny_config, write_config

    data = {"provider": "workloads:digit_stream", "num_workers": workers}
    config = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", data=data, model={"loss": "mse"}))
    with caplog.at_level("WARNING", logger="coretrain"):
        assert main(["config", "validate", str(config)]) == 0  # builds the datasets, as a run does
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "item by item" in r.getMessage()]
    expected = ["the train split is a stream, dealt out item by item to 2 reader(s)"] if warned else []
    assert [message.split(" (ranks")[0] for message in said] == expected, said
