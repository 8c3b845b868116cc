"""Megatron-style training features as plugins, each exercised by a real `coretrain run`."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, config_file, metrics_rows, run_cli, run_here
from helpers_inprocess import config, train

from coretrain import UserError, hookimpl
from coretrain.testing import tiny_config

pytestmark = pytest.mark.slow  # feature plugins in CLI runs: the full suite, not the fast tier

TESTS = str(REPO / "tests")


def plain_config(tmp_path: Path, tail: str, model: str = "helpers_inprocess:make_model", **train: Any) -> Path:
    """The in-memory regression run of helpers_inprocess (or another ``model``), with extra TOML appended."""
    preset = tiny_config(
        tmp_path / "out",
        model={"provider": model},
        data={"provider": "helpers_inprocess:make_data"},
        train={"micro_batch_size": 8, "train_iters": 20, "log_interval": 5, "eval_iters": 0},
    )
    preset["run"].pop("threads")
    return config_file(tmp_path / "c.toml", preset, tail, **train)


def faulty_run(
    tmp_path: Path, guards: str, nan_at: list[int] = (), spike_at: list[int] = (), train_iters: int = 12
) -> tuple[Any, list[dict]]:
    path = plain_config(
        tmp_path,
        f"""
[model.options]
nan_at = {list(nan_at)}
spike_at = {list(spike_at)}
[optimizer]
lr = 0.01
[plugins.guards]
{guards}
""",
        model="faulty_models:make_faulty",
        train_iters=train_iters,
        log_interval=1,
    )
    result = run_here("run", str(path), cwd=tmp_path, env={"PYTHONPATH": TESTS})
    return result, metrics_rows(tmp_path / "out")


def test_guards_skip_nan_and_spike_updates_and_keep_training(tmp_path: Path) -> None:
    result, rows = faulty_run(tmp_path, 'action = "skip"\nwindow = 5', nan_at=[5], spike_at=[8])
    assert result.returncode == 0, result.stderr
    assert "guards: step 5: loss is nan; update skipped" in result.stderr
    assert "guards: step 8: loss spiked to" in result.stderr
    assert [r["skipped_updates"] for r in rows if r["step"] in (4, 5, 8, 12)] == [0.0, 1.0, 2.0, 2.0]
    assert [(r["nan_steps"], r["spike_steps"]) for r in rows if r["step"] in (4, 5, 8, 12)] == [
        (0, 0),
        (1, 0),
        (1, 1),
        (1, 1),
    ]
    weights = torch.load(tmp_path / "out" / "checkpoints" / "step_00000012" / "model.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())  # the NaN never reached the weights


def test_guards_warn_lets_the_update_through(tmp_path: Path) -> None:
    result, rows = faulty_run(tmp_path, 'action = "warn"', spike_at=[6])
    assert result.returncode == 0 and "updating anyway (action = warn)" in result.stderr
    assert rows[-1]["skipped_updates"] == 0.0


def test_guards_stop_checkpoints_and_exits_with_its_code(tmp_path: Path) -> None:
    result, _ = faulty_run(tmp_path, 'action = "stop"\nexit_code = 7', nan_at=[5])
    assert result.returncode == 7
    assert "stopping at step 5: guards: loss is nan" in result.stderr
    assert (tmp_path / "out" / "checkpoints" / "step_00000005").is_dir()


def test_guards_iterations_to_skip_consume_data_without_updates(tmp_path: Path) -> None:
    result, rows = faulty_run(tmp_path, "iterations_to_skip = [3, 4]")
    assert result.returncode == 0, result.stderr
    assert rows[-1]["skipped_updates"] == 2.0 and rows[-1]["consumed_samples"] == 12 * 8


def injected(tmp_path: Path, table: str) -> Any:
    """A run with a fault injected: in a process of its own when the fault is a signal to it."""
    path = plain_config(tmp_path, f"[plugins.fault-injection]\n{table}")
    run = run_cli if "sig" in table else run_here
    return run("run", str(path), cwd=tmp_path, env={"PYTHONPATH": TESTS})


def test_fault_injection_sigterm_takes_the_graceful_path(tmp_path: Path) -> None:
    result = injected(tmp_path, 'action = "sigterm"\nstep = 6')
    assert result.returncode == 143 and "fault-injection: sigterm on rank 0 at step 6" in result.stderr
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "6"


def test_fault_injection_raise_crashes_like_a_bug_and_still_closes_the_run(tmp_path: Path) -> None:
    result = injected(tmp_path, 'action = "raise"\nstep = 4')
    assert result.returncode == 1
    assert "RuntimeError: fault-injection: raised on rank 0 at step 4" in result.stderr
    assert "error after step 3" in result.stdout  # on_train_end ran (the raise was in step 4)


def test_fault_injection_at_random_is_seeded(tmp_path: Path) -> None:
    first = injected(tmp_path / "a", 'action = "sleep"\nsleep_seconds = 0.0\nprobability = 0.3\nseed = 5')
    second = injected(tmp_path / "b", 'action = "sleep"\nsleep_seconds = 0.0\nprobability = 0.3\nseed = 5')
    steps = [line.split("at step ")[1] for line in first.stderr.splitlines() if "fault-injection" in line]
    assert steps and steps == [
        line.split("at step ")[1] for line in second.stderr.splitlines() if "fault-injection" in line
    ]


def test_profiler_writes_a_chrome_trace_of_the_window(tmp_path: Path) -> None:
    path = plain_config(tmp_path, "[plugins.profiler]\nstart = 3\nend = 5")
    result = run_here(
        "run", str(path), "--set", f"run.output_dir={tmp_path / 'prof'}", cwd=tmp_path, env={"PYTHONPATH": TESTS}
    )
    assert result.returncode == 0, result.stderr
    trace = json.loads((tmp_path / "prof" / "profile" / "rank0_steps3-5.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::linear") for name in names) and any("Optimizer.step" in n for n in names)


class Recording:
    """Stands in for torch.cuda.nvtx and cudart on a machine without CUDA: what was called, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append(" ".join([name, *map(str, args)]))


