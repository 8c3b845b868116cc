"""Activation checkpointing: the same losses as without it, fewer tensors kept for backward,
the blocks' forward run again in backward — on the gpt provider and on a Hugging Face model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import STDLIB

from coretrain import Run, hookimpl
from coretrain.testing import run_steps

GPT = {
    "model": {"provider": "gpt", "options": {"n_layer": 4, "n_head": 2, "n_embd": 32, "dropout": 0.1}},
    "data": {
        "provider": "text-bytes",
        "options": {"globs": [f"{STDLIB}/a*.py"], "seq_length": 32, "max_bytes": 100000},
    },
    "optimizer": {"lr": 3e-3},
    "train": {"micro_batch_size": 4, "global_batch_size": 8, "log_interval": 1, "eval_iters": 0},
}


class CountsBlockCalls:
    """Counts the calls of each block's MLP: once per micro-batch, twice where the block is recomputed."""

    def __init__(self, attribute: str = "mlp") -> None:
        self.attribute, self.calls = attribute, [0]

    @hookimpl(trylast=True)
    def configure_model(self, run: Run) -> None:
        from coretrain_blocks import blocks_of

        blocks = blocks_of(run.model)
        self.calls = [0] * len(blocks)
        for i, block in enumerate(blocks):
            # a pre-hook: recomputation stops once the last kept tensor is back, inside the MLP
            getattr(block, self.attribute).register_forward_pre_hook(lambda *_, i=i: self._count(i))

    def _count(self, i: int) -> None:
        self.calls[i] += 1


def losses(
    tmp_path: Path, table: dict[str, Any] | None, steps: int = 4, **sections: Any
) -> tuple[list[float], list[int]]:
    counter = CountsBlockCalls(sections.pop("counted", "mlp"))
    config = {**GPT, **sections}
    tables = {**config.pop("plugins", {}), **({"activation-checkpointing": table} if table is not None else {})}
    result = run_steps(tmp_path, steps=steps, config=config, tables=tables, plugins={"counter": counter})
    return [row["loss"] for row in result.metrics], counter.calls


@pytest.mark.parametrize(
    ("table", "recomputed"),
    [
        ({"mode": "full"}, [1, 1, 1, 1]),
        ({"mode": "selective", "every": 2}, [1, 0, 1, 0]),
        ({"mode": "selective", "every": 3}, [1, 0, 0, 1]),
        ({"mode": "op"}, [1, 1, 1, 1]),
        ({"mode": "offload"}, [0, 0, 0, 0]),
        ({"mode": ["selective", "offload"], "every": 2}, [1, 0, 1, 0]),
    ],
)
def test_checkpointed_blocks_run_again_in_backward_and_the_losses_are_unchanged(
    tmp_path: Path, table: dict[str, Any], recomputed: list[int]
) -> None:
    plain, plain_calls = losses(tmp_path / "plain", None)
    checkpointed, calls = losses(tmp_path / "ac", table)
    micro_batches = 4 * 2  # steps × micro-batches per step
    assert plain_calls == [micro_batches] * 4
    assert calls == [micro_batches * (1 + again) for again in recomputed]
    assert torch.allclose(torch.tensor(checkpointed), torch.tensor(plain), rtol=1e-5, atol=0)


def test_full_checkpointing_keeps_under_half_the_activations_in_the_memory_benchmark() -> None:
    from conftest import REPO, load_script

    benchmark = load_script(REPO / "benchmarks" / "memory.py")
    size, cpu = (6, 4, 64, 64, 8), torch.device("cpu")  # layers, heads, width, seq, micro-batch
    none, full = (benchmark.measure(size, mode, cpu, "fp32", steps=1, vocab=256) for mode in ("none", "full"))
    assert 0 < full["saved"] < 0.5 * none["saved"]


def test_offloaded_blocks_keep_their_activations_out_of_autograds_own_storage() -> None:
    """What an offloaded block saves goes through save_on_cpu's hooks (host memory), not the
    hooks around the whole forward that the memory benchmark counts with."""
    from conftest import REPO, load_script

    benchmark = load_script(REPO / "benchmarks" / "memory.py")
    size, cpu = (6, 4, 64, 64, 8), torch.device("cpu")
    none, offload = (benchmark.measure(size, mode, cpu, "fp32", steps=1, vocab=256) for mode in ("none", "offload"))
    assert 0 < offload["saved"] < 0.2 * none["saved"]


