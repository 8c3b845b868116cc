"""Pipeline stages of a Hugging Face causal LM (Llama-shaped: an embedding, decoder layers with
rotary positions, a final norm and a head), for the ``pipeline-parallel`` plugin's split."""

from __future__ import annotations

from typing import Any

import torch

from coretrain import UserError
from coretrain_hf.model import adapted_model
from coretrain_hf.routers import Routers


def transformers_model(hf: Any) -> tuple[Any, str]:
    """The transformers model in ``hf`` and its name there: ``hf`` itself (``""``), or the model
    a PeftModel adapts (``base_model.model``), its LoRA layers inside its decoder layers."""
    inner = adapted_model(hf)
    return inner, next(name for name, module in hf.named_modules() if module is inner)


class HFStage(torch.nn.Module):
    """The decoder layers ``layers`` of ``model`` (a :class:`~coretrain_hf.model.CausalLM`) under
    their names in the whole model (``hf.model.layers.5.self_attn.q_proj.weight``; under LoRA
    ``hf.base_model.model.model.layers.5.self_attn.q_proj.lora_A.default.weight``), with the token
    embedding on the first stage and the final norm and head on the last. Takes token ids on the
    first stage, hidden states on the others; returns logits on the last. Attention is causal
    through SDPA (no mask is built: the sequences are whole windows)."""

    def __init__(self, model: Any, layers: range, first: bool, last: bool, routers: Routers | None = None) -> None:
        super().__init__()
        self.routers = routers  # (a mixture of experts' load-balancing loss)
        hf, self.inner = transformers_model(model.hf)
        base = getattr(hf, hf.base_model_prefix)
        self.first, self.last = first, last
        self.hf = torch.nn.Module()
        self.hf.config = hf.config  # what save_config records (a plain attribute, not a module)
        inner = self.hf
        for name in self.inner.split(".") if self.inner else ():  # a PeftModel's base_model.model
            setattr(inner, name, torch.nn.Module())
            inner = getattr(inner, name)
        shell = torch.nn.Module()
        setattr(inner, hf.base_model_prefix, shell)
        self.base = hf.base_model_prefix
        if first:
            shell.embed_tokens = base.embed_tokens
        shell.layers = torch.nn.ModuleDict({str(i): base.layers[i] for i in layers})
        shell.rotary_emb = base.rotary_emb  # its inverse frequencies are buffers left out of checkpoints
        if last:
            shell.norm, inner.lm_head = base.norm, hf.lm_head
        self._no_split_modules = (type(base.layers[0]).__name__,)  # what FSDP shards, checkpointing wraps
        self.routed = routers.watch(list(shell.layers.values())) if routers is not None else []

    def forward(self, x: torch.Tensor, sums: torch.Tensor | None = None) -> Any:
        """Logits on the last stage; hidden states on the others, with a mixture of experts'
        routing sums so far (:mod:`coretrain_hf.routers`) when the model balances its load."""
        inner = self.hf.get_submodule(self.inner)
        base = getattr(inner, self.base)
        if self.first:
            x = base.embed_tokens(x)
        positions = torch.arange(x.size(1), device=x.device)[None]
        rotary = base.rotary_emb(x, positions)
        for layer in base.layers.values():
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            x = out[0] if isinstance(out, tuple) else out  # transformers < 5 returns a tuple
        if self.routers is not None:
            start = torch.zeros(2, self.routers.experts, device=x.device) if sums is None else sums
            sums = self.routers.added(start, self.routed)
        if not self.last:
            return x if sums is None else (x, sums)
        if self.routers is not None and sums is not None:
            self.routers.finish(sums, x.size(0) * x.size(1), self.training)
        head: Any = inner.lm_head
        logits: torch.Tensor = head(base.norm(x))
        return logits


def pipeline_split(model: Any) -> dict[str, Any]:
    """The ``pipeline_split`` answer for a :class:`~coretrain_hf.model.CausalLM`."""
    from coretrain_hf.model import token_loss

    hf, inner = transformers_model(model.hf)
    base: Any = getattr(hf, hf.base_model_prefix, None)
    if not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise UserError(
            f"distributed.pp_size: a {type(hf).__name__} is not cut into pipeline stages (Llama-shaped causal LMs "
            "are: an embedding, decoder layers with rotary positions, a norm and a head)"
        )
    if hf.config._attn_implementation != "sdpa":
        raise UserError(
            'distributed.pp_size: pipeline stages attend through SDPA: set model.options.attn_implementation = "sdpa"'
        )
    prefix = f"hf.{inner}." if inner else "hf."  # the transformers model's names in the whole model
    head = (f"{prefix}{hf.base_model_prefix}.embed_tokens.weight", f"{prefix}lm_head.weight")
    tied = [head] if hf.config.tie_word_embeddings else []
    routers = Routers(hf) if Routers.balanced(hf) else None
    split = {
        "layers": len(base.layers),
        "stage": lambda layers, first, last: HFStage(model, layers, first, last, routers),
        "loss": token_loss if routers is None else routers.loss,
        "tied": tied,
    }
    if routers is not None:  # its logged values: the stages' shares, summed over them
        split["values"] = lambda stage, micro_batches: routers.values(micro_batches, next(stage.parameters()).device)
    return split
