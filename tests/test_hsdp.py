"""HSDP: data parallelism as (dp_replicate × dp_shard), FSDP2 on a 2-D mesh — planned on 8
ranks, run 2 × 2 on 4 gloo ranks against one rank, and resumed from and to plain FSDP."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import config_file, gpt_preset, metrics_rows, run_train

from coretrain import UserError
from coretrain.config import DistributedConfig
from coretrain.dist import DistInfo, mesh_dims


def test_a_3d_mesh_on_8_ranks_puts_tp_innermost_and_reads_the_batch_its_data_parallel_index_says() -> None:
    DistributedConfig(dp_replicate=2, tp_size=2).check_layout(8)
    for rank in range(8):
        info = DistInfo(rank=rank, world_size=8, tp_size=2, dp_replicate=2)
        dims = mesh_dims(info)
        assert dims == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
        # init_device_mesh lays ranks out row-major over these dims
        replica, shard, tp = (int(i) for i in (torch.arange(8).reshape(2, 2, 2) == rank).nonzero()[0])
        assert (replica * 2 + shard, tp) == (info.dp_rank, rank % 2)  # "dp", flattened, is the batch it reads
    assert mesh_dims(DistInfo(world_size=4, dp_replicate=2)) == {"dp_replicate": 2, "dp_shard": 2}
    assert mesh_dims(DistInfo(world_size=4)) == {"dp": 4}


@pytest.mark.parametrize(
    ("settings", "ranks", "message"),
    [
        ({"dp_replicate": 3}, 4, r"dp_replicate \(3\) × dp_shard \(unset\) must be the data-parallel ranks: 4 ranks"),
        ({"dp_replicate": 2, "dp_shard": 3}, 4, r"dp_replicate \(2\) × dp_shard \(3\) must be"),
        ({"dp_replicate": 2, "strategy": "ddp"}, 4, r'HSDP, a layout of FSDP2: set distributed.strategy = "fsdp"'),
        ({"tp_size": 3}, 4, r"tp_size \(3\) must divide the number of ranks \(4\)"),
    ],
)
def test_a_layout_that_does_not_fit_the_ranks_is_one_error(settings: dict[str, Any], ranks: int, message: str) -> None:
    with pytest.raises(UserError, match=message):
        DistributedConfig(**settings).check_layout(ranks)


def test_auto_picks_fsdp_for_hsdp() -> None:
    assert DistributedConfig(dp_replicate=2).resolved_strategy(4) == "fsdp"


@pytest.mark.slow
def test_hsdp_2x2_matches_one_rank_and_resumes_from_and_to_plain_fsdp(tmp_path: Path) -> None:
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"] = {"n_layer": 2, "n_head": 4, "n_embd": 32}
    train = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 8, "log_interval": 1, "eval_iters": 0}
    hsdp = {"strategy": "fsdp", "dp_replicate": 2}

    def run(name: str, ranks: int, distributed: dict[str, Any], checkpoint: Any = None, **more: Any) -> list[float]:
        extra = {"run": {"output_dir": str(tmp_path / name)}, "distributed": distributed}
        extra["checkpoint"] = checkpoint or {}
        path = config_file(tmp_path / f"{name}.toml", preset, extra, **{**train, **more})
        launch = ("--nproc-per-node", str(ranks)) if ranks > 1 else ()
        done = run_train(str(path), *launch, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr
        assert ("HSDP, 2 replicas each sharded over 2 ranks" in done.stderr) == (distributed == hsdp)
        return [row["loss"] for row in metrics_rows(tmp_path / name)]

    reference = run("one", 1, {})
    assert run("hsdp", 4, hsdp, exit_interval=4) == pytest.approx(reference[:4], rel=1e-5)
    shutil.copytree(tmp_path / "hsdp", tmp_path / "to-fsdp")  # HSDP's step-4 checkpoint, on 2 plain FSDP ranks
    assert run("to-fsdp", 2, {"strategy": "fsdp"}, {"save_interval": 2}) == pytest.approx(reference, rel=1e-5)
    plain_step_6 = tmp_path / "to-fsdp" / "checkpoints" / "step_00000006"  # plain FSDP's, on HSDP 2 × 2
    assert run("to-hsdp", 4, hsdp, {"resume": str(plain_step_6)}) == pytest.approx(reference[6:], rel=1e-5)
