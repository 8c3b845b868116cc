"""Every layout resumes every other's checkpoint: {one rank, DDP 2, FSDP 2, HSDP 2×2, TP 2,
TP 2 × FSDP 2, PP 2, PP 2 × FSDP 2} → each other (64 pairs), by resume and as
``checkpoint.pretrained``, and without the optimizer state. A pipeline's last stage holds a
copy of the tied head: it takes the embedding's optimizer state from a checkpoint of a layout
without the copy.

A checkpoint is replicated (one rank, DDP: whole tensors) or sharded (the others: DCP); a
model holds plain tensors or DTensors. Each source trains 3 steps of the tiny GPT at a global
batch of 8 and saves (in the middle of a log interval of 2); each target resumes it and trains
steps 4 and 5, logging each: step 4's loss the mean of step 3, from the source's pending
interval, and of its own step 4; step 5's the first moved by the restored optimizer state. Both
must be the uninterrupted one-rank run's within 1e-6 (reduction orders differ between layouts,
nothing else may). A layout loading pretrained weights trains the 2 steps of its first log.
Commands sharing a number of ranks run in one job, one after another
(``fixtures/commands_in_one_job.py``), as separate jobs would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import config_file, gpt_preset, in_one_job, metrics_rows

pytestmark = pytest.mark.slow  # jobs of 2 and 4 gloo ranks

LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {  # name: (ranks, --set values)
    "one": (1, ()),
    "ddp": (2, ('distributed.strategy="ddp"',)),
    "fsdp": (2, ('distributed.strategy="fsdp"',)),
    "tp": (2, ("distributed.tp_size=2",)),
    "hsdp": (4, ('distributed.strategy="fsdp"', "distributed.dp_replicate=2")),
    "tp-fsdp": (4, ("distributed.tp_size=2",)),
    "pp": (2, ("distributed.pp_size=2",)),
    "pp-fsdp": (4, ("distributed.pp_size=2",)),
}
SOURCE_STEP = 3
STEPS = 5
EACH_STEP = "train.log_interval=1"
"""A resumed target logs steps 4 and 5 each on its own (step 4's mean holding the source's step 3),
and the uninterrupted run every step."""
PRETRAINED = {"one": "hsdp-best", "ddp": "hsdp-best", "fsdp": "ddp", "tp": "ddp", "hsdp": "ddp", "tp-fsdp": "ddp"}
PRETRAINED |= {"pp": "fsdp", "pp-fsdp": "ddp"}
"""Whose weights each layout loads as checkpoint.pretrained: the other kind of checkpoint."""
WITHOUT_OPTIMIZER = ("one", "fsdp", "hsdp")


def command(config: Path, layout: str, output_dir: Path, *more: str, name: str = "run") -> list[str]:
    """``run CONFIG`` (or ``name``) in ``layout``, writing to ``output_dir``, with ``more`` --set values."""
    sets = (*LAYOUTS[layout][1], f"run.output_dir={json.dumps(str(output_dir))}", *more)
    if "checkpoint.resume" in str(more) or "checkpoint.pretrained" in str(more):
        sets = (*sets, "checkpoint.save=false")  # a target: nothing reads its checkpoints
    return [name, str(config), *(arg for value in sets for arg in ("--set", value))]


def losses(output_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics_rows(output_dir) if "loss" in row}


def test_every_layout_resumes_and_loads_every_other_layouts_checkpoint(tmp_path: Path) -> None:
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"]["n_layer"] = 2  # blocks for FSDP to shard one by one
    train = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": STEPS, "log_interval": 2, "eval_iters": 0}
    config = config_file(tmp_path / "c.toml", preset, {"distributed": {"backend": "gloo"}}, **train)
    source = {name: tmp_path / "from" / name for name in LAYOUTS}
    step_dir = {name: source[name] / "checkpoints" / f"step_{SOURCE_STEP:08d}" for name in LAYOUTS}
    reference = tmp_path / "uninterrupted"

    def targets(layout: str) -> list[list[str]]:
        """Resume every source; load a checkpoint of the other kind as pretrained weights (whole
        tensors into a sharded model, shards — through ``best`` — into a plain one); resume a
        sharded one without its optimizer (one rank, FSDP and HSDP: plain and both meshes)."""
        out = tmp_path / "to" / layout
        commands = [
            command(
                config, layout, out / f"from-{name}", f"checkpoint.resume={json.dumps(str(step_dir[name]))}", EACH_STEP
            )
            for name in LAYOUTS
        ]
        weights = f"checkpoint.pretrained={json.dumps(str(step_dir[PRETRAINED[layout]]))}"
        commands.append(command(config, layout, out / "pretrained", weights, "train.train_iters=2"))
        if layout in WITHOUT_OPTIMIZER:
            resume = f"checkpoint.resume={json.dumps(str(step_dir['fsdp']))}"
            commands.append(
                command(config, layout, out / "without-optimizer", resume, "checkpoint.load_optimizer=false", EACH_STEP)
            )
        return commands

    def stop_at_source_step(layout: str) -> list[str]:
        return command(config, layout, source[layout], f"train.exit_interval={SOURCE_STEP}")

    def predict_best(layout: str) -> list[str]:
        """``coretrain predict --checkpoint best`` of the HSDP run, on ``layout``'s ranks."""
        out = tmp_path / f"predictions-{layout}.jsonl"
        predict = command(config, layout, source["hsdp"], 'model.loss="cross_entropy"', name="predict")
        return [*predict, "--checkpoint", "best", "--split", "valid", "--out", str(out)]

    # the HSDP source also keeps its best evaluation (at step 3): predict and pretrained load "best"
    keep_best = ('plugins.keep-best.metric="valid/loss"', f"train.eval_interval={SOURCE_STEP}", "train.eval_iters=1")
    step_dir["hsdp-best"] = source["hsdp"] / "checkpoints" / "best"

    uninterrupted = command(config, "one", reference, EACH_STEP)
    in_one_job(tmp_path, 1, [uninterrupted, stop_at_source_step("one")], "one-sources")
    in_one_job(tmp_path, 2, [stop_at_source_step(name) for name in ("ddp", "fsdp", "tp", "pp")], "two-sources")
    four = [[*stop_at_source_step("hsdp"), *(arg for value in keep_best for arg in ("--set", value))]]
    four += [stop_at_source_step("tp-fsdp"), stop_at_source_step("pp-fsdp")]
    four += [*targets("hsdp"), *targets("tp-fsdp"), *targets("pp-fsdp")]
    in_one_job(tmp_path, 4, four, "four")
    two = [*targets("ddp"), *targets("fsdp"), *targets("tp"), *targets("pp"), predict_best("fsdp")]
    in_one_job(tmp_path, 2, two, "two-targets")
    in_one_job(tmp_path, 1, [*targets("one"), predict_best("one")], "one-targets")

    each = losses(reference)  # step by step
    assert sorted(each) == [1, 2, 3, 4, 5]
    after = {4: (each[3] + each[4]) / 2, 5: each[5]}
    for name in LAYOUTS:  # each source trained the same first steps (and stopped without logging step 3)
        assert losses(source[name]) == pytest.approx({2: (each[1] + each[2]) / 2}, rel=1e-6), name
    pretrained_first = losses(tmp_path / "to" / "one" / "pretrained")[2]
    for layout in LAYOUTS:
        out = tmp_path / "to" / layout
        for name in LAYOUTS:
            got = losses(out / f"from-{name}")
            assert got == pytest.approx(after, rel=1e-6), (name, layout)
        # the weights of step 3, from step 0 on: the same first losses in every layout
        assert losses(out / "pretrained")[2] == pytest.approx(pretrained_first, rel=1e-6), layout
        if layout in WITHOUT_OPTIMIZER:
            fresh_optimizer = losses(out / "without-optimizer")  # step 4 runs on the restored weights of step 3
            assert fresh_optimizer[4] == pytest.approx(after[4], rel=1e-6)
            assert fresh_optimizer[5] != pytest.approx(after[5], rel=1e-6)  # moved by moments that started afresh
    one_rank, two_ranks = (predictions(tmp_path / f"predictions-{layout}.jsonl") for layout in ("one", "fsdp"))
    assert [r["index"] for r in one_rank] == [r["index"] for r in two_ranks] and one_rank
    tokens = [(a, b) for x, y in zip(one_rank, two_ranks) for a, b in zip(x["prediction"], y["prediction"])]
    assert sum(a == b for a, b in tokens) >= 0.99 * len(tokens)  # argmaxes; a near-tie may flip with the batching


def predictions(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]
