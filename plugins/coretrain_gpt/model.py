"""A GPT language model, readable top to bottom (after nanoGPT).

Pre-norm transformer blocks with causal self-attention (PyTorch's fused
scaled_dot_product_attention), a GELU MLP, learned positions and an output head tied to the
token embedding. ``forward(idx, targets)`` returns the mean cross-entropy loss. With
``GPTConfig.moe`` each block's MLP is a mixture of experts (:mod:`coretrain_gpt.moe`), and the
forward with targets returns the loss with the routers' losses and their metrics as a dict.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from attrs import define

from coretrain_gpt.moe import MoE, MoEConfig, moe_outputs


@define(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    bias: bool
    moe: MoEConfig | None = None


class CausalSelfAttention(nn.Module):
    """Separate q, k, v projections, so tensor parallelism can give each rank whole heads."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.exchange: Callable[..., torch.Tensor] | None = None
        """Set by context parallelism: attention of this rank's queries over every rank's keys
        and values (``exchange(q, k, v, dropout_p)``)."""
        self.register_load_state_dict_pre_hook(_split_fused_qkv)  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1: the heads this rank holds (all of them, unless tensor parallelism split them)
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        dropout = self.dropout if self.training else 0.0
        if self.exchange is not None:
            y = self.exchange(q, k, v, dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        out: torch.Tensor = self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(B, T, -1)))
        return out


def _split_fused_qkv(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *args: object) -> None:
    """Read checkpoints of coretrain 0.2, whose attention had one fused ``qkv`` Linear."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip("qkv", fused.chunk(3, dim=0)):
                state_dict[f"{prefix}{name}.{kind}"] = part


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, width: int = 1) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * width * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * width * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.proj(F.gelu(self.fc(x))))
        return out


def moe_layer(cfg: GPTConfig, moe: MoEConfig) -> MoE:
    """A block's mixture of experts, with its shared experts as one dense MLP that wide."""
    shared = MLP(cfg, moe.shared_experts) if moe.shared_experts else None
    return MoE(cfg.n_embd, cfg.bias, cfg.dropout, moe, shared)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp: nn.Module = MLP(cfg) if cfg.moe is None else moe_layer(cfg, cfg.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.positions: torch.Tensor | None = None
        """Set by context parallelism: the positions of every sequence this rank computes."""
        self.whole_sequence: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by context parallelism: the outputs of every rank's positions, in sequence order
        (logits without targets — a prediction — are the whole sequence's)."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (Hugging Face's name: optimizer-overrides' decoupled_lr finds it)."""
        return self.wte

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Logits (B, T, vocab) without targets; the mean cross-entropy loss with them (with
        experts: a dict of it and the routers' losses and loads, :func:`coretrain_gpt.moe.moe_outputs`)."""
        T = idx.size(1)
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        if self.positions is not None:  # context parallelism: this rank's chunks of each sequence
            pos = self.positions
            idx, targets = idx[:, pos], None if targets is None else targets[:, pos]
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits if self.whole_sequence is None else self.whole_sequence(logits)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1).long())
        experts = [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]
        return moe_outputs(loss, experts, self.training) if experts else loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters a token passes through: of the routed experts, only ``top_k`` of them."""
        n = sum(p.numel() for p in self.parameters())
        moe = self.cfg.moe
        if moe is not None:
            layer = next(m for m in self.modules() if isinstance(m, MoE))
            per_expert = sum(p.numel() for p in layer.experts.parameters()) // moe.n_experts
            n -= self.cfg.n_layer * (moe.n_experts - moe.top_k) * per_expert
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6·N for the matmuls plus 12·L·C·T for attention (PaLM, appendix B)."""
        cfg = self.cfg
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: its blocks, under the names they have in the whole model
    (``blocks.5.attn.q.weight``, so checkpoints stay layout-free), the embeddings on the first
    stage and the final norm and output head on the last. Takes token ids on the first stage,
    the previous stage's hidden states on the others; returns logits on the last."""

    _no_split_modules = ("Block",)  # what FSDP shards and activation checkpointing wraps

    def __init__(self, model: GPT, layers: range, first: bool, last: bool, split: SplitPositions | None = None) -> None:
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, first, last
        self.split = split or SplitPositions()
        if model.positions is not None:  # context parallelism configured the whole model first
            self.split.positions = model.positions
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        for block in self.blocks.values():
            if isinstance(block.mlp, MoE):
                block.mlp.history = []  # the step's stats, summed over the stages for logging
                block.mlp.losses_in_backward = True  # its routers' losses join what is optimized in its stage

    def get_input_embeddings(self) -> nn.Module | None:
        """The token embedding on the first stage, as :meth:`GPT.get_input_embeddings`."""
        return self.wte if self.first else None

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head if self.last else None

    @property
    def positions(self) -> torch.Tensor | None:
        """Set by context parallelism (as :attr:`GPT.positions`): the positions of every sequence
        this rank computes; the first stage takes them from the token ids, the loss from the targets."""
        return self.split.positions

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        self.split.positions = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = self.positions if self.positions is not None else torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x if self.positions is None else x[:, pos]) + self.wpe(pos))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x

    def moe_layers(self) -> dict[int, MoE]:
        """The stage's mixture-of-experts layers by their block's index in the whole model."""
        return {int(i): block.mlp for i, block in self.blocks.items() if isinstance(block.mlp, MoE)}


class SplitPositions:
    """The positions a rank computes when sequences are split over ranks, shared by a model's
    pipeline stages and the last stage's loss (which picks the same positions of the targets)."""

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, targets if self.positions is None else targets[:, self.positions])


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over every token, as :meth:`GPT.forward` computes it."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1).long())
