"""``muon``: torch's Muon for the weight matrices, the configured optimizer for the rest.

Muon orthogonalizes each update of a 2-D weight (Newton–Schulz iterations on the momentum)
and is only defined for matrices; Megatron applies it to the hidden layers' linear weights and
keeps Adam for everything else — biases, norms, the embeddings (every ``nn.Embedding``) and the
input and output layers (found as Hugging Face models name them: ``get_input_embeddings()`` /
``get_output_embeddings()``, which the ``gpt`` provider's model has too). So does this plugin:
each of the run's param groups (their weight decay, ``lr_mult`` and schedule end points kept) is
split into its matrices, which ``torch.optim.Muon`` updates, and the rest, which
``optimizer.name``'s optimizer updates. Both live in one optimizer whose ``state_dict`` is
torch's, so checkpoints save and resume as any other's, and the schedule moves both.

    [optimizer]
    name = "adamw"            # for what Muon does not take
    lr = 3e-4
    [plugins.muon]
    momentum = 0.95
    adjust_lr_fn = "match_rms_adamw"   # one lr for both (Moonlight's rule); "original": Keller's

On DDP and one rank. A sharded model (FSDP2) splits the matrices over ranks, which Muon's
Newton–Schulz step needs whole: one error (Megatron gathers them in its distributed optimizer).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from attrs import define, field

from coretrain import Run, UserError, hookimpl, is_sharded, positive

log = logging.getLogger("coretrain")


class MuonAndRest(torch.optim.Optimizer):
    """One optimizer over two: Muon's groups first, then the others'; the groups and the state
    are shared with the two, so what the schedule sets and what a checkpoint loads they see."""

    def __init__(self, muon: torch.optim.Optimizer | None, rest: torch.optim.Optimizer | None) -> None:
        self.parts = [part for part in (muon, rest) if part is not None]
        self.sizes = [len(part.param_groups) for part in self.parts]
        super().__init__([group for part in self.parts for group in part.param_groups], defaults={})
        self._link()

    def _link(self) -> None:
        start = 0
        for part, size in zip(self.parts, self.sizes):
            part.param_groups, part.state = self.param_groups[start : start + size], self.state
            start += size

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group and state objects: hand them to the two again
        self._link()


def embedding_and_output(model: torch.nn.Module) -> set[int]:
    """The ids of the embeddings' parameters (every ``nn.Embedding``: tokens, positions) and of
    the input and output layers where the model names them (Megatron leaves these to Adam)."""
    found = {id(p) for module in model.modules() if isinstance(module, torch.nn.Embedding) for p in module.parameters()}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if isinstance(module, torch.nn.Module):
            found.update(id(p) for p in module.parameters())
    return found


@define(kw_only=True)
class Muon:
    """Muon (torch.optim.Muon) on the hidden weight matrices; optimizer.name's optimizer on the rest."""

    momentum: float = field(default=0.95, validator=positive)
    """Muon's momentum."""
    nesterov: bool = True
    """Nesterov momentum (Muon's default)."""
    ns_steps: int = field(default=5, validator=positive)
    """Newton–Schulz iterations per update."""
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """How Muon scales the rate by a matrix's shape: "match_rms_adamw" (the update's RMS as
    AdamW's, so one lr serves both) or "original" (max(1, rows/cols) ** 0.5, Muon's own lr)."""

    @hookimpl(tryfirst=True)  # before plugins that wrap the optimizer (ddp's ZeRO-1 refuses it)
    def configure_optimizer(self, run: Run) -> None:
        if is_sharded(run.model):
            raise UserError(
                "plugins.muon: the model is sharded (FSDP2 or tensor parallel) and Muon's Newton–Schulz step needs "
                'each weight matrix whole; use distributed.strategy = "ddp" (or one rank)'
            )
        plain = run.optimizer
        skipped = embedding_and_output(run.unwrapped_model)
        matrices, others = [], []
        for group in plain.param_groups:
            settings = {key: value for key, value in group.items() if key not in ("params", "param_names")}
            names = group.get("param_names", [""] * len(group["params"]))
            split: dict[bool, dict[str, Any]] = {
                side: {"params": [], "param_names": [], **settings} for side in (True, False)
            }
            for name, param in zip(names, group["params"]):
                side = split[param.ndim == 2 and id(param) not in skipped]
                side["params"].append(param)
                side["param_names"].append(name)
            matrices += [split[True]] if split[True]["params"] else []
            others += [split[False]] if split[False]["params"] else []
        muon = (
            torch.optim.Muon(
                [self._for_muon(group, plain.defaults) for group in matrices],
                lr=plain.defaults["lr"],
                momentum=self.momentum,
                nesterov=self.nesterov,
                ns_steps=self.ns_steps,
                adjust_lr_fn=self.adjust_lr_fn,
            )
            if matrices
            else None
        )
        rest = type(plain)(others, **_own_settings(plain)) if others else None
        run.optimizer = MuonAndRest(muon, rest)
        if run.dist.is_main:
            counts = [sum(p.numel() for g in groups for p in g["params"]) for groups in (matrices, others)]
            log.info("muon: Muon on %d matrix parameters, %s on %d others", counts[0], type(plain).__name__, counts[1])

    @staticmethod
    def _for_muon(group: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        """A group as Muon takes it: the rate, the decay and the run's keys (``lr_mult``, the
        schedule's end points) kept; the other optimizer's own settings (betas, eps) dropped."""
        return {key: value for key, value in group.items() if key in ("lr", "weight_decay") or key not in own}


def _own_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's constructor arguments from its defaults (some defaults it sets itself)."""
    import inspect

    accepted = inspect.signature(type(optimizer)).parameters
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}
