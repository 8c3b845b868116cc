"""Every parallelism with every other: layouts that combine pipeline, data (DDP, FSDP, HSDP),
tensor, context and expert parallelism train the one-rank numbers — the loss, the gradient
norm, the validation loss and a mixture of experts' routers' losses and loads, each within a
relative 1e-5 (the reduction orders differ between layouts, nothing else may).

One job per number of ranks runs a layout family's commands one after another
(``fixtures/commands_in_one_job.py``), as separate jobs would. Every layout of 4 ranks (27, each
kind with each other: TP × FSDP, PP × EP, CP × TP × EP, ...) is tested once, in
``test_every_layout_of_four_ranks_trains_like_one_rank``; the family tests here add what that one
does not: 2 and 8 ranks, each pipeline schedule, prediction, resumes and what the logs say.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import HF_MOE, REPO, config_file, gpt_preset, hf_moe_table, in_one_job, load_script, metrics_rows

pytestmark = pytest.mark.slow  # jobs of 2, 4 and 8 gloo ranks

MOE = {"n_layer": 4, "n_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
MOE |= {"moe_capacity_factor": 1.0}  # experts that drop assignments: the choice must be the whole sequences' too
MOE |= {"moe_shared_experts": 1, "bias": True}  # (a bias of a split layer is added once, after the sum)
TRAIN = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 4, "log_interval": 1}
TRAIN |= {"eval_iters": 1, "eval_interval": 2}  # (a step on 4 ranks costs 0.75 s on 2 cores: 4 steps say it)


def figures(output_dir: Path) -> dict[tuple[int, str], float]:
    """What every layout must log as one rank does: by (step, name)."""
    kept = ("loss", "grad_norm", "lm_loss", "moe_", "moe/", "valid/loss")
    return {
        (row["step"], name): value
        for row in metrics_rows(output_dir)
        for name, value in row.items()
        if isinstance(value, float) and any(part in name for part in kept)
    }


def assert_like_one_rank(reference: dict[tuple[int, str], float], got: dict[tuple[int, str], float], name: str) -> None:
    assert sorted(got) == sorted(reference), (name, sorted(set(reference) ^ set(got))[:5])
    worst = max(abs(got[key] - value) / max(abs(value), 1e-12) for key, value in reference.items())
    assert worst <= 1e-5, (name, worst)


def run(config: Path, output_dir: Path, *sets: str) -> list[str]:
    values = (*sets, f"run.output_dir={json.dumps(str(output_dir))}")
    return ["run", str(config), *(arg for value in values for arg in ("--set", value))]


def layout(**distributed: Any) -> tuple[str, ...]:
    return tuple(f"distributed.{key}={json.dumps(value)}" for key, value in distributed.items())


def pipeline(schedule: str, microbatches: int | None = None) -> tuple[str, ...]:
    sets = (f"plugins.pipeline-parallel.pp_schedule={json.dumps(schedule)}",)
    return sets + ((f"plugins.pipeline-parallel.pp_microbatches={microbatches}",) if microbatches else ())


def predictions(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def predict(config: Path, output_dir: Path, to: Path, *sets: str) -> list[str]:
    """``coretrain predict`` of the validation split with the run's last checkpoint, into ``to``."""
    values = (*sets, f"run.output_dir={json.dumps(str(output_dir))}", 'model.loss="cross_entropy"')
    args = ["predict", str(config), "--split", "valid", "--out", str(to)]
    return [*args, *(arg for value in values for arg in ("--set", value))]


def assert_same_predictions(expected_file: Path, written_file: Path, name: str) -> None:
    """The records one rank writes: each index once, in order, every position predicted."""
    expected, written = predictions(expected_file), predictions(written_file)
    assert len(expected) > 100 and [r["index"] for r in written] == [r["index"] for r in expected], name
    assert all(len(r["prediction"]) == len(r["target"]) == 32 for r in written), name
    tokens = [(a, b) for x, y in zip(expected, written) for a, b in zip(x["prediction"], y["prediction"])]
    assert sum(a == b for a, b in tokens) >= 0.999 * len(tokens), name  # argmaxes: a near-tie may flip


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[tuple[int, str], float]]:
    """A mixture-of-experts GPT's config (4 blocks of 4 experts, top 2, load-balancing and z
    losses) and what one rank logs for it."""
    root = tmp_path_factory.mktemp("moe")
    preset = gpt_preset(root / "unused")
    preset["model"]["options"] |= MOE
    config = config_file(root / "moe.toml", preset, {"distributed": {"backend": "gloo"}}, **TRAIN)
    in_one_job(root, 1, [run(config, root / "one")], "one")
    reference = figures(root / "one")
    assert any(name == "train/moe_aux_loss" for _, name in reference) and any("valid/loss" == n for _, n in reference)
    return config, reference


