"""Every layout resumes every other's checkpoint: {one rank, DDP 2, FSDP 2, HSDP 2×2, TP 2,
TP 2 × FSDP 2} → each other, by resume and as ``checkpoint.pretrained``, and without the
optimizer state.

A checkpoint is replicated (one rank, DDP: whole tensors) or sharded (the others: DCP); a
model holds plain tensors or DTensors. Each source trains 2 steps of the tiny GPT at a global
batch of 8 and saves; each target resumes it and trains steps 3–4, whose losses must be the
uninterrupted one-rank run's within 1e-6 (reduction orders differ between layouts, nothing
else may). Commands sharing a number of ranks run in one torchrun job, one after another
(``fixtures/commands_in_one_job.py``), as separate jobs would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, config_file, gpt_preset, metrics_rows, run_cli, run_here

pytestmark = pytest.mark.slow  # torchrun jobs of 2 and 4 gloo ranks

LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {  # name: (ranks, --set values)
    "one": (1, ()),
    "ddp": (2, ('distributed.strategy="ddp"',)),
    "fsdp": (2, ('distributed.strategy="fsdp"',)),
    "tp": (2, ("distributed.tp_size=2",)),
    "hsdp": (4, ('distributed.strategy="fsdp"', "distributed.dp_replicate=2")),
    "tp-fsdp": (4, ("distributed.tp_size=2",)),
}
SOURCE_STEP = 2
STEPS = 4


def command(config: Path, layout: str, output_dir: Path, *more: str, name: str = "run") -> list[str]:
    """``run CONFIG`` (or ``name``) in ``layout``, writing to ``output_dir``, with ``more`` --set values."""
    sets = (*LAYOUTS[layout][1], f"run.output_dir={json.dumps(str(output_dir))}", *more)
    return [name, str(config), *(arg for value in sets for arg in ("--set", value))]


def run_commands(tmp_path: Path, ranks: int, commands: list[list[str]], name: str) -> None:
    """The commands one after another: in this process for one rank, else in one torchrun job."""
    if ranks == 1:
        for args in commands:
            done = run_here(*args, cwd=tmp_path)
            assert done.returncode == 0, (args, done.stderr)
        return
    plan = tmp_path / f"{name}.json"
    plan.write_text(json.dumps(commands))
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}")
    job = run_cli(
        str(plan), cwd=tmp_path, command=(*launcher, str(REPO / "tests" / "fixtures" / "commands_in_one_job.py"))
    )
    codes = json.loads(plan.with_name(plan.name + ".codes").read_text()) if job.returncode else []
    assert job.returncode == 0, (commands[len(codes) - 1] if codes else None, job.stderr[-3000:])


def losses(output_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics_rows(output_dir) if "loss" in row}


def test_every_layout_resumes_and_loads_every_other_layouts_checkpoint(tmp_path: Path) -> None:
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"]["n_layer"] = 2  # blocks for FSDP to shard one by one
    train = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": STEPS, "log_interval": 1, "eval_iters": 0}
    config = config_file(tmp_path / "c.toml", preset, {"distributed": {"backend": "gloo"}}, **train)
    source = {name: tmp_path / "from" / name for name in LAYOUTS}
    step_dir = {name: source[name] / "checkpoints" / f"step_{SOURCE_STEP:08d}" for name in LAYOUTS}
    reference = tmp_path / "uninterrupted"

    def targets(layout: str) -> list[list[str]]:
        """Resume every source, load each as pretrained weights, resume without the optimizer."""
        out = tmp_path / "to" / layout
        resumes = [
            command(config, layout, out / f"from-{name}", f"checkpoint.resume={json.dumps(str(step_dir[name]))}")
            for name in LAYOUTS
        ]
        pretrained = [
            command(
                config, layout, out / f"pretrained-{name}", f"checkpoint.pretrained={json.dumps(str(step_dir[name]))}"
            )
            for name in ("ddp", "hsdp-best")  # one replicated checkpoint; a sharded one, through best
        ]
        no_optimizer = command(
            config,
            layout,
            out / "without-optimizer",
            f"checkpoint.resume={json.dumps(str(step_dir['fsdp']))}",
            "checkpoint.load_optimizer=false",
        )
        return [*resumes, *pretrained, no_optimizer]

    def stop_at_source_step(layout: str) -> list[str]:
        return command(config, layout, source[layout], f"train.exit_interval={SOURCE_STEP}")

    def predict_best(layout: str) -> list[str]:
        """``coretrain predict --checkpoint best`` of the HSDP run, on ``layout``'s ranks."""
        out = tmp_path / f"predictions-{layout}.jsonl"
        predict = command(config, layout, source["hsdp"], 'model.loss="cross_entropy"', name="predict")
        return [*predict, "--checkpoint", "best", "--split", "valid", "--out", str(out)]

    # the HSDP source also keeps its best evaluation (at step 2): predict and pretrained load "best"
    keep_best = ('checkpoint.keep_best="valid/loss"', f"train.eval_interval={SOURCE_STEP}", "train.eval_iters=1")
    step_dir["hsdp-best"] = source["hsdp"] / "checkpoints" / "best"

    run_commands(tmp_path, 1, [command(config, "one", reference), stop_at_source_step("one")], "one-sources")
    run_commands(tmp_path, 2, [stop_at_source_step(name) for name in ("ddp", "fsdp", "tp")], "two-sources")
    four = [[*stop_at_source_step("hsdp"), *(arg for value in keep_best for arg in ("--set", value))]]
    four += [stop_at_source_step("tp-fsdp"), *targets("hsdp"), *targets("tp-fsdp")]
    run_commands(tmp_path, 4, four, "four")
    two = [*targets("ddp"), *targets("fsdp"), *targets("tp"), predict_best("fsdp")]
    run_commands(tmp_path, 2, two, "two-targets")
    run_commands(tmp_path, 1, [*targets("one"), predict_best("one")], "one-targets")

    expected = losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))
    for name in LAYOUTS:  # each source trained the same first steps
        assert losses(source[name]) == pytest.approx({s: expected[s] for s in (1, 2)}, rel=1e-6), name
    pretrained_first = losses(tmp_path / "to" / "one" / "pretrained-ddp")[1]
    for layout in LAYOUTS:
        out = tmp_path / "to" / layout
        for name in LAYOUTS:
            got = losses(out / f"from-{name}")
            assert sorted(got) == [3, 4], (name, layout)
            assert got == pytest.approx({s: expected[s] for s in (3, 4)}, rel=1e-6), (name, layout)
        for name in ("ddp", "hsdp-best"):  # the weights of step 2, from step 0 on: the same first loss everywhere
            assert losses(out / f"pretrained-{name}")[1] == pytest.approx(pretrained_first, rel=1e-6), (name, layout)
        fresh_optimizer = losses(out / "without-optimizer")
        assert sorted(fresh_optimizer) == [3, 4] and fresh_optimizer[3] == pytest.approx(expected[3], rel=1e-6)
        assert fresh_optimizer[4] != pytest.approx(expected[4], rel=1e-6)  # the moments started afresh
    one_rank, two_ranks = (predictions(tmp_path / f"predictions-{layout}.jsonl") for layout in ("one", "fsdp"))
    assert [r["index"] for r in one_rank] == [r["index"] for r in two_ranks] and one_rank
    tokens = [(a, b) for x, y in zip(one_rank, two_ranks) for a, b in zip(x["prediction"], y["prediction"])]
    assert sum(a == b for a, b in tokens) >= 0.99 * len(tokens)  # argmaxes; a near-tie may flip with the batching


def predictions(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]
