"""Pipeline parallelism: a GPT cut into stages over gloo ranks (1F1B, GPipe, Interleaved1F1B and
the zero-bubble ZBVZeroBubble and DualPipeV, blocks placed evenly or by hand; PP 4, PP 2 × DP 2,
PP 2 × HSDP and PP 2 × TP 2 on 4 ranks; with recomputation and compiled) and a Llama cut by
decoder layer train and evaluate the losses of one rank (and log its parameter and per-block
gradient norms), stop and resume, and resume across
layouts and schedules (1 rank → PP 2 → 1 rank, PP 2 × TP 2 → PP 2, ZBV → DualPipeV)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import config_file, gpt_preset, in_one_job, metrics_rows, run_here, run_train, train_llama

from coretrain import UserError
from coretrain.testing import run_steps

TRAIN = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 15, "log_interval": 3}
TRAIN |= {"eval_iters": 1, "eval_interval": 9}  # at step 9 and after the last
SCHEDULE = {"decay_iters": 30}
"""The learning rates of the 30-step runs this test trained before (their first 15 steps): a
faster decay moves the weights further in the first steps, and a gradient norm of one block
(0.08) then differs between GPipe's and one rank's reduction order by 1.4e-05 at step 9."""
STOP = ["--set", "train.exit_interval=6"]
"""Where a run stops to be resumed (on another layout or schedule): 9 more steps, 3 logs and an
evaluation after it."""


def write(tmp_path: Path, name: str, distributed: dict[str, Any], **pipeline: Any) -> Path:
    preset = gpt_preset(tmp_path / name)
    preset["model"]["options"] |= {"n_layer": 4}
    plugins = {"model-stats": {"layer_grad_norms": True}, "schedule": SCHEDULE}
    sections: dict[str, Any] = {"distributed": distributed, "plugins": plugins}
    if pipeline:
        sections["plugins"]["pipeline-parallel"] = pipeline
    return config_file(tmp_path / f"{name}.toml", preset, sections, **TRAIN)


def schedule(name: str) -> list[str]:
    return ["--set", f'plugins.pipeline-parallel.pp_schedule="{name}"']


def losses(out: Path) -> list[tuple[int, str, float]]:
    """The figures one rank logs and every layout must: losses, norms (the whole model's
    parameters and each block's gradients: model-stats), zero gradients."""
    return [
        (row["step"], key, row[key])
        for row in metrics_rows(out)
        for key in sorted(row)
        if key in ("loss", "grad_norm", "valid/loss", "params_norm", "zero_grads") or key.startswith("grad_norm/")
    ]


@pytest.mark.slow  # 2 and 4 gloo ranks
def test_stages_over_ranks_train_evaluate_and_resume_like_one_rank(tmp_path: Path) -> None:
    one_config = write(tmp_path, "one", {})
    one_run = run_train(str(one_config), cwd=tmp_path)
    assert one_run.returncode == 0
    (size,) = {
        line.split(": ")[-1].split(" parameters,")[0] for line in one_run.stdout.splitlines() if " parameters, " in line
    }
    veto = ["--set", 'plugins.fault-injection.action="skip"', "--set", "plugins.fault-injection.step=5"]
    skipped_once = write(tmp_path, "one_skipped", {})  # step 5's update vetoed
    assert (
        run_train(str(skipped_once), *veto, "--set", "plugins.fault-injection.ranks=[0]", cwd=tmp_path).returncode == 0
    )
    predict = ["predict", str(one_config), "--set", 'model.loss="cross_entropy"', "--split", "valid", "--out"]
    to_pp = write(tmp_path, "to_pp", {})  # 1 rank → PP 2: a replicated checkpoint into two stages
    assert run_train(str(to_pp), *STOP, cwd=tmp_path).returncode == 0
    pp_tp = write(tmp_path, "pp_tp", {"pp_size": 2, "tp_size": 2})  # PP 2 × TP 2, then resumed on PP 2
    four = [
        ["run", str(write(tmp_path, "pp4", {"pp_size": 4}))],
        ["run", str(write(tmp_path, "pp2dp2", {"pp_size": 2}))],
        # DualPipeV over HSDP: 2 micro-batches a step, each cut in 4 for the pipeline
        [
            "run",
            str(
                write(
                    tmp_path, "pp_hsdp", {"pp_size": 2, "dp_replicate": 2}, pp_schedule="DualPipeV", pp_microbatches=4
                )
            ),
        ],
        ["run", str(pp_tp), *STOP],
    ]
    in_one_job(tmp_path, 4, four, "pp4")
    resumed = write(tmp_path, "resumed", {"pp_size": 2})
    interleaved = write(tmp_path, "interleaved", {"pp_size": 2})

    signalled = write(tmp_path, "signalled", {"pp_size": 2})  # SIGTERM on the last stage alone: an agreed stop
    sigterm = ["--set", 'plugins.fault-injection.action="sigterm"', "--set", "plugins.fault-injection.step=5"]
    sigterm += ["--set", "plugins.fault-injection.ranks=[1]"]
    from_pp = write(tmp_path, "from_pp", {"pp_size": 2})
    jobs = [
        ["run", str(write(tmp_path, "pp", {"pp_size": 2}))],
        ["run", str(write(tmp_path, "gpipe", {"pp_size": 2}, pp_schedule="GPipe", pp_microbatches=2, pp_split=[1, 3]))],
        ["run", str(resumed), *STOP, *schedule("ZBVZeroBubble")],
        ["run", str(resumed), *schedule("DualPipeV")],  # resumed on the other zero-bubble schedule
        # two stages per rank (4 of one block each), run as torch's interleaved 1F1B; stopped, then
        # resumed on one stage per rank
        ["run", str(interleaved), *schedule("Interleaved1F1B"), *STOP],
        ["run", str(interleaved)],
        {"args": ["run", str(signalled), *sigterm], "expect": 128 + 15},
        # the last stage alone vetoes step 5's update (as a guard seeing its loss would): both skip it
        ["run", str(write(tmp_path, "skipped", {"pp_size": 2})), *veto, "--set", "plugins.fault-injection.ranks=[1]"],
        ["run", str(signalled)],
        ["run", str(to_pp), "--set", "distributed.pp_size=2"],
        ["run", str(from_pp), *STOP, *schedule("ZBVZeroBubble")],  # V: tied on rank 0
        ["run", str(pp_tp), "--set", "distributed.tp_size=1"],
        [
            "run",
            str(write(tmp_path, "recomputed", {"pp_size": 2})),
            "--set",
            'plugins.activation-checkpointing.mode="full"',
        ],
        ["run", str(write(tmp_path, "compiled", {"pp_size": 2})), "--set", 'plugins.compile.backend="eager"'],
        [*predict, str(tmp_path / "pp.jsonl"), "--set", "distributed.pp_size=2"],  # the logits of the last stage
        {"args": ["run", str(write(tmp_path, "odd", {"pp_size": 2})), "--set", "model.options.n_layer=3"], "expect": 2},
        {
            "args": ["run", str(write(tmp_path, "few", {"pp_size": 2})), "--set", "train.global_batch_size=2"],
            "expect": 2,
        },
    ]
    job = in_one_job(tmp_path, 2, jobs, "pp")
    said = job.stdout + job.stderr
    assert f": {size} parameters, global batch 8" in said  # the whole model's, not one stage's
    assert "pipeline-parallel: 2 stages of [2, 2] blocks, 1F1B schedule" in job.stderr
    assert "pipeline-parallel: 4 stages of [1, 1, 1, 1] blocks, Interleaved1F1B schedule" in job.stderr
    assert "pipeline-parallel: 4 stages of [1, 1, 1, 1] blocks, ZBVZeroBubble schedule" in job.stderr
    assert "distributed.pp_size (2) must divide the model's 3 blocks" in job.stderr
    assert "the 1F1B schedule needs at least as many micro-batches per step as stages, and a step has 1" in job.stderr
    assert run_train(str(from_pp), "--set", "distributed.pp_size=1", cwd=tmp_path).returncode == 0  # PP 2 → 1 rank
    assert run_here(*predict, str(tmp_path / "one.jsonl"), cwd=tmp_path).returncode == 0
    predicted = {name: (tmp_path / f"{name}.jsonl").read_text().splitlines() for name in ("one", "pp")}
    assert len(predicted["one"]) > 100 and predicted["pp"] == predicted["one"]
    one = losses(tmp_path / "one")
    assert [key for _, key, _ in one].count("valid/loss") == 2
    names = "pp gpipe resumed interleaved signalled to_pp from_pp pp4 pp2dp2 pp_hsdp pp_tp recomputed compiled".split()
    for name, reference in [*((name, "one") for name in names), ("skipped", "one_skipped")]:
        expected, split = losses(tmp_path / reference), losses(tmp_path / name)
        assert [(s, k) for s, k, _ in split] == [(s, k) for s, k, _ in expected], name
        assert all(b == pytest.approx(a, rel=1e-5) for (_, _, a), (_, _, b) in zip(expected, split)), (name, split)
    assert max(row.get("skipped_updates", 0) for row in metrics_rows(tmp_path / "skipped")) == 1
    assert losses(tmp_path / "skipped")[6:9] != losses(tmp_path / "one")[6:9]  # the skip changed what followed


@pytest.mark.parametrize(("key", "rest"), [("cp_size", "ranks / tp_size"), ("pp_size", "ranks / tp_size / cp_size")])
def test_more_context_or_pipeline_ranks_than_there_are_is_one_error(tmp_path: Path, key: str, rest: str) -> None:
    preset = gpt_preset(tmp_path)
    config = {name: preset[name] for name in ("model", "data", "optimizer")} | {"distributed": {key: 2}}
    with pytest.raises(UserError, match=rf"distributed.{key} \(2\) must divide {rest} \(1\)"):
        run_steps(tmp_path, steps=1, config=config)


def test_a_pipeline_table_on_one_stage_is_one_error(tmp_path: Path) -> None:
    preset = gpt_preset(tmp_path)
    config = {name: preset[name] for name in ("model", "data", "optimizer")} | {"plugins": {"pipeline-parallel": {}}}
    with pytest.raises(UserError, match=r"distributed.pp_size is 1, so there is nothing to cut into stages"):
        run_steps(tmp_path, steps=1, config=config)


def test_a_pipeline_on_ddp_is_one_error() -> None:
    from coretrain.config import DistributedConfig

    with pytest.raises(
        UserError, match='pp_size = 2 is pipelined, a layout of FSDP2: set distributed.strategy = "fsdp"'
    ):
        DistributedConfig(pp_size=2, strategy="ddp").check_layout(4)


@pytest.mark.parametrize(
    ("layers", "split", "sizes"),
    [(8, None, [4, 4]), (8, [3, 5], [3, 5]), (7, None, None), (8, [4, 3], None), (8, [8, 0], None)],
)
def test_blocks_are_placed_evenly_or_as_given(layers: int, split: list[int] | None, sizes: list[int] | None) -> None:
    from coretrain_pipeline_parallel.stages import stage_sizes

    if sizes is None:
        with pytest.raises(UserError, match="pp_size \\(2\\) must divide the model's 7 blocks|must give each of the 2"):
            stage_sizes(layers, 2, split)
    else:
        assert stage_sizes(layers, 2, split) == sizes


def test_a_model_without_a_stage_split_is_one_error() -> None:
    """A provider that does not answer ``pipeline_split`` (an import-path model here) is named."""
    from types import SimpleNamespace

    from coretrain_pipeline_parallel.stages import Pipeline

    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 0)
    plugins = SimpleNamespace(implemented=lambda name: False, calls=SimpleNamespace(hook=None))
    run: Any = SimpleNamespace(device_mesh=lambda: {"pp": mesh}, plugins=plugins, micro_batches_per_step=2)
    run.model, run.config = object(), SimpleNamespace(model=SimpleNamespace(provider="mymodels:build"))
    with pytest.raises(
        UserError, match="the model provider 'mymodels:build' does not cut its object into pipeline stages"
    ):
        from coretrain_pipeline_parallel import PipelineParallel

        Pipeline.of(run, PipelineParallel())