def test_a_mixture_of_experts_cut_into_pipeline_stages_trains_like_one_rank(
    tmp_path: Path, moe: tuple[Path, dict[tuple[int, str], float]]
) -> None:
    """MoE × PP in every schedule (× FSDP and × EP: the 4-rank matrix): each stage adds its
    routers' losses to what it optimizes (Megatron's MoEAuxLossAutoScaler) and the stages' losses
    and loads are summed for the log."""
    config, reference = moe
    out = {name: tmp_path / name for name in ("1F1B", "GPipe", "Interleaved1F1B", "ZBV", "DualPipeV")}
    two = [run(config, out["1F1B"], *layout(pp_size=2))]
    two += [run(config, out["GPipe"], *layout(pp_size=2), *pipeline("GPipe"))]
    two += [run(config, out["Interleaved1F1B"], *layout(pp_size=2), *pipeline("Interleaved1F1B"))]
    two += [run(config, out["ZBV"], *layout(pp_size=2), *pipeline("ZBVZeroBubble"))]
    two += [run(config, out["DualPipeV"], *layout(pp_size=2), *pipeline("DualPipeV", 4))]
    in_one_job(tmp_path, 2, two, "two")
    for name, directory in out.items():
        assert_like_one_rank(reference, figures(directory), name)


def test_a_mixture_of_experts_on_sequences_split_over_ranks_trains_like_one_rank(
    tmp_path: Path, moe: tuple[Path, dict[tuple[int, str], float]]
) -> None:
    """MoE × CP 2 (with its load-balancing loss and capacity: the routing statistics of the whole
    sequences, reduced over the context ranks as Megatron-Core's router does) and CP 2 × PP 2
    interleaved (in 1F1B, and EP 2 and EP 4 over the context ranks: the 4-rank matrix)."""
    config, reference = moe
    out = {name: tmp_path / name for name in ("cp2", "cp2-pp2-interleaved")}
    in_one_job(tmp_path, 2, [run(config, out["cp2"], *layout(cp_size=2))], "two")
    four = [run(config, out["cp2-pp2-interleaved"], *layout(cp_size=2, pp_size=2), *pipeline("Interleaved1F1B"))]
    in_one_job(tmp_path, 4, four, "four")
    for name, directory in out.items():
        assert_like_one_rank(reference, figures(directory), name)


def test_experts_spread_over_part_of_the_data_parallel_ranks_train_like_one_rank(
    tmp_path: Path, moe: tuple[Path, dict[tuple[int, str], float]]
) -> None:
    """EP 2 on 4 data-parallel ranks (two groups, each copy of the experts sharded by FSDP over
    the two ranks holding it) and EP 4 on 4 (on HSDP 2 × 2: the 4-rank matrix): the one-rank
    numbers, and EP 4's predictions are one rank's."""
    config, reference = moe
    out = {name: tmp_path / name for name in ("ep2-dp4", "ep4-dp4")}
    jobs = [run(config, out["ep2-dp4"], *layout(ep_size=2, strategy="fsdp"))]
    jobs += [run(config, out["ep4-dp4"], *layout(ep_size=4, strategy="fsdp"))]
    # (one sample a batch: with a capacity, what an expert drops depends on the batch's other tokens)
    jobs += [[*predict(config, out["ep4-dp4"], tmp_path / "ep4-dp4.jsonl", *layout(ep_size=4)), "--batch-size", "1"]]
    job = in_one_job(tmp_path, 4, jobs, "four")
    assert "2 on each of 2 ranks (this rank's experts.fc.weight: (1, 128, 32))" in job.stderr  # sharded over 2
    for name, directory in out.items():
        assert_like_one_rank(reference, figures(directory), name)
    in_one_job(
        tmp_path, 1, [[*predict(config, config.parent / "one", tmp_path / "one.jsonl"), "--batch-size", "1"]], "one"
    )
    assert_same_predictions(tmp_path / "one.jsonl", tmp_path / "ep4-dp4.jsonl", "ep4-dp4")