def test_nvtx_ranges_follow_the_loops_phases_inside_the_profiled_window(tmp_path: Path) -> None:
    """The marks of a real 6-step run, replayed into the listener ``nvtx = true`` installs on
    CUDA: one range open at a time, steps 3-5 only, the capture started and stopped once."""
    from coretrain_profiler.nvtx import PhaseRanges
    from test_plugin_api import Marks

    from coretrain.testing import run_steps

    recorder = Marks()
    result = run_steps(tmp_path, steps=6, tables={"profiler": {"start": 3, "end": 5, "nvtx": True}})
    assert result.run.plugins.get("profiler") is not None  # on CPU: no listener, nothing else changes
    run_steps(tmp_path / "marks", steps=6, plugins={"marks": recorder})
    nvtx, cudart = Recording(), Recording()
    ranges = PhaseRanges(3, 5, nvtx=nvtx, cudart=cudart)
    for step, phase in recorder.seen:
        ranges(step, phase)
    pushed = [call.split(" ", 1)[1] for call in nvtx.calls if call.startswith("range_push")]
    assert pushed and {int(name.rsplit(" ", 1)[1]) for name in pushed} == {3, 4, 5}
    assert {"data 3", "forward_backward 4", "update 5"} <= set(pushed)
    assert nvtx.calls.count("range_pop") == len(pushed)  # each closed, by the next mark
    assert all(a != b for a, b in zip(nvtx.calls, nvtx.calls[1:]))  # push, pop, push, pop...
    assert cudart.calls == ["cudaProfilerStart", "cudaProfilerStop"]


def test_memory_plugin_says_once_that_a_cpu_run_has_nothing_to_do(tmp_path: Path) -> None:
    path = plain_config(tmp_path, "[plugins.memory]\nempty_unused_memory_level = 2\ntrain_sync_interval = 5")
    result = run_here("run", str(path), cwd=tmp_path, env={"PYTHONPATH": TESTS})
    assert result.returncode == 0, result.stderr
    assert (
        result.stderr.count("memory: CPU run; empty_unused_memory_level and train_sync_interval have nothing to do")
        == 1
    )


def test_compile_keeps_parameter_names_and_trains(tmp_path: Path) -> None:
    # the default backend, inductor, as a user runs it: its C++ build of this small model's kernels
    # (14 s more than aot_eager on 2 cores, a cold cache) is the suite's one; test_hf.py's
    # transformers model is compiled with aot_eager (dynamo and AOTAutograd, not the C++ build: 28 s more)
    path = plain_config(tmp_path, '[plugins.compile]\nmode = "default"')
    result = run_cli("run", str(path), "--set", "train.train_iters=10", cwd=tmp_path, env={"PYTHONPATH": TESTS})
    assert result.returncode == 0, result.stderr
    assert "compile: model compiled with mode=default backend=inductor" in result.stderr
    saved = torch.load(tmp_path / "out" / "checkpoints" / "step_00000010" / "model.pt", weights_only=True)
    assert sorted(saved) == ["net.0.bias", "net.0.weight", "net.3.bias", "net.3.weight"]  # no _orig_mod.


