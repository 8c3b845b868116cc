"""Tensor parallelism (and 2-D with FSDP2) on real gloo ranks, against one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import config_file, gpt_preset, in_one_job, metrics_rows, run_cli, run_train, torchrun

from coretrain.testing import tiny_config, write_config


def losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics_rows(out) if "loss" in row}


def assert_same_losses(reference: dict[int, float], got: dict[int, float], first_step: int = 1) -> None:
    assert sorted(got) == [s for s in sorted(reference) if s >= first_step]
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step


@pytest.mark.slow
def test_gpt_on_tp2_by_dp2_matches_one_rank_and_its_checkpoint_resumes_at_tp4(tmp_path: Path) -> None:
    """4 ranks as 2 tensor-parallel groups of 2 (FSDP2 over the data-parallel dimension), 20
    steps against one process; the DCP checkpoint of step 10 then resumes on 4 ranks as one
    group of 4, and every step matches."""
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"] = {"n_layer": 2, "n_head": 4, "n_embd": 32}

    def config(name: str, checkpoint: dict[str, object] | None = None, **distributed: object) -> Path:
        train = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 20, "log_interval": 1, "eval_iters": 0}
        extra = {
            "run": {"output_dir": str(tmp_path / name)},
            "checkpoint": {"save_interval": 10, **(checkpoint or {})},
            "distributed": distributed,
            "plugins": {"model-stats": {}},  # its norm must add up replicated and split weights alike
        }
        return config_file(tmp_path / f"{name}.toml", preset, extra, **train)

    one = run_train(str(config("one")), cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    reference = losses(tmp_path / "one")
    assert len(reference) == 20 and reference[20] < reference[1]

    step_10 = tmp_path / "tp2" / "checkpoints" / "step_00000010"
    resume = {"resume": str(step_10)}  # (into FSDP, DDP and one rank: test_layouts.py)
    both = [["run", str(config("tp2", tp_size=2))], ["run", str(config("tp4", resume, tp_size=4))]]
    job = in_one_job(tmp_path, 4, both, "tp", env={"OMP_NUM_THREADS": "1"})  # two jobs' runs, one start-up
    assert "tensor-parallel: 2 ranks per group split 14 plan entries; data parallel over 2" in job.stderr
    assert_same_losses(reference, losses(tmp_path / "tp2"))
    norms = [[row["params_norm"] for row in metrics_rows(tmp_path / name)] for name in ("one", "tp2")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    assert len(list((step_10 / "sharded").glob("*.distcp"))) == 4  # written sharded by DCP

    assert "4 ranks per group" in job.stderr and "data parallel over 1" in job.stderr
    assert_same_losses(reference, losses(tmp_path / "tp4"), first_step=11)


@pytest.mark.slow
def test_a_model_without_a_provider_plan_takes_one_from_the_config(tmp_path: Path) -> None:
    """The tiny regression model (an import-path provider: no plan of its own) on 2 ranks of
    tensor parallelism: no plan is one error naming its Linear modules, a key that matches
    nothing is one error, DDP is refused, and the config's plan trains as one rank does."""

    def run(name: str, tp: dict[str, object] | None, strategy: str = "auto", expect: int = 2) -> dict[str, Any]:
        config = tiny_config(
            tmp_path / name,
            distributed={"tp_size": 2, "strategy": strategy, "backend": "gloo"},
            train={"log_interval": 1},
            **({"plugins": {"tensor-parallel": tp}} if tp is not None else {}),
        )
        return {"args": ["run", str(write_config(tmp_path / f"{name}.toml", config))], "expect": expect}

    plan = {"plan": {"net.0": "colwise", "net.3": "rowwise"}}
    job = in_one_job(  # the four as four jobs would run them, in one job
        tmp_path,
        2,
        [
            run("none", None),
            run("typo", {"plan": {"net.0": "colwise", "net.4": "rowwise"}}),
            run("ddp", plan, strategy="ddp"),
            run("split", plan, expect=0),
        ],
        "plans",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert "gives no tensor-parallel plan" in job.stderr and "(Linear modules: net.0, net.3)" in job.stderr
    assert "plan key(s) net.4 match no module of the model (its top-level modules: net)" in job.stderr
    assert 'use distributed.strategy = "fsdp"' in job.stderr
    one = write_config(tmp_path / "one.toml", tiny_config(tmp_path / "one", train={"log_interval": 1}))
    assert run_train(str(one), cwd=tmp_path).returncode == 0
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "split"))