def test_a_mixture_of_experts_with_tensor_parallelism_trains_like_one_rank(
    tmp_path: Path, moe: tuple[Path, dict[tuple[int, str], float]]
) -> None:
    """MoE × TP: attention split by heads, each expert's hidden units split over the
    tensor-parallel ranks (Megatron's expert tensor parallelism), alone and with the experts
    spread over the data-parallel ranks (EP 2 × TP 2: each rank holds half the experts' halves);
    with FSDP, pipeline and context parallelism and CP 2 × TP 2 × EP 2: the 4-rank matrix."""
    config, reference = moe
    out = {name: tmp_path / name for name in ("tp2", "tp2-ep2")}
    in_one_job(tmp_path, 2, [run(config, out["tp2"], *layout(tp_size=2))], "two")
    job = in_one_job(tmp_path, 4, [run(config, out["tp2-ep2"], *layout(tp_size=2, ep_size=2))], "four")
    assert "this rank's experts.fc.weight: (2, 64, 32)" in job.stderr  # 2 of 4 experts, 64 of 128 hidden units
    for name, directory in out.items():
        assert_like_one_rank(reference, figures(directory), name)


def test_eight_ranks_combine_four_kinds_of_parallelism_like_one_rank(
    tmp_path: Path, moe: tuple[Path, dict[tuple[int, str], float]]
) -> None:
    """On 8 ranks: PP 2 × TP 2 × EP 2 (over DP 2), PP 2 × CP 2 × TP 2, HSDP 2 × 2 × TP 2 with EP 2,
    and PP 2 × CP 2 × EP 2 (the experts over the context ranks): the one-rank numbers of two
    steps (step 2's validation follows the second update, the first to read optimizer state)."""
    config, reference = moe
    layouts = {
        "pp2-tp2-ep2": layout(pp_size=2, tp_size=2, ep_size=2),
        "pp2-cp2-tp2": layout(pp_size=2, cp_size=2, tp_size=2),
        "hsdp-tp2-ep2": layout(dp_replicate=2, tp_size=2, ep_size=2),
        "pp2-cp2-ep2": layout(pp_size=2, cp_size=2, ep_size=2),
    }
    two_steps = {key: value for key, value in reference.items() if key[0] <= 2}  # (4 steps' schedule, stopped at 2)
    runs = [run(config, tmp_path / name, *sets, "train.exit_interval=2") for name, sets in layouts.items()]
    in_one_job(tmp_path, 8, runs, "eight")
    for name in layouts:
        assert_like_one_rank(two_steps, figures(tmp_path / name), name)


RESUMES = {  # target: its sources (stopped at step 2)
    "ep2": ("ep4", "tp2-ep2"),
    "pp2": ("pp2-ep2",),
    "zbv": ("ep2",),
    "dualpipev": ("one",),
    "interleaved": ("tp2-ep2",),
    "ep4": ("ep2",),
    "pp2-ep2": ("pp2", "one"),
    "tp2-ep2": ("ep2",),
    "cp2-ep2": ("pp2",),
    "one": ("pp2-ep2", "tp2-ep2"),
}
MOE_LAYOUTS = {  # name: (ranks, --set values)
    "one": (1, ()),
    "ep2": (2, layout(ep_size=2)),
    "pp2": (2, layout(pp_size=2)),
    "zbv": (2, (*layout(pp_size=2), *pipeline("ZBVZeroBubble"))),
    "dualpipev": (2, (*layout(pp_size=2), *pipeline("DualPipeV", 4))),
    "interleaved": (2, (*layout(pp_size=2), *pipeline("Interleaved1F1B"))),
    "ep4": (4, layout(ep_size=4)),
    "pp2-ep2": (4, layout(pp_size=2, ep_size=2)),
    "tp2-ep2": (4, layout(tp_size=2, ep_size=2)),
    "cp2-ep2": (4, layout(cp_size=2, ep_size=2)),
}


