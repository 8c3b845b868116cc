"""The fsdp plugin's memory levers on real gloo ranks: FSDP2's mixed-precision policy
(bf16 compute, fp32 reductions and master weights) and CPU offload, trained and resumed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import config_file, gpt_preset, in_one_job, metrics_rows

pytestmark = pytest.mark.slow  # 2 gloo ranks: the full suite


def config(tmp_path: Path, name: str, fsdp: dict[str, Any] | None, checkpoint: dict[str, Any] | None = None) -> Path:
    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"] = {"n_layer": 2, "n_head": 4, "n_embd": 32}
    settings = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 8, "log_interval": 1, "eval_iters": 0}
    extra: dict[str, Any] = {"run": {"output_dir": str(tmp_path / name)}, "checkpoint": checkpoint or {}}
    if fsdp is not None:
        counted = {"count-block-calls": {}} if fsdp.pop("count-block-calls", False) else {}
        extra |= {"distributed": {"strategy": "fsdp"}, "plugins": {"fsdp": fsdp, **counted}}
    return config_file(tmp_path / f"{name}.toml", preset, extra, **settings)


def run(tmp_path: Path, name: str, fsdp: dict[str, Any] | None, ranks: int = 1, **env: str) -> list[dict[str, Any]]:
    in_one_job(tmp_path, ranks, [["run", str(config(tmp_path, name, fsdp))]], name, env=env)
    return metrics_rows(tmp_path / name)


def test_bf16_parameters_with_fp32_reductions_train_close_to_fp32(tmp_path: Path, site: Path) -> None:
    reference = [row["loss"] for row in run(tmp_path, "fp32", None)]
    policy = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "count-block-calls": True}
    mixed = [row["loss"] for row in run(tmp_path, "bf16", policy, 2, PYTHONPATH=str(site))]
    for rank in (0, 1):  # the blocks computed in bf16 on every rank (their inputs, as the test-only plugin saw them)
        seen = json.loads((tmp_path / "bf16" / f"block_calls.rank{rank}.json").read_text())
        assert seen["input_dtypes"] == ["torch.bfloat16"], rank
    assert mixed == pytest.approx(reference, rel=2e-2)  # bf16 rounding, not a different training
    assert mixed[-1] < mixed[0]


def test_cpu_offload_trains_and_its_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    offload = {"cpu_offload": True}
    step_4 = tmp_path / "whole" / "checkpoints" / "step_00000004"
    runs = [
        ["run", str(config(tmp_path, "whole", offload, checkpoint={"save_interval": 4}))],
        ["run", str(config(tmp_path, "resumed", offload, checkpoint={"resume": str(step_4)}))],
    ]
    in_one_job(tmp_path, 2, runs, "offload", env={"OMP_NUM_THREADS": "1"})  # two jobs' runs in one job
    whole, resumed = ([row["loss"] for row in metrics_rows(tmp_path / name)] for name in ("whole", "resumed"))
    assert resumed == whole[4:]  # steps 5-8 from the offloaded parameters and optimizer state it saved
    assert whole[-1] < whole[0]


def test_grad_reduce_in_fp32_is_reduce_dtype_float32_and_reduces_otherwise_than_bf16(tmp_path: Path) -> None:
    """Megatron's knob by its name: the same numbers as ``reduce_dtype = "float32"``, not those of
    gradients reduce-scattered in bf16 (the sum of two ranks' bf16 gradients rounded to bf16:
    seen in the gradient norm, which is taken of the fp32 sharded gradients; the losses are bf16)."""

    policies = {"named": {"grad_reduce_in_fp32": True}, "fp32": {"reduce_dtype": "float32"}, "bf16": {}}
    runs = [
        ["run", str(config(tmp_path, name, {"param_dtype": "bfloat16", **fsdp}))] for name, fsdp in policies.items()
    ]
    in_one_job(tmp_path, 2, runs, "policies", env={"OMP_NUM_THREADS": "1"})  # three jobs' runs in one job
    named, fp32, bf16 = ([row["grad_norm"] for row in metrics_rows(tmp_path / name)] for name in policies)
    assert named == fp32
    assert named != bf16
