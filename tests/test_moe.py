"""The gpt provider's mixture of experts: Megatron-Core's routing and losses, capacity, and a
run that trains, logs its experts' load and resumes exactly."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt_preset
from coretrain_gpt.model import GPTConfig, moe_layer
from coretrain_gpt.moe import MoE, MoEConfig, capacity, load_balancing_loss

from coretrain import UserError, hookimpl
from coretrain.testing import run_steps, stop_and_resume

GPT_SIZE = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.0, bias=False)


def layer(n_experts: int = 4, top_k: int = 2, **options: Any) -> MoE:
    cfg = MoEConfig(
        n_experts=n_experts,
        top_k=top_k,
        capacity_factor=options.get("capacity_factor"),
        aux_loss_coeff=options.get("aux", 0.01),
        z_loss_coeff=options.get("z", 0.001),
        shared_experts=options.get("shared", 0),
    )
    torch.manual_seed(0)
    return moe_layer(GPT_SIZE, cfg)


def test_each_token_is_the_softmax_over_its_top_k_logits_weighing_those_experts() -> None:
    moe = layer(n_experts=4, top_k=2, shared=1)
    x = torch.randn(3, 5, GPT_SIZE.n_embd)
    got = moe(x)
    tokens = x.reshape(-1, GPT_SIZE.n_embd)
    expected = []
    for token in tokens:
        logits = moe.router(token)
        top, chosen = logits.topk(2)
        weights = torch.softmax(top, dim=-1)
        routed = sum(w * moe.experts(token[None], e[None])[0] for w, e in zip(weights, chosen))
        expected.append(routed + moe.shared(token))  # type: ignore[misc]
    torch.testing.assert_close(got.reshape(-1, GPT_SIZE.n_embd), torch.stack(expected), rtol=1e-5, atol=1e-6)


def test_an_even_router_costs_one_coefficient_of_aux_loss_and_log_e_squared_of_z_loss() -> None:
    """Megatron's formulas at a point worked by hand: equal logits make the softmax uniform
    (P_i = 1/E); the top-k ties pick the same k experts for every token (f_i = 1/k for them),
    so E · Σ f_i · P_i = E · k · (1/k) · (1/E) = 1, and logsumexp of E zeros is log E."""
    moe = layer(n_experts=4, top_k=2, aux=0.01, z=0.001)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(2, 6, GPT_SIZE.n_embd))
    assert moe.stats["aux_loss"].item() == pytest.approx(0.01, rel=1e-6)
    assert moe.stats["z_loss"].item() == pytest.approx(math.log(4) ** 2 * 0.001, rel=1e-6)
    assert moe.stats["load_min"].item() == 0.0 and moe.stats["load_max"].item() == 0.5  # two experts took all


def test_the_load_balancing_loss_is_megatrons_formula() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
    routed = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    # E · Σ_i f_i · P_i with f_i = tokens_i / (T·k), P_i = Σ_x probs(x, i) / T
    f = routed.sum(0).float() / (4 * 2)
    p = probs.sum(0) / 4
    assert load_balancing_loss(probs, routed, top_k=2, coeff=0.5).item() == pytest.approx(3 * (f * p).sum() * 0.5)


def test_an_expert_takes_at_most_its_capacity_keeping_its_most_probable_assignments() -> None:
    moe = layer(n_experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(4, 8, GPT_SIZE.n_embd)
    with torch.no_grad():
        moe.router.weight[0] += 3.0 * x.reshape(-1, GPT_SIZE.n_embd).mean(0)  # expert 0 is everyone's favourite
    moe(x)
    limit = capacity(32, moe.cfg)
    assert limit == 8 and moe.stats["load_max"].item() <= limit / (32 * 2)
    dropless = layer(n_experts=4, top_k=2)
    dropless.load_state_dict(moe.state_dict())
    dropless(x)
    assert dropless.stats["load_max"].item() > limit / (32 * 2)  # without a capacity it took more


def test_the_blocks_fsdp_shards_are_the_layers_with_their_experts_inside() -> None:
    from coretrain_blocks import blocks_of
    from coretrain_gpt.model import GPT, Block

    cfg = MoEConfig(n_experts=4, top_k=2, capacity_factor=None, aux_loss_coeff=0.0, z_loss_coeff=0.0, shared_experts=0)
    model = GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=3, n_head=2, n_embd=8, dropout=0, bias=False, moe=cfg))
    blocks = blocks_of(model)
    assert len(blocks) == 3 and all(isinstance(block, Block) for block in blocks)


def moe_config(out: Path, **options: Any) -> dict[str, Any]:
    preset = gpt_preset(out)
    preset["model"]["options"] |= {"n_layer": 2, "n_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01}
    preset["model"]["options"] |= {"moe_z_loss_coeff": 0.001, **options}
    preset["train"] = {"micro_batch_size": 4, "log_interval": 2, "eval_iters": 1}
    return {name: preset[name] for name in ("model", "data", "optimizer", "train")}


def test_a_mixture_of_experts_gpt_trains_and_logs_each_layers_load_and_losses(tmp_path: Path) -> None:
    result = run_steps(tmp_path, steps=8, config=moe_config(tmp_path))
    first, last = result.metrics[0], result.metrics[-1]
    assert last["train/lm_loss"] < first["train/lm_loss"]
    for i in (0, 1):
        assert 0.0 <= last[f"train/moe/layer{i}/load_min"] <= 0.25 <= last[f"train/moe/layer{i}/load_max"] <= 1.0
        assert last[f"train/moe/layer{i}/aux_loss"] >= 0.01 * 0.999  # ≥ coeff: even load is its minimum
    # what is optimized: the language-model loss and both routers' losses
    assert last["loss"] == pytest.approx(last["train/lm_loss"] + last["train/moe_aux_loss"] + last["train/moe_z_loss"])
    assert "valid/lm_loss" in result.evals[-1] and result.evals[-1]["valid/loss"] == result.evals[-1]["valid/lm_loss"]


def test_a_mixture_of_experts_run_resumes_exactly(tmp_path: Path) -> None:
    config = moe_config(tmp_path, moe_capacity_factor=1.0, moe_shared_experts=1)
    whole = run_steps(tmp_path / "whole", steps=8, config=config)
    _, resumed = stop_and_resume(tmp_path / "split", stop_at=4, steps=8, config=config)
    assert [m["loss"] for m in whole.metrics][2:] == [m["loss"] for m in resumed.metrics]


def test_flops_count_the_experts_a_token_passes_through(tmp_path: Path) -> None:
    dense = run_steps(tmp_path / "dense", steps=1, config=moe_config(tmp_path, n_experts=0)).run.unwrapped_model
    sparse = run_steps(tmp_path / "moe", steps=1, config=moe_config(tmp_path)).run.unwrapped_model
    router = 2 * 4 * 32  # two layers' routers
    assert sparse.num_params() == dense.num_params() + router + 2 * (2 - 1) * (32 * 128 + 128 * 32)  # top 2 of 4


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"n_experts": 1}, "n_experts: a token is routed to moe_top_k (2) of n_experts (1) experts"),
        ({"n_experts": 4, "moe_top_k": 5}, "moe_top_k: a token is routed to moe_top_k (5) of n_experts (4)"),
        ({"n_experts": 4, "moe_capacity_factor": 0}, "moe_capacity_factor: must be > 0"),
    ],
)
def test_bad_expert_settings_are_one_error(tmp_path: Path, options: dict[str, Any], expected: str) -> None:
    with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        run_steps(tmp_path, steps=1, config=moe_config(tmp_path, **options))


def test_the_progress_line_and_the_report_show_the_experts_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from coretrain_report.summary import summary

    caplog.set_level(logging.INFO, logger="coretrain")  # the level `coretrain run` sets
    config = moe_config(tmp_path)
    config["plugins"] = {"progress": {"plain": True}}
    result = run_steps(tmp_path, steps=4, config=config, autoload=("progress", "evaluation"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    last = result.metrics[-1]
    low = min(last[f"train/moe/layer{i}/load_min"] for i in (0, 1))
    high = max(last[f"train/moe/layer{i}/load_max"] for i in (0, 1))
    assert f"| experts load {low:.0%}–{high:.0%}, aux {last['train/moe_aux_loss']:.4g} |" in lines[-1]
    report = dict(summary([{"step": m["step"], **m} for m in result.metrics]))
    assert report["train/moe/layer1/load_max"] == f"last {last['train/moe/layer1/load_max']:.4g}"


@pytest.mark.slow  # 2 gloo ranks
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_experts_on_two_data_parallel_ranks_train_like_one_rank(tmp_path: Path, strategy: str) -> None:
    """Every expert takes part in every step's backward, also one no token chose on a rank, so
    DDP's and FSDP's gradient reductions see each parameter (DDP without find_unused_parameters)."""
    from conftest import config_file, in_one_job
    from test_distributed import logged

    preset = gpt_preset(tmp_path)
    preset["model"]["options"] |= {"n_layer": 2, "n_experts": 8, "moe_top_k": 1, "moe_aux_loss_coeff": 0.01}
    train = {"micro_batch_size": 2, "global_batch_size": 4, "train_iters": 12, "log_interval": 3, "eval_iters": 0}
    runs = {}
    for name, nproc in (("one", 1), ("two", 2)):
        preset["run"]["output_dir"] = str(tmp_path / name)
        extra = {"distributed": {"strategy": strategy}} if nproc == 2 else {}
        config = config_file(tmp_path / f"{name}.toml", preset, extra, **train)
        in_one_job(tmp_path, nproc, [["run", str(config)]], name)  # one rank: in this process
        runs[name] = logged(tmp_path / name)
    assert [s for s, _ in runs["one"]] == [s for s, _ in runs["two"]] == [3, 6, 9, 12]
    for (_, one), (_, two) in zip(runs["one"], runs["two"]):
        assert two == pytest.approx(one, rel=1e-5, abs=1e-6)


class CountsRouting:
    """Counts the mixture layers' forward calls (a recomputed block routes its tokens again)."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def on_train_start(self, run: Any) -> None:
        for module in run.model.modules():
            if isinstance(module, MoE):
                # a pre-hook: recomputation stops once the last kept tensor is back, inside the layer
                module.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def test_checkpointed_expert_layers_route_again_in_backward_and_train_the_same_losses(tmp_path: Path) -> None:
    """Recomputing a block in backward routes its tokens again: the same experts (dropout's
    random numbers replayed), so the losses are those of a run that keeps the activations."""
    config = moe_config(tmp_path)
    config["model"]["options"]["dropout"] = 0.1
    config["train"]["eval_iters"] = 0
    counts = {"plain": CountsRouting(), "full": CountsRouting()}
    plain = run_steps(tmp_path / "plain", steps=4, config=config, plugins={"count": counts["plain"]})
    recomputed = run_steps(
        tmp_path / "full",
        steps=4,
        config=config,
        plugins={"count": counts["full"]},
        tables={"activation-checkpointing": {"mode": "full"}},
    )
    assert counts["plain"].calls == 2 * 4 and counts["full"].calls == 2 * 2 * 4  # 2 layers, 4 steps, twice
    assert [m["loss"] for m in plain.metrics] == [m["loss"] for m in recomputed.metrics]