def test_a_tp_size_that_does_not_divide_the_ranks_or_an_unknown_style_is_one_error(tmp_path: Path, cli: Any) -> None:
    config = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", distributed={"tp_size": 2}))
    result = cli("run", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert (
        "error: distributed.tp_size (2) must divide the number of ranks (1); start a multiple of 2 ranks, "
        "or set distributed.tp_size = 1" in result.stderr
    )
    assert "Traceback" not in result.stderr

    bad = tiny_config(
        tmp_path / "out", distributed={"tp_size": 2}, plugins={"tensor-parallel": {"plan": {"net.0": "column"}}}
    )
    result = cli("run", str(write_config(tmp_path / "bad.toml", bad)), cwd=tmp_path)
    assert result.returncode == 2
    assert "plugins.tensor-parallel.plan.net.0" in result.stderr and "unknown style 'column'" in result.stderr


@pytest.mark.slow
def test_weight_hash_compares_the_weights_a_tensor_parallel_group_replicates(tmp_path: Path, site: Path) -> None:
    """On tp 2, the norms are replicated in the group and the projections split: a healthy run
    raises no alarm (split parts are not compared with each other), and a norm nudged on one
    rank is named."""
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"] = {"n_layer": 1, "n_head": 2, "n_embd": 32}
    extra = {"distributed": {"tp_size": 2}, "plugins": {"weight-hash": {"interval": 5}}}

    def run(name: str, **plugins: dict[str, object]) -> list[str]:
        tables = {**extra, "run": {"output_dir": str(tmp_path / name)}, "plugins": {**extra["plugins"], **plugins}}
        return ["run", str(config_file(tmp_path / f"{name}.toml", preset, tables, train_iters=12, eval_iters=0))]

    nudge = {"perturb-weights": {"rank": 1, "at_step": 7, "parameter": "ln_f.weight"}}
    runs = [run("healthy"), {"args": run("nudged", **nudge), "expect": 4}]  # as two jobs would run them
    job = in_one_job(tmp_path, 2, runs, "hashes", env={"PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"})
    healthy, _, nudged = job.stderr.partition("=== coretrain run " + str(tmp_path / "nudged.toml"))
    assert "replicas differ" not in healthy
    assert "replicas differ, first at parameter 'ln_f.weight' (ranks grouped by value: [[0], [1]])" in nudged


@pytest.mark.slow
def test_batch_rampup_on_tensor_parallel_ranks_counts_the_data_parallel_batch(tmp_path: Path) -> None:
    """2 ranks as one tensor-parallel group read one batch: the ramp (micro 2, global 8, from 2
    by 2 over 16 samples) must run the batches it reports, as one rank does."""
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"] = {"n_layer": 1, "n_head": 2, "n_embd": 32}
    train = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 8, "log_interval": 1, "eval_iters": 0}

    def run(name: str, ranks: int = 1, **distributed: object) -> list[dict[str, float]]:
        tables = {
            "run": {"output_dir": str(tmp_path / name)},
            "distributed": distributed,
            "plugins": {"batch-rampup": {"rampup_batch_size": [2, 2, 16]}},
        }
        config = config_file(tmp_path / f"{name}.toml", preset, tables, **train)
        in_one_job(tmp_path, ranks, [["run", str(config)]], name)
        return metrics_rows(tmp_path / name)

    one = run("one")
    tp2 = run("tp2", 2, tp_size=2)
    # +2 per 16/3 samples consumed (0, 2, 4 | 6, 10 | 14 | 20, 28): Megatron's formula
    assert [row["global_batch_size"] for row in one] == [2, 2, 2, 4, 4, 6, 8, 8]
    assert [row["global_batch_size"] for row in tp2] == [row["global_batch_size"] for row in one]
    assert [row["loss"] for row in tp2] == pytest.approx([row["loss"] for row in one], rel=1e-5)


PARTIAL_GRADIENTS = """
import math, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from coretrain import gradient_norm
from coretrain_tensor_parallel import sum_partial_gradients

dist.init_process_group("gloo")
rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
model = torch.nn.Linear(4, 2)  # weight split by rows, bias replicated: its gradient a sum of parts
model.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(2, 4), mesh, [Shard(0)]))
model.bias = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Replicate()]))
model.weight.grad = DTensor.from_local(torch.full((1, 4), rank + 1.0), mesh, [Shard(0)])
model.bias.grad = DTensor.from_local(torch.tensor([1.0, 2.0 * rank]), mesh, [Partial()])
sum_partial_gradients(model)
assert model.bias.grad.placements == (Replicate(),), model.bias.grad.placements
assert model.bias.grad.to_local().tolist() == [2.0, 2.0]  # each rank holds the whole sum
assert model.weight.grad.placements == (Shard(0),) and model.weight.grad.to_local().tolist() == [[rank + 1.0] * 4]
norm = float(gradient_norm(model.parameters()))
assert math.isclose(norm, math.sqrt(4 * 1 + 4 * 4 + 2**2 + 2**2), rel_tol=1e-6), norm
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_gradients_partial_over_the_group_are_summed_whole_before_the_norm(tmp_path: Path) -> None:
    """What the plugin does before each update on torch 2.9, whose norm of a gradient each rank
    holds part of adds the parts' norms (the tests' gradient norm off by half with split experts):
    on 2 gloo ranks the bias's partial gradient becomes the sum on each rank, the split weight's
    stays split, and the norm over both is the whole gradient's."""
    script = tmp_path / "partial.py"
    script.write_text(PARTIAL_GRADIENTS)
    ranks = run_cli(str(script), cwd=tmp_path, command=torchrun(2), env={"OMP_NUM_THREADS": "1"})
    assert ranks.returncode == 0, ranks.stderr
