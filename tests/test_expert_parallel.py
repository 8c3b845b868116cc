"""Expert parallelism: a mixture of experts' experts spread over 2 gloo ranks, tokens sent by
all-to-all, trains the losses of one rank and resumes across the layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import config_file, gpt_preset, in_one_job, metrics_rows, run_train

from coretrain import UserError
from coretrain.testing import run_steps

MOE = {"n_layer": 2, "n_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
TRAIN = {"micro_batch_size": 2, "global_batch_size": 4, "train_iters": 12, "log_interval": 3, "eval_iters": 1}


def write(tmp_path: Path, name: str, ep: bool, **train: Any) -> Path:
    preset = gpt_preset(tmp_path / name)
    preset["model"]["options"] |= MOE
    extra = {"distributed": {"ep_size": 2}} if ep else {}
    extra["checkpoint"] = {"save_interval": 6}
    return config_file(tmp_path / f"{name}.toml", preset, extra, **{**TRAIN, "eval_interval": 6, **train})


def losses(out: Path) -> list[tuple[int, float]]:
    return [(row["step"], row.get("loss", row.get("valid/loss"))) for row in metrics_rows(out)]


def assert_same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> None:
    assert [s for s, _ in a] == [s for s, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert y == pytest.approx(x, rel=1e-5)


@pytest.mark.slow  # 2 gloo ranks
def test_experts_spread_over_two_ranks_train_like_one_rank_and_resume_across_layouts(tmp_path: Path) -> None:
    """One rank's run and the first half of one → EP 2 here; then one job (its start-up
    paid once) runs EP 2, the first half of EP 2 → one rank, and the second half of one → EP 2."""
    assert run_train(str(write(tmp_path, "one", ep=False)), cwd=tmp_path).returncode == 0
    grow = write(tmp_path, "one_then_ep", ep=False)
    assert run_train(str(grow), "--set", "train.exit_interval=6", cwd=tmp_path).returncode == 0
    split = write(tmp_path, "ep_then_one", ep=True)
    jobs: list[Any] = [
        ["run", str(write(tmp_path, "ep", ep=True))],
        ["run", str(split), "--set", "train.exit_interval=6"],
        ["run", str(grow), "--set", "distributed.ep_size=2"],
    ]
    dense, odd = write(tmp_path, "dense", ep=True), write(tmp_path, "odd", ep=True)
    jobs += [{"args": ["run", str(dense), "--set", "model.options.n_experts=0"], "expect": 2}]
    jobs += [
        {
            "args": ["run", str(odd), "--set", "model.options.n_experts=3", "--set", "model.options.moe_top_k=1"],
            "expect": 2,
        }
    ]
    job = in_one_job(tmp_path, 2, jobs, "ep")
    assert "distributed.ep_size (2): the model has no experts to spread" in job.stderr
    assert "distributed.ep_size (2) must divide model.options.n_experts (3)" in job.stderr
    # each rank holds 2 of the 4 experts (fc: 128 × 32 each); a forward over all 4 would fail
    assert "2 on each of 2 ranks (this rank's experts.fc.weight: (2, 128, 32))" in job.stderr
    alone = run_train(str(split), "--set", "distributed.ep_size=1", cwd=tmp_path)
    assert alone.returncode == 0 and "(step 6," in alone.stderr, alone.stderr
    for name in ("ep", "ep_then_one", "one_then_ep"):  # EP 2; EP 2 → one rank; one rank → EP 2
        assert_same(losses(tmp_path / "one"), losses(tmp_path / name))


def test_a_layout_expert_parallelism_cannot_take_is_one_error_before_any_rank_starts(tmp_path: Path) -> None:
    """Checked from the config and the world size alone (as the launcher checks a job)."""
    from coretrain_expert_parallel import check_expert_groups

    from coretrain.config import DistributedConfig

    cases = [
        ({"ep_size": 3}, 4, r"ep_size \(3\) must divide the ranks of one data-parallel replica times cp_size \(4 × 1"),
        ({"ep_size": 2, "cp_size": 4}, 8, r"ep_size \(2\) must be a multiple of distributed.cp_size \(4\)"),
        ({"ep_size": 4, "dp_replicate": 2}, 4, r"ep_size \(4\) must divide the ranks of one data-parallel replica"),
    ]
    for layout, world, expected in cases:
        DistributedConfig(**layout).check_layout(world)  # the core's grid holds: the plugin refuses it
        with pytest.raises(UserError, match=expected):
            check_expert_groups(DistributedConfig(**layout), world)
    for layout, world in (
        ({"ep_size": 2}, 4),
        ({"ep_size": 4, "cp_size": 2}, 4),
        ({"ep_size": 2, "dp_replicate": 2}, 4),
    ):
        check_expert_groups(DistributedConfig(**layout), world)  # expert groups inside a replica, whole context groups
    preset = gpt_preset(tmp_path)
    preset["model"]["options"] |= MOE
    config = {name: preset[name] for name in ("model", "data", "optimizer")} | {"distributed": {"ep_size": 2}}
    with pytest.raises(UserError, match=r"distributed.ep_size \(2\) must divide the ranks of one data-parallel"):
        run_steps(tmp_path, steps=1, config=config)
