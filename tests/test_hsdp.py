"""HSDP: data parallelism as (dp_replicate × dp_shard), FSDP2 on a 2-D mesh — planned on 8
ranks here; run 2 × 2 on 4 gloo ranks against one rank, and resumed from and into every other
layout, in test_layouts.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

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