def test_the_first_step_and_validation_stay_out_of_the_throughput(tmp_path: Path, no_autoload: None) -> None:
    from test_loop import Recorder

    class SlowFirstStep:
        @hookimpl
        def pre_step(self, step: int) -> None:
            if step == 1:
                time.sleep(0.5)

    recorder = Recorder()
    spec = config(tmp_path, train={"train_iters": 8, "log_interval": 4}, plugins={"timers": {}})
    train(spec, ("slow", SlowFirstStep()), ("r", recorder))
    assert recorder.logs[0][1]["iteration_time"] < 0.1  # not (0.5 + 3 × fast) / 4


def test_mxfp8_on_a_torch_torchao_refuses_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao checks, when it converts the layers, that this torch runs its MXFP8 training (2.10 and
    2.11 do not): its bare assertion becomes one error naming the torch and the way out."""
    pytest.importorskip("torchao.prototype.moe_training.config")  # (torchao >= 0.17)
    import torchao.quantization
    from coretrain_fp8 import convert_to_mxfp8

    def refuses(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Please install the latest torch nightly build to use MXFP8 training")

    monkeypatch.setattr(torchao.quantization, "quantize_", refuses)
    with pytest.raises(UserError, match=r"refuses torch .*\(Please install the latest torch nightly.*use 'tensorwise'"):
        convert_to_mxfp8(torch.nn.Linear(32, 32), lambda module, name: True, emulate=True)


def test_fp8_emulated_training_tracks_full_precision(tmp_path: Path) -> None:
    from conftest import tiny_gpt_config

    losses = {}
    for name, tail in (("fp32", ""), ("fp8", '\n[plugins.fp8]\nrecipe = "tensorwise"\n')):
        path = tmp_path / f"{name}.toml"
        path.write_text(tiny_gpt_config(tmp_path / name, train_iters=30, log_interval=5, eval_iters=0) + tail)
        result = run_here("run", str(path), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        losses[name] = [row["loss"] for row in metrics_rows(tmp_path / name)]
        if name == "fp8":
            assert "fp8: no FP8 tensor cores here (cpu); torchao emulates FP8 numerics" in result.stderr
            assert "fp8: tensorwise recipe on 6 Linear layers" in result.stderr  # q k v proj fc, mlp proj
    assert losses["fp8"] != losses["fp32"]  # FP8 rounding really happened
    for full, fp8 in zip(losses["fp32"], losses["fp8"]):
        assert fp8 == pytest.approx(full, rel=0.02)  # stated tolerance: 2% per logged step


def test_megatron_bridge_recipe_names_run_their_torchao_recipes(tmp_path: Path) -> None:
    """``bf16_with_fp8_current_scaling_mixed`` is torchao's tensorwise recipe (the same losses, bit
    for bit), ``bf16_with_mxfp8_mixed`` torchao's MXFP8 training, emulated on the CPU: it rounds
    (other losses than bf16 alone) and tracks them."""
    from conftest import tiny_gpt_config

    losses = {}
    recipes = {"bf16": None, "tensorwise": "tensorwise", "current": "bf16_with_fp8_current_scaling_mixed"}
    for name, recipe in (recipes | {"mxfp8": "bf16_with_mxfp8_mixed"}).items():
        path = tmp_path / f"{name}.toml"
        tail = f'\n[plugins.fp8]\nrecipe = "{recipe}"\n' if recipe else ""
        text = tiny_gpt_config(tmp_path / name, train_iters=20, log_interval=5, eval_iters=0)
        path.write_text(text.replace("threads = 1", 'threads = 1\nprecision = "bf16_mixed"', 1) + tail)
        result = run_here("run", str(path), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        losses[name] = [row["loss"] for row in metrics_rows(tmp_path / name)]
        if recipe:
            assert f"fp8: {recipe} recipe on 6 Linear layers" in result.stderr
    assert losses["current"] == losses["tensorwise"] != losses["bf16"]
    assert losses["mxfp8"] != losses["bf16"] and losses["mxfp8"] != losses["tensorwise"]
    for full, mx in zip(losses["bf16"], losses["mxfp8"]):
        assert mx == pytest.approx(full, rel=0.03)  # stated tolerance: 3% per logged step


@pytest.mark.parametrize(
    ("recipe", "precision", "said"),
    [
        ("bf16_with_fp8_delayed_scaling_mixed", "bf16_mixed", "no torchao equivalent (torchao dropped delayed scaling"),
        ("fp16_with_fp8_subchannel_scaling_mixed", "fp16_mixed", "nearest: 'fp16_with_fp8_current_scaling_mixed'"),
        ("bf16_with_fp8_current_scaling_mixed", "fp32", 'set run.precision = "bf16_mixed" (it is "fp32")'),
        ("bf16_with_fp4_mixed", "bf16_mixed", "expected a torchao recipe"),
    ],
)
def test_a_megatron_bridge_recipe_without_an_equivalent_is_one_error(
    tmp_path: Path, recipe: str, precision: str, said: str
) -> None:
    from conftest import tiny_gpt_config
    from test_trust import one_error_line

    path = tmp_path / "c.toml"
    text = tiny_gpt_config(tmp_path / "out", train_iters=2, eval_iters=0)
    path.write_text(
        text.replace("threads = 1", f'threads = 1\nprecision = "{precision}"', 1)
        + f'\n[plugins.fp8]\nrecipe = "{recipe}"\n'
    )
    result = run_here("run", str(path), cwd=tmp_path)
    assert result.returncode == 2 and said in one_error_line(result.stderr)


class LogRecorder:
    def __init__(self) -> None:
        self.logs: dict[int, dict[str, float]] = {}

    @hookimpl
    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        self.logs[step] = metrics


def test_model_stats_log_the_parameter_norm_and_zero_gradients_at_log_steps(tmp_path: Path, no_autoload: None) -> None:
    seen = LogRecorder()
    run, code = train(
        config(
            tmp_path,
            train={"train_iters": 6, "log_interval": 3},
            data={"options": {"dead_inputs": 2}},
            plugins={"model-stats": {}},
        ),
        ("seen", seen),
    )
    assert code == 0 and sorted(seen.logs) == [3, 6]
    # two input features are always 0: their columns of the 16-wide first layer never get a gradient
    assert [seen.logs[step]["zero_grads"] for step in (3, 6)] == [2 * 16, 2 * 16]
    weights = torch.cat([p.detach().flatten() for p in run.model.parameters()])
    assert seen.logs[6]["params_norm"] == pytest.approx(weights.norm().item(), rel=1e-6)  # after the last update
    assert seen.logs[3]["params_norm"] != seen.logs[6]["params_norm"] and not run.log_tensors


def test_model_stats_can_be_turned_off_one_by_one(tmp_path: Path, no_autoload: None) -> None:
    seen = LogRecorder()
    train(
        config(tmp_path, train={"train_iters": 3, "log_interval": 3}, plugins={"model-stats": {"zero_grads": False}}),
        ("seen", seen),
    )
    assert "params_norm" in seen.logs[3] and "zero_grads" not in seen.logs[3]


def test_each_blocks_gradient_norm_adds_up_to_the_logged_one(tmp_path: Path) -> None:
    """Per block of a 3-block GPT, plus the embeddings and head: their norms' squares sum to
    the whole model's grad_norm (both before clipping), at log steps."""
    from coretrain.testing import run_steps

    gpt = {"provider": "gpt", "options": {"n_layer": 3, "n_head": 2, "n_embd": 16, "vocab_size": 64}}
    data = {"provider": "mock", "options": {"seq_length": 16, "vocab_size": 64}}
    train_keys = {"micro_batch_size": 2, "log_interval": 1, "eval_iters": 0, "clip_grad": 0.5}  # grad_norm: this step's
    config = {"model": gpt, "data": data, "train": train_keys}
    result = run_steps(tmp_path, steps=4, config=config, tables={"model-stats": {"layer_grad_norms": True}})
    for row in result.metrics:
        layers = {key: value for key, value in row.items() if key.startswith("grad_norm/")}
        assert sorted(layers) == ["grad_norm/blocks.0", "grad_norm/blocks.1", "grad_norm/blocks.2", "grad_norm/other"]
        assert math.sqrt(sum(v**2 for v in layers.values())) == pytest.approx(row["grad_norm"], rel=1e-5)
        assert row["grad_norm"] > 0.5  # clipped, and the per-block figures are still the unclipped ones


def test_stragglers_individual_score_compares_a_rank_with_its_own_earlier_intervals(
    tmp_path: Path, no_autoload: None
) -> None:
    seen = LogRecorder()
    run, code = train(
        config(
            tmp_path,
            train={"train_iters": 20, "log_interval": 5},
            plugins={
                "stragglers": {"report_interval": 0, "warmup_steps": 2},
                "fault-injection": {"action": "sleep", "step": 11, "every_step": True, "sleep_seconds": 0.05},
            },
        ),
        ("seen", seen),
    )
    assert code == 0
    first, slowed = seen.logs[5], seen.logs[15]
    assert first["stragglers/min_individual_score"] == 1.0 and first["stragglers/count"] == 0  # nothing to compare yet
    assert slowed["stragglers/min_individual_score"] < 0.2 and slowed["stragglers/count"] == 1
    assert run.plugins.get("stragglers").last_report["stragglers"] == [0]