def test_a_mixture_of_experts_resumes_across_expert_pipeline_and_tensor_layouts(
    tmp_path: Path, moe: tuple[Path, dict[tuple[int, str], float]]
) -> None:
    """14 pairs: EP 2 → EP 4 and back, PP 2 → PP 2 × EP 2 and back, EP 2 → ZBV stages, one rank →
    DualPipeV (a V: the first rank holds the tied head's copy too), TP 2 × EP 2 → interleaved
    stages, EP 2 and one rank, one rank → PP 2 × EP 2, PP 2 → CP 2 × EP 2: each source stops at
    step 2, each target resumes it and logs the uninterrupted one-rank figures of steps 3–4."""
    config, reference = moe
    sources = {name for names in RESUMES.values() for name in names}
    stopped = {name: tmp_path / "from" / name for name in sources}

    def source(name: str) -> list[str]:
        return run(config, stopped[name], *MOE_LAYOUTS[name][1], "train.exit_interval=2")

    def targets(name: str) -> list[list[str]]:
        return [
            run(
                config,
                tmp_path / name / f"from-{origin}",
                *MOE_LAYOUTS[name][1],
                f"checkpoint.resume={json.dumps(str(stopped[origin] / 'checkpoints' / 'step_00000002'))}",
            )
            for origin in RESUMES[name]
        ]

    by_ranks = {ranks: [name for name, (n, _) in MOE_LAYOUTS.items() if n == ranks] for ranks in (1, 2, 4)}
    in_one_job(tmp_path, 1, [source(name) for name in by_ranks[1] if name in sources], "one-sources")
    in_one_job(tmp_path, 2, [source(name) for name in by_ranks[2] if name in sources], "two-sources")
    four = [source(name) for name in by_ranks[4] if name in sources]
    in_one_job(tmp_path, 4, four + [t for name in by_ranks[4] for t in targets(name)], "four")
    in_one_job(tmp_path, 2, [t for name in by_ranks[2] for t in targets(name)], "two-targets")
    in_one_job(tmp_path, 1, [t for name in by_ranks[1] for t in targets(name)], "one-targets")
    after = {key: value for key, value in reference.items() if key[0] > 2}
    for name, origins in RESUMES.items():
        for origin in origins:
            got = {key: value for key, value in figures(tmp_path / name / f"from-{origin}").items() if key[0] > 2}
            assert_like_one_rank(after, got, f"{origin} -> {name}")


def test_hugging_face_mixtures_of_experts_train_like_one_rank_on_expert_and_pipeline_ranks(tmp_path: Path) -> None:
    """Mixtral-, Qwen2-MoE-, Qwen3-MoE- and DeepSeek-V3-shaped models built from a config: EP 2 on
    4 data-parallel ranks (FSDP over the rest), PP 2, and for Mixtral interleaved stages and
    PP 2 × EP 2 — the one-rank loss, grad norm, transformers' load-balancing loss (one formula
    over every layer, finished on the last stage) and the experts' loads."""
    out: dict[str, Path] = {}
    one, two, four = [], [], []
    for kind in sorted(HF_MOE):
        preset = gpt_preset(tmp_path / "unused")
        preset["model"] = {"provider": "hf", "options": {"config": hf_moe_table(kind, layers=4)}}
        config = config_file(tmp_path / f"{kind}.toml", preset, {"distributed": {"backend": "gloo"}}, **TRAIN)
        out |= {name: tmp_path / name for name in (f"{kind}-one", f"{kind}-ep2-dp4", f"{kind}-pp2")}
        one += [run(config, out[f"{kind}-one"])]
        two += [run(config, out[f"{kind}-pp2"], *layout(pp_size=2))]
        four += [run(config, out[f"{kind}-ep2-dp4"], *layout(ep_size=2))]
        if kind == "mixtral":
            out |= {name: tmp_path / name for name in ("mixtral-interleaved", "mixtral-pp2-ep2")}
            two += [run(config, out["mixtral-interleaved"], *layout(pp_size=2), *pipeline("Interleaved1F1B"))]
            four += [run(config, out["mixtral-pp2-ep2"], *layout(pp_size=2, ep_size=2))]
    in_one_job(tmp_path, 1, one, "one")
    in_one_job(tmp_path, 2, two, "two")
    job = in_one_job(tmp_path, 4, four, "four")
    assert "2 on each of 2 ranks (this rank's experts.gate_up_proj: (1, 64, 32))" in job.stderr  # sharded over 2
    for kind in sorted(HF_MOE):
        reference = figures(out[f"{kind}-one"])
        assert (kind == "deepseek_v3") != any(name == "train/moe_aux_loss" for _, name in reference)
        for name in [name for name in out if name.startswith(kind) and name != f"{kind}-one"]:
            assert_like_one_rank(reference, figures(out[name]), name)