@pytest.mark.slow  # 2 gloo ranks
@pytest.mark.parametrize("tied", [False, True])
def test_a_hugging_face_llama_cut_into_stages_trains_like_one_rank(tmp_path: Path, tied: bool) -> None:
    """By decoder layer, rotary positions on every stage, grouped-query attention; with the head
    tied to the embedding on a zero-bubble V, whose first rank holds both, the two sum its gradient."""
    pytest.importorskip("transformers")
    pipeline = {"pp_size": 2} | ({"plugins": {"pipeline-parallel": {"pp_schedule": "ZBVZeroBubble"}}} if tied else {})
    train_llama(tmp_path, {"one": {}, "pp": pipeline}, TRAIN, num_hidden_layers=4, tie_word_embeddings=tied)
    runs = {name: losses(tmp_path / name) for name in ("one", "pp")}
    assert [(s, k) for s, k, _ in runs["pp"]] == [(s, k) for s, k, _ in runs["one"]]
    assert all(b == pytest.approx(a, rel=1e-5) for (_, _, a), (_, _, b) in zip(runs["one"], runs["pp"])), runs


def test_zero_bubble_stages_go_down_the_ranks_and_back() -> None:
    from coretrain_pipeline_parallel.stages import local_stages

    assert [local_stages("ZBVZeroBubble", 4, rank, 3) for rank in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [local_stages("DualPipeV", 2, rank, 2) for rank in range(2)] == [[0, 3], [1, 2]]


def test_dualpipev_with_fewer_micro_batches_than_stages_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import torch
    from coretrain_pipeline_parallel import PipelineParallel
    from coretrain_pipeline_parallel.stages import Pipeline

    monkeypatch.setattr(torch, "__version__", "2.10.0")  # (on 2.9 a V is one error of its own)

    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 0)
    hook = SimpleNamespace(pipeline_split=lambda run, model: {"layers": 4})
    plugins = SimpleNamespace(implemented=lambda name: True, calls=SimpleNamespace(hook=hook))
    run: Any = SimpleNamespace(device_mesh=lambda: {"pp": mesh}, plugins=plugins, micro_batches_per_step=2, model=None)
    with pytest.raises(UserError, match=r"DualPipeV schedule needs at least as many micro-batches per step as stages"):
        Pipeline.of(run, PipelineParallel(pp_schedule="DualPipeV"))


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_several_stages_per_rank_on_torch_2_9_is_one_error(monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    """torch 2.9 evaluates looped stages wrongly (NaN) and runs V-shaped ones through sends to the
    rank itself (gloo: "Pair is not connected")."""
    import torch
    from coretrain_pipeline_parallel.stages import check_torch_runs

    monkeypatch.setattr(torch, "__version__", "2.10.0")
    check_torch_runs(schedule)
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    check_torch_runs("1F1B")
    check_torch_runs("GPipe")
    with pytest.raises(UserError, match=rf"pp_schedule = '{schedule}' needs torch 2.10 or newer \(this is 2.9.1"):
        check_torch_runs(schedule)


def test_a_zero_bubble_schedule_on_compiled_stages_is_one_error() -> None:
    """torch runs a compiled backward once; a split backward would run it twice."""
    from types import SimpleNamespace

    import torch
    from coretrain_pipeline_parallel.stages import Pipeline

    pipeline = Pipeline.__new__(Pipeline)
    pipeline.run, pipeline.schedule_name = SimpleNamespace(model=torch.nn.Linear(2, 2), model_parts=[]), "DualPipeV"
    pipeline._check_uncompiled()
    pipeline.run.model.compile()
    with pytest.raises(UserError, match="'DualPipeV' splits each backward .* not run on compiled stages"):
        pipeline._check_uncompiled()


def test_interleaved_stages_loop_over_the_ranks() -> None:
    from coretrain_pipeline_parallel.stages import local_stages, stage_sizes

    assert [local_stages("Interleaved1F1B", 4, rank, 2) for rank in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert local_stages("1F1B", 4, 2, 2) == [2]
    with pytest.raises(UserError, match=r"distributed.pp_size \(4\) × 2 stages per rank must divide the model's 12"):
        stage_sizes(12, 8, None, per_rank=2)
