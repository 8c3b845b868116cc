"""The master-weights plugin: bf16 weights and gradients, an fp32 master copy in the optimizer
(Megatron's --bf16), trained, resumed and refused where it does not apply; and the per-group
learning rates a run logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coretrain import UserError
from coretrain.testing import run_steps

BF16 = {"run": {"precision": "bf16"}}


def masters_of(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(optimizer.pairs)


def test_weights_are_bf16_and_the_optimizer_updates_an_fp32_copy(tmp_path: Path) -> None:
    result = run_steps(tmp_path / "mw", 20, tables={"master-weights": {}}, config=BF16)
    autocast = run_steps(tmp_path / "ac", 20, config=BF16)
    pairs = masters_of(result.run.optimizer)
    assert pairs and all(w.dtype == torch.bfloat16 and m.dtype == torch.float32 for w, m in pairs)
    assert all(torch.equal(w, m.to(torch.bfloat16)) for w, m in pairs)  # the weights are the copy, rounded
    assert [p for group in result.run.optimizer.param_groups for p in group["params"]] == [m for _, m in pairs]
    losses = [row["loss"] for row in result.metrics]
    assert losses[-1] < 0.5 * losses[0]
    assert losses == pytest.approx([row["loss"] for row in autocast.metrics], rel=0.1)  # the same training


def test_updates_below_bf16_resolution_accumulate_in_the_master_copy(tmp_path: Path) -> None:
    first = run_steps(tmp_path / "one", 1, tables={"master-weights": {}}, config={**BF16, "optimizer": {"lr": 1e-5}})
    later = run_steps(tmp_path / "ten", 10, tables={"master-weights": {}}, config={**BF16, "optimizer": {"lr": 1e-5}})
    start = [m.clone() for _, m in masters_of(first.run.optimizer)]
    moved_masters = torch.cat([(m != s).flatten() for (_, m), s in zip(masters_of(later.run.optimizer), start)])
    moved_weights = torch.cat(
        [(w != s.to(torch.bfloat16)).flatten() for (w, _), s in zip(masters_of(later.run.optimizer), start)]
    )
    # nine Adam steps of ~1e-5 move every master value; most bf16 weights (spacing ~1e-3) cannot show it
    assert moved_masters.float().mean() > 0.95
    assert moved_weights.float().mean() < 0.5


def test_a_stopped_run_resumes_exactly_from_the_saved_master_copy(tmp_path: Path) -> None:
    settings = {**BF16, "checkpoint": {"save_interval": 5}, "plugins": {"master-weights": {}}}
    whole = run_steps(tmp_path / "whole", 10, config=settings)
    run_steps(tmp_path / "split", 10, config={**settings, "train": {"exit_interval": 5}})
    resumed = run_steps(tmp_path / "split", 10, config=settings)
    assert [r["loss"] for r in resumed.metrics] == [r["loss"] for r in whole.metrics if r["step"] > 5]
    for (w, m), (w2, m2) in zip(masters_of(whole.run.optimizer), masters_of(resumed.run.optimizer)):
        assert torch.equal(m, m2) and torch.equal(w, w2)


def test_without_bf16_autocast_it_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(UserError, match='run.precision = "bf16"'):
        run_steps(tmp_path, 2, tables={"master-weights": {}})


def test_groups_with_their_own_rates_log_each_rate(tmp_path: Path) -> None:
    rules = {"rules": [{"pattern": "net.0.*", "lr_mult": 0.1}]}
    constant = {"scheduler": {"decay_style": "constant"}}
    result = run_steps(tmp_path / "groups", 4, tables={"optimizer-overrides": rules}, config=constant)
    last = result.metrics[-1]
    rates = sorted({value for name, value in last.items() if name.startswith("lr/group")})  # decay or not: 4 groups
    assert rates == pytest.approx([0.1 * last["lr"], last["lr"]])
    plain = run_steps(tmp_path / "plain", 4, config=constant)
    assert not any(name.startswith("lr/") for name in plain.metrics[-1])


@pytest.mark.slow  # 2 gloo ranks
def test_ddp_on_two_ranks_trains_like_one_rank_and_resumes_exactly(tmp_path: Path) -> None:
    from conftest import config_file, gpt_preset, in_one_job, metrics_rows, run_here

    def config(name: str, checkpoint: dict[str, Any] | None = None) -> str:
        preset = gpt_preset(tmp_path / "unused")
        preset["model"]["options"] = {"n_layer": 2, "n_head": 4, "n_embd": 32}
        settings = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 8, "log_interval": 1, "eval_iters": 0}
        extra = {
            "run": {"output_dir": str(tmp_path / name), "precision": "bf16"},
            "plugins": {"master-weights": {}},
            "checkpoint": checkpoint or {},
        }
        return str(config_file(tmp_path / f"{name}.toml", preset, extra, **settings))

    def losses(name: str) -> list[float]:
        return [row["loss"] for row in metrics_rows(tmp_path / name)]

    assert run_here("run", config("one"), cwd=tmp_path).returncode == 0
    step_4 = tmp_path / "ddp" / "checkpoints" / "step_00000004"
    runs = [["run", config("ddp", {"save_interval": 4})], ["run", config("resumed", {"resume": str(step_4)})]]
    in_one_job(tmp_path, 2, runs, "ddp", env={"OMP_NUM_THREADS": "1"})  # two jobs' runs in one job
    whole = losses("ddp")
    assert whole == pytest.approx(losses("one"), rel=2e-2)  # bf16 gradients all-reduced: rounding, not another run
    assert whole[-1] < whole[0]
    assert losses("resumed") == whole[4:]  # from the fp32 master copy