def test_every_layout_evaluates_every_sample_and_predicts_whole_records(tmp_path: Path) -> None:
    """A full evaluation pass in micro-batches of 3 (its last one partial; 3 divides no batch
    here) trains and validates the one-rank numbers on PP 2, CP 2 and TP 2, and `coretrain
    predict` writes the file one rank writes: every record, every position (a pipeline keeps no
    first batch's shapes; context ranks gather their positions)."""
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"]["n_layer"] = 2
    train = {**TRAIN, "eval_full": True, "eval_micro_batch_size": 3}
    config = config_file(tmp_path / "dense.toml", preset, {"distributed": {"backend": "gloo"}}, **train)
    layouts = {"one": (), "pp2": layout(pp_size=2), "cp2": layout(cp_size=2), "tp2": layout(tp_size=2)}
    out = {name: tmp_path / name for name in layouts}

    def predicted(name: str) -> list[str]:
        return predict(config, out[name], tmp_path / f"{name}.jsonl", *layouts[name])

    in_one_job(tmp_path, 1, [run(config, out["one"]), predicted("one")], "one")
    two = [
        command
        for name in ("pp2", "cp2", "tp2")
        for command in (run(config, out[name], *layouts[name]), predicted(name))
    ]
    in_one_job(tmp_path, 2, two, "two")
    reference = figures(out["one"])
    assert any(name == "valid/loss" for _, name in reference)
    for name in ("pp2", "cp2", "tp2"):
        assert_like_one_rank(reference, figures(out[name]), name)
        assert_same_predictions(tmp_path / "one.jsonl", tmp_path / f"{name}.jsonl", name)


def test_a_rampups_small_first_batches_run_on_a_pipeline(tmp_path: Path) -> None:
    """A batch-size rampup from 2 samples (one micro-batch, fewer than the stages): 1F1B runs
    those steps as GPipe (the same numbers) and trains the one-rank losses; a V-shaped schedule,
    which cannot, is one error naming rampup_batch_size before the first step."""
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"]["n_layer"] = 2
    extra = {"distributed": {"backend": "gloo"}, "plugins": {"batch-rampup": {"rampup_batch_size": [2, 2, 16]}}}
    config = config_file(tmp_path / "rampup.toml", preset, extra, **{**TRAIN, "train_iters": 8})
    in_one_job(tmp_path, 1, [run(config, tmp_path / "one")], "one")
    dual = [*run(config, tmp_path / "dual", *layout(pp_size=2), *pipeline("DualPipeV"), "model.options.n_layer=4")]
    job = in_one_job(
        tmp_path, 2, [run(config, tmp_path / "pp2", *layout(pp_size=2)), {"args": dual, "expect": 2}], "two"
    )
    assert "pipeline-parallel: steps of 1 micro-batch(es) run as GPipe" in job.stderr
    assert "plugins.batch-rampup.rampup_batch_size: the first steps have 1 micro-batch(es)" in job.stderr
    reference = figures(tmp_path / "one")
    batches = {row["global_batch_size"] for row in metrics_rows(tmp_path / "one") if "global_batch_size" in row}
    assert {2.0, 8.0} <= batches  # it ramped
    assert_like_one_rank(reference, figures(tmp_path / "pp2"), "pp2")


def test_every_layout_of_four_ranks_trains_like_one_rank(tmp_path: Path) -> None:
    """All 27 layouts of 4 ranks, not a selection: ``benchmarks/layout_matrix.py``'s enumeration
    of pp × dp_replicate × dp_shard × cp × tp and every ep_size each can take (DDP beside FSDP),
    run in one job (its ranks forked warm, where the script starts torchrun) and each compared
    with one rank (at 8 ranks it takes 34 minutes on 2 cores: run by hand, docs/scaling.md has
    its figures). Two steps, each validated: the second update reads the optimizer state each
    layout shards its own way, and step 2's validation loss is computed after it; steps 3 and 4
    cost 64 more CPU-seconds on 27 layouts."""
    matrix = load_script(REPO / "benchmarks" / "layout_matrix.py")
    chosen = matrix.layouts(4)
    config = matrix.write_config(tmp_path, ranks=4, steps=2)
    in_one_job(tmp_path, 1, [run(config, tmp_path / "one")], "one")
    in_one_job(tmp_path, 4, matrix.plan(config, tmp_path, chosen), "four")  # (each command run whatever its exit)
    codes = json.loads((tmp_path / "four.json.codes").read_text())
    lines, within = matrix.report(tmp_path, chosen, codes, 1e-5)
    assert len(chosen) == 27 and within == 27, "\n".join(lines)
