"""Does the gpt provider route, weigh and drop tokens as Megatron-Core does? Checked against
Megatron-Core's own functions, on random routers and inputs.

    pip download --no-deps --ignore-requires-python megatron-core==0.19.2 -d /tmp/mcore
    unzip -q /tmp/mcore/megatron_core-*.whl -d /tmp/mcore/x
    python benchmarks/megatron_moe_parity.py --megatron /tmp/mcore/x [--trials 20]

Megatron-Core does not import here (its package pulls in Transformer Engine and Triton), so
the routing functions are read out of its ``moe_utils.py`` and run as they are, with the fused
kernels absent: ``topk_routing_with_score_function`` (softmax, top-k then softmax, its
default), ``apply_router_token_dropping`` (drop policy "probs"),
``compute_routing_scores_for_aux_loss``, ``switch_load_balancing_loss_func`` and
``z_loss_func``. Reported per trial: the largest difference of the MoE layer's output from the
output Megatron's routing map and probabilities give with the same experts, and of both losses.
"""

from __future__ import annotations

import argparse
import ast
import math
import typing
from pathlib import Path
from typing import Any

import torch
from coretrain_gpt.model import GPTConfig, moe_layer
from coretrain_gpt.moe import MoEConfig

FUNCTIONS = {
    "topk_routing_with_score_function",
    "compute_routing_scores_for_aux_loss",
    "switch_load_balancing_loss_func",
    "z_loss_func",
    "get_capacity",
    "apply_router_token_dropping",
    "group_limited_topk",
}


def megatron_functions(root: Path) -> dict[str, Any]:
    """Megatron-Core's routing functions, executed from its source with no fused kernels."""
    source = (root / "megatron" / "core" / "transformer" / "moe" / "moe_utils.py").read_text()
    namespace: dict[str, Any] = {"torch": torch, "math": math, "HAVE_TE": False}
    namespace |= {name: getattr(typing, name) for name in ("Optional", "Tuple", "List", "Union")}  # its annotations
    namespace |= {name: None for name in ("fused_topk_with_score_function", "fused_moe_aux_loss")}
    namespace["fused_compute_score_for_moe_aux_loss"] = None
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            node.decorator_list = []
            exec(ast.unparse(node).replace("'RouterReplay'", "object"), namespace)
    return namespace


def trial(mc: dict[str, Any], seed: int, experts: int, top_k: int, capacity: float | None) -> list[float]:
    torch.manual_seed(seed)
    gpt = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16, dropout=0.0, bias=False)
    cfg = MoEConfig(experts, top_k, capacity, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, shared_experts=0)
    moe = moe_layer(gpt, cfg)
    x = torch.randn(4, 32, 16)
    with torch.no_grad():
        out = moe(x).reshape(-1, 16)
        tokens = x.reshape(-1, 16)
        logits = torch.nn.functional.linear(tokens.float(), moe.router.weight.float())
        probs, routed = mc["topk_routing_with_score_function"](logits, top_k, score_function="softmax")
        if capacity is not None:
            probs, routed = mc["apply_router_token_dropping"](
                probs, routed, router_topk=top_k, capacity_factor=capacity, drop_policy="probs"
            )
        aux_map, scores = mc["compute_routing_scores_for_aux_loss"](logits, top_k, "softmax")
        aux = mc["switch_load_balancing_loss_func"](scores, aux_map.sum(0), len(tokens), top_k, experts, 1e-2)
        z = mc["z_loss_func"](logits, 1e-3)
        reference = torch.zeros_like(tokens)
        for e in range(experts):
            rows = routed[:, e].nonzero().squeeze(1)
            if rows.numel():
                reference = reference.index_add(0, rows, moe.experts(tokens[rows], e) * probs[rows, e, None])
    return [
        (out - reference).abs().max().item(),
        abs(aux.item() - moe.stats["aux_loss"].item()),
        abs(z.item() - moe.stats["z_loss"].item()),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, required=True, help="an unzipped megatron-core wheel")
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    mc = megatron_functions(args.megatron)
    shapes, capacities = [(4, 2), (8, 2), (8, 1), (6, 3)], [None, 1.0, 0.5, 1.25]
    worst = [0.0, 0.0, 0.0]
    for seed in range(args.trials):
        (experts, top_k), capacity = shapes[seed % 4], capacities[seed // 5 % 4]
        diffs = trial(mc, seed, experts, top_k, capacity)
        worst = [max(w, d) for w, d in zip(worst, diffs)]
        print(f"E={experts} top_k={top_k} capacity={capacity}: |output|, |aux|, |z| = " + fmt(diffs))
    print(f"largest differences over {args.trials} trials (output, aux loss, z-loss): " + fmt(worst))


def fmt(values: list[float]) -> str:
    return ", ".join(f"{value:.1e}" for value in values)


if __name__ == "__main__":
    main()
