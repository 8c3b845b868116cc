"""``coretrain checkpoint export RUN --format hf`` of the ``gpt`` provider's model: a transformers
GPT-2 directory that ``GPT2LMHeadModel.from_pretrained`` loads, computing the same logits.

The architectures are one: pre-norm blocks, learned positions, causal attention scaled by
1/sqrt(head size), an MLP four times as wide, a head tied to the token embedding. What differs is
spelling: GPT-2 fuses q, k and v into ``c_attn``, its ``Conv1D`` layers hold weights transposed, it
always has biases (zeros here for a model without them), and the exact GELU this model uses is
its ``activation_function = "gelu"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from coretrain import UserError, require

EPSILON = 1e-5
"""torch's LayerNorm default, which the blocks use; GPT-2's ``layer_norm_epsilon`` is the same."""


def gpt2_state(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """This model's state dict (of ``layers`` blocks) under GPT-2's names and layouts."""
    width = state["wte.weight"].shape[1]

    def bias(name: str, size: int) -> torch.Tensor:
        return state.get(name, torch.zeros(size, dtype=state["wte.weight"].dtype))

    gpt2 = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"]}
    gpt2 |= {"transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": bias("ln_f.bias", width)}
    for layer in range(layers):
        ours, theirs = f"blocks.{layer}.", f"transformer.h.{layer}."
        fused = [state[f"{ours}attn.{part}.weight"] for part in "qkv"]
        fused_bias = [bias(f"{ours}attn.{part}.bias", width) for part in "qkv"]
        parts = {  # GPT-2's name: (weight, bias) as torch.nn.Linear holds them
            "attn.c_attn": (torch.cat(fused), torch.cat(fused_bias)),
            "attn.c_proj": (state[f"{ours}attn.proj.weight"], bias(f"{ours}attn.proj.bias", width)),
            "mlp.c_fc": (state[f"{ours}mlp.fc.weight"], bias(f"{ours}mlp.fc.bias", 4 * width)),
            "mlp.c_proj": (state[f"{ours}mlp.proj.weight"], bias(f"{ours}mlp.proj.bias", width)),
        }
        for name, (weight, linear_bias) in parts.items():
            gpt2[f"{theirs}{name}.weight"] = weight.t().contiguous()  # Conv1D: (in, out)
            gpt2[f"{theirs}{name}.bias"] = linear_bias
        for norm in ("ln_1", "ln_2"):
            gpt2[f"{theirs}{norm}.weight"] = state[f"{ours}{norm}.weight"]
            gpt2[f"{theirs}{norm}.bias"] = bias(f"{ours}{norm}.bias", width)
    return gpt2


def blocks_in(state: dict[str, torch.Tensor]) -> int:
    return len({name.split(".")[1] for name in state if name.startswith("blocks.")})


def save_gpt2(state: dict[str, torch.Tensor], n_head: int, to: Path) -> str:
    """Write the ``save_pretrained`` directory; what was written, in a line."""
    if any(".mlp.experts." in name or ".mlp.router." in name for name in state):
        raise UserError(
            "--format hf: the gpt provider's mixture of experts has no transformers GPT-2 counterpart; "
            "export --format safetensors"
        )
    transformers = require("transformers", needed_by="coretrain checkpoint export --format hf", extra="hf")
    vocabulary, width = state["wte.weight"].shape
    config = transformers.GPT2Config(
        vocab_size=vocabulary,
        n_positions=state["wpe.weight"].shape[0],
        n_embd=width,
        n_layer=blocks_in(state),
        n_head=n_head,
        n_inner=4 * width,
        activation_function="gelu",
        layer_norm_epsilon=EPSILON,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT-2's 50256 is no token of this vocabulary
        eos_token_id=None,
        tie_word_embeddings=True,
    )
    model: Any = transformers.GPT2LMHeadModel(config)
    model.load_state_dict({**gpt2_state(state, config.n_layer), "lm_head.weight": state["wte.weight"]}, strict=True)
    model.save_pretrained(to)
    return (
        f"GPT-2 of {config.n_layer} blocks, {width} wide, {vocabulary} tokens -> {to} "
        "(transformers' GPT2LMHeadModel.from_pretrained)"
    )
