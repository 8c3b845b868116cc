"""A Hugging Face mixture of experts' load-balancing loss across pipeline stages.

Transformers computes it once, over every layer's router logits (``load_balancing_loss_func``
of Mixtral, copied by Qwen2-MoE and Qwen3-MoE): the assignments each expert got and the
probability it was given, summed layer by layer, then ``E · Σ_e (assigned_e / rows) ·
(probability_e / rows)`` — not a sum of per-layer losses, so no stage can compute its share
alone. Each stage adds its layers to the running sums (an experts × 2 tensor) and hands them
to the next with its hidden states; the last stage finishes the loss, and its gradient flows
back through the sums to every stage's routers, as on one rank.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from coretrain_hf.model import token_loss


class Routers:
    """What the stages of one model share about its routers: the load-balancing loss of the
    micro-batch the last stage just computed, and each step's logged values."""

    def __init__(self, hf: Any) -> None:
        recorder = hf._can_record_outputs["router_logits"]
        self.router_class, self.index = recorder.target_class, recorder.index
        self.experts, self.top_k = int(hf.num_experts), int(hf.num_experts_per_tok)
        self.coef = float(hf.router_aux_loss_coef)
        routers = [module for module in hf.modules() if isinstance(module, self.router_class)]
        self.ordinal = {id(router): i for i, router in enumerate(routers)}
        """Each router's place among the model's (its layer's number in the logged names)."""
        self.watched: set[int] = set()
        self.captured: dict[int, torch.Tensor] = {}
        """Each watched router's logits of its last forward."""
        self.pending: torch.Tensor | None = None
        """The last stage's load-balancing loss (× coefficient) of its last forward, for the loss."""
        self.adds_to_loss = False
        self.loads: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in range(len(routers))}
        self.losses: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def balanced(hf: Any) -> bool:
        """Whether the model adds transformers' load-balancing loss (it reports its routers and
        its module defines the loss)."""
        module = sys.modules.get(type(hf).__module__)
        recorded = "router_logits" in (getattr(hf, "_can_record_outputs", None) or {})
        wanted = bool(getattr(hf.config, "output_router_logits", False))
        return recorded and wanted and hasattr(module, "load_balancing_loss_func") and hasattr(hf, "num_experts")

    def watch(self, layers: list[torch.nn.Module]) -> list[int]:
        """Keep the router logits of ``layers``' routers as they are computed (each router
        watched once, though several stages views hold it); their ordinals, in order."""
        ordinals = []
        for layer in layers:
            for module in layer.modules():
                if isinstance(module, self.router_class):
                    ordinal = self.ordinal[id(module)]
                    if ordinal not in self.watched:
                        module.register_forward_hook(functools.partial(self._keep, ordinal))
                        self.watched.add(ordinal)
                    ordinals.append(ordinal)
        return sorted(ordinals)

    def _keep(self, ordinal: int, _module: Any, _inputs: Any, output: Any) -> None:
        self.captured[ordinal] = output[self.index]

    def added(self, sums: torch.Tensor, ordinals: list[int]) -> torch.Tensor:
        """``sums`` (assignments; probabilities) with the layers ``ordinals`` added, in layer
        order, from their routers' last logits; each layer's expert load recorded."""
        for ordinal in ordinals:
            probs = torch.softmax(self.captured.pop(ordinal), dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
            counts = torch.histc(chosen.reshape(-1).float(), bins=self.experts, min=0, max=self.experts)
            sums = sums + torch.stack([counts.to(sums.device), probs.float().sum(dim=0)])
            load = torch.bincount(chosen.flatten(), minlength=self.experts).float() / chosen.numel()
            self.loads[ordinal].append((load.min().detach(), load.max().detach()))
        return sums

    def finish(self, sums: torch.Tensor, tokens: int, training: bool) -> None:
        """The last stage: the loss from the whole model's sums (every router saw ``tokens``)."""
        rows = float(tokens * len(self.ordinal))
        aux = torch.sum((sums[0] / rows) * (sums[1] / rows)) * self.experts
        self.pending, self.adds_to_loss = self.coef * aux, training

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss: the tokens' cross-entropy, with the load-balancing loss in training."""
        lm, aux = token_loss(logits, targets), self.pending
        assert aux is not None, "the last stage's forward finishes the routers' loss first"
        self.losses.append((lm.detach(), aux.detach()))
        return lm + aux if self.adds_to_loss else lm

    def values(self, micro_batches: int, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's share of the step's logged values, as the whole model names them, averaged
        over the step's ``micro_batches`` (a stage's first forward only tells the pipeline its
        shapes); zeros for what other stages hold. Empties the records."""
        zero = torch.zeros((), device=device)

        def mean(rows: list[tuple[torch.Tensor, torch.Tensor]], part: int) -> torch.Tensor:
            kept = rows[-micro_batches:]
            return torch.stack([row[part] for row in kept]).mean().to(device) if kept else zero

        values = {"lm_loss": mean(self.losses, 0), "moe_aux_loss": mean(self.losses, 1)}
        for i, loads in self.loads.items():
            values |= {f"moe/layer{i}/load_min": mean(loads, 0), f"moe/layer{i}/load_max": mean(loads, 1)}
            loads.clear()
        self.losses.clear()
        return values
