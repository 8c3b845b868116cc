"""The ``muon`` plugin: torch's Muon on the hidden weight matrices, the configured optimizer on
the rest, in one optimizer that the schedule moves and checkpoints save like any other."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import gpt_preset
from coretrain_muon import MuonAndRest

from coretrain import UserError
from coretrain.testing import run_steps, stop_and_resume


def model_and_groups() -> tuple[torch.nn.Module, list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return model, matrices, [p for p in model.parameters() if p.ndim != 2]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 6, generator=data)).square().mean().backward()
        optimizer.step()


def test_one_optimizer_over_two_steps_as_the_two_do_and_its_state_resumes() -> None:
    model, matrices, others = model_and_groups()
    twin = copy.deepcopy(model)
    alone = [torch.optim.Muon([p for p in twin.parameters() if p.ndim == 2], lr=0.02)]
    alone.append(torch.optim.AdamW([p for p in twin.parameters() if p.ndim != 2], lr=0.01))
    both = MuonAndRest(torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.01))
    train(model, both, 3)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        for part in alone:
            part.zero_grad()
        twin(torch.randn(4, 6, generator=data)).square().mean().backward()
        for part in alone:
            part.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    # the rate a schedule sets on the one optimizer's groups is the one each part steps with
    both.param_groups[0]["lr"] = 0.0
    before = [p.clone() for p in matrices]
    train(model, both, 1, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(before, matrices))
    # a checkpoint of the one optimizer resumes both parts: momentum and Adam's moments alike
    saved, weights = copy.deepcopy(both.state_dict()), copy.deepcopy(model.state_dict())
    train(model, both, 2, seed=3)
    resumed_model, resumed_matrices, resumed_others = model_and_groups()
    resumed_model.load_state_dict(weights)
    resumed = MuonAndRest(torch.optim.Muon(resumed_matrices, lr=0.02), torch.optim.AdamW(resumed_others, lr=0.01))
    resumed.load_state_dict(saved)
    train(resumed_model, resumed, 2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


def gpt(tmp_path: Path) -> dict[str, dict[str, object]]:
    preset = gpt_preset(tmp_path / "unused")
    return {name: preset[name] for name in ("model", "data", "optimizer")} | {"train": {"log_interval": 2}}


def test_muon_takes_the_hidden_matrices_and_leaves_embeddings_and_output_to_adamw(tmp_path: Path) -> None:
    result = run_steps(tmp_path / "run", 4, tables={"muon": {}}, config=gpt(tmp_path))
    optimizer = result.run.optimizer
    muon_names = {name for group in optimizer.parts[0].param_groups for name in group["param_names"]}
    rest_names = {name for group in optimizer.parts[1].param_groups for name in group["param_names"]}
    assert muon_names and all(name.startswith("blocks.") for name in muon_names)
    assert {"wte.weight", "wpe.weight"} <= rest_names and not any(
        name.endswith((".bias", "ln_1.weight")) for name in muon_names
    )
    assert all(p.ndim == 2 for group in optimizer.parts[0].param_groups for p in group["params"])
    decays = {group["weight_decay"] for group in optimizer.parts[1].param_groups}
    assert 0.0 in decays  # optimizer-overrides' no-decay group for biases and norms is kept
    assert result.metrics[-1]["loss"] < result.metrics[0]["loss"]


def test_a_run_with_muon_stopped_and_resumed_trains_as_the_uninterrupted_one(tmp_path: Path) -> None:
    whole = run_steps(tmp_path / "whole", 8, tables={"muon": {}}, config=gpt(tmp_path)).metrics
    first, second = stop_and_resume(tmp_path / "halves", 4, 8, tables={"muon": {}}, config=gpt(tmp_path))
    losses = [(m["step"], m["loss"]) for m in first.metrics + second.metrics if "loss" in m]
    assert losses == [(m["step"], m["loss"]) for m in whole if "loss" in m]


def test_muon_on_a_sharded_model_is_one_error(tmp_path: Path) -> None:
    config = gpt(tmp_path) | {"distributed": {"strategy": "fsdp"}}
    with pytest.raises(UserError, match="plugins.muon: the model is sharded"):
        run_steps(tmp_path / "run", 2, tables={"muon": {}}, config=config)