@pytest.mark.parametrize("mode", ["everything", ["full", "op"], ["offload", "offload"], [], 3])
def test_an_unknown_or_doubled_mode_is_one_error(tmp_path: Path, mode: Any) -> None:
    from coretrain import UserError

    with pytest.raises(UserError, match=r"plugins.activation-checkpointing.mode: expected one of full, selective"):
        run_steps(tmp_path, steps=1, config=GPT, tables={"activation-checkpointing": {"mode": mode}})


def test_a_model_without_blocks_is_one_error_naming_block_types(tmp_path: Path) -> None:
    from coretrain import UserError

    with pytest.raises(
        UserError, match="found no blocks to checkpoint in TinyRegression; name their class in block_types"
    ):
        run_steps(tmp_path, steps=1, tables={"activation-checkpointing": {}})


def test_a_hugging_face_models_decoder_layers_are_checkpointed(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    llama = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64}
    llama |= {"num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2}
    sections = {"model": {"provider": "hf", "options": {"config": llama}}, "counted": "mlp"}
    plain, plain_calls = losses(tmp_path / "plain", None, **sections)
    checkpointed, calls = losses(tmp_path / "ac", {"mode": "full"}, **sections)
    assert len(calls) == 3 and calls == [2 * n for n in plain_calls]
    assert torch.allclose(torch.tensor(checkpointed), torch.tensor(plain), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "plugins",
    [
        # dynamo and AOT autograd trace the checkpoint (16 s on 2 cores: the full suite only)
        pytest.param({"compile": {"backend": "aot_eager"}}, marks=pytest.mark.slow, id="compile"),
        pytest.param({"fp8": {}}, id="fp8"),  # torchao's Float8Linear inside the recomputed blocks
    ],
)
def test_composed_with_compile_or_fp8_the_losses_are_unchanged(tmp_path: Path, plugins: dict[str, Any]) -> None:
    plain, plain_calls = losses(tmp_path / "plain", None, plugins=plugins)
    checkpointed, calls = losses(tmp_path / "ac", {"mode": "op"}, plugins=plugins)
    assert calls == [2 * n for n in plain_calls] and min(plain_calls) > 0  # recomputed under compile / fp8 too
    assert torch.allclose(torch.tensor(checkpointed), torch.tensor(plain), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_on_two_ranks_with_fsdp_or_tensor_parallel_the_losses_match_one_plain_rank(tmp_path: Path, site: Path) -> None:
    """Full checkpointing under FSDP2 and op-level under tensor parallelism (both runs in one
    job, as two jobs would run them) recompute every block in backward on every rank
    and train as one plain rank does."""
    import json

    from conftest import config_file, gpt_preset, in_one_job, metrics_rows, run_here

    preset = gpt_preset(tmp_path / "unused")
    preset["model"]["options"] = {"n_layer": 3, "n_head": 4, "n_embd": 32}
    train = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 6, "log_interval": 1, "eval_iters": 0}
    layouts = {"fsdp": ({"strategy": "fsdp"}, "full"), "tp": ({"tp_size": 2}, "op")}

    def config(name: str, extra: dict[str, Any]) -> str:
        tables = {"run": {"output_dir": str(tmp_path / name)}, **extra}
        return str(config_file(tmp_path / f"{name}.toml", preset, tables, **train))

    counted = {"count-block-calls": {}}  # the test-only plugin: each block's MLP calls on each rank
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(site)}
    assert run_here("run", config("one", {"plugins": counted}), cwd=tmp_path, env=env).returncode == 0
    runs = [
        [
            "run",
            config(
                name, {"distributed": distributed, "plugins": {"activation-checkpointing": {"mode": mode}, **counted}}
            ),
        ]
        for name, (distributed, mode) in layouts.items()
    ]
    job = in_one_job(tmp_path, 2, runs, "checkpointed", env=env)
    reference = [row["loss"] for row in metrics_rows(tmp_path / "one")]
    assert (
        json.loads((tmp_path / "one" / "block_calls.rank0.json").read_text())["calls"] == [6 * 4] * 3
    )  # 4 micro-batches a step
    forwards = {"fsdp": 6 * 2, "tp": 6 * 4}  # a rank's micro-batches: FSDP splits the batch, TP ranks share it
    for name, (_, mode) in layouts.items():
        assert f"activation checkpointing ({mode}): 3 of 3 blocks (Block)" in job.stderr
        assert [row["loss"] for row in metrics_rows(tmp_path / name)] == pytest.approx(reference, rel=1e-5), name
        for rank in (0, 1):
            calls = json.loads((tmp_path / name / f"block_calls.rank{rank}.json").read_text())["calls"]
            assert calls == [2 * forwards[name]] * 3, (name, rank)  # every block ran again in backward
