"""The numerics of one optimizer step: forward and backward over the micro-batches, then the
update (the veto point, clipping, the optimizer and the schedule).

The loop hands it batches and gets back device tensors; nothing here reads a value on the
host (fp16's overflow check excepted, as in Megatron). Decided once when training starts:
whether a step needs anything a hand-written loop would not do (``plain``), which parameters
train, whether the ranks agree on vetoes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from coretrain import outputs
from coretrain.dist import max_over_ranks, sum_over_ranks
from coretrain.errors import RunFailure
from coretrain.gradnorm import clip_to, gradient_norm
from coretrain.pluginmanager import hook_calls
from coretrain.run import Run


def undeclared_veto(run: Run, step: int, reason: str | None) -> str:
    """A veto on several ranks that no plugin declared: the ranks cannot have agreed on it."""
    watchers = ", ".join(run.plugins.implementers("before_update")) or "a plugin"
    return (
        f"step {step}: an update was vetoed ({reason}) by one of {watchers}, but no enabled plugin "
        f"declares coretrain_vetoes_updates = True; on several ranks a veto must be agreed: set it "
        "on the plugin class that calls run.control.skip_update"
    )


class StepNumerics:
    """Forward/backward and update of one step, for the run as built (model wrappers applied)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        calls = hook_calls(run)
        self.before_update = calls.hook.before_update if calls.implemented("before_update") else None
        self.own_step = calls.hook.forward_backward if calls.implemented("forward_backward") else None
        self.own_clip = calls.hook.clip_gradients if calls.implemented("clip_gradients") else None
        self.world = run.dist.world_size
        vetoing = set(run.plugins.vetoing())
        self.agree_skip = self.world > 1 and bool(vetoing)
        """Some plugin may veto an update on one rank: agree on it every step."""
        self.agree_batch_skip = self.world > 1 and bool(vetoing & set(run.plugins.implementers("pre_step")))
        """Some plugin may veto a step in ``pre_step``: agree on it before the forward pass."""
        self.plain = (
            getattr(run.model, "no_sync", None) is None and run.config.run.precision == "fp32" and run.loss_fn is None
        )
        """One micro-batch needs nothing a hand-written loop would not do (no no_sync, autocast, loss)."""
        self.model, self.optimizer, self.scheduler = run.model, run.optimizer, run.scheduler
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        self.clip = run.config.train.clip_grad

    def forward_backward(self, batches: list[Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """The step's loss (and the model's named values) with gradients accumulated."""
        if self.own_step is not None and (done := self.own_step(run=self.run, batches=batches)) is not None:
            return done
        if len(batches) == 1 and self.plain:  # the common case, with nothing a hand-written loop would not do
            batch = batches[0]
            model = self.model
            result = model(*batch) if type(batch) is tuple else outputs.call_model(model, batch)
            if type(result) is torch.Tensor and result.numel() == 1:  # else split_output says what is wrong
                torch.autograd.backward(result)
                return result, None
            loss, values = outputs.split_output(result)
            tokens = values.get(outputs.NUM_TOKENS)
            if tokens is None:
                torch.autograd.backward(loss)
                return loss, values
            torch.autograd.backward(loss * tokens)
            return self._per_token([loss.detach()], [values])
        return self._accumulate(batches)

    def skips_batch(self, step: int) -> bool:
        """``pre_step`` vetoed the step (``run.control.skip_update``): its batch was drawn, so
        the data order holds, but neither forward nor backward runs (Megatron's dummy step)."""
        return self._vetoed(step, self.agree_batch_skip)[0]

    def update(self, step: int, loss: torch.Tensor, global_batch: int) -> tuple[bool, torch.Tensor | None] | None:
        """before_update (the veto point), then clip and step unless any rank vetoed: (skipped,
        grad norm); None when a rank asked to run the step again (``skip_update(rerun=True)``)."""
        run = self.run
        if self.before_update:
            self.before_update(run=run, step=step, loss=loss.detach())
        grad_norm = None
        skipped, rerun = self._vetoed(step, self.agree_skip)
        if not (skipped or rerun) and run.grad_scaler is not None:
            skipped, grad_norm = self._scaled_update(run.grad_scaler, global_batch)
        elif not (skipped or rerun):
            grad_norm = self._clip() if self.clip > 0 else None
            self.optimizer.step()
            self.scheduler.step(global_batch)
        self.optimizer.zero_grad(set_to_none=True)
        return None if rerun else (skipped, grad_norm)

    def _clip(self) -> torch.Tensor:
        """Clip to ``train.clip_grad``: the global norm before clipping (a plugin's, over pipeline stages)."""
        own = self.own_clip(run=self.run, parameters=self.params, max_norm=self.clip) if self.own_clip else None
        if own is not None:
            return own
        norm = gradient_norm(self.params)  # (over several meshes: expert parallelism's experts beside FSDP's others)
        clip_to(self.params, self.clip, norm)
        return norm

    def _vetoed(self, step: int, agree: bool) -> tuple[bool, bool]:
        """Whether a plugin vetoed the step on any rank (counted as a skipped update), and
        whether one asked to run it again instead (``skip_update(rerun=True)``)."""
        control = self.run.control
        vetoed, rerun = control.skip_reason is not None, control.rerun
        if agree:  # one rank's veto (or rerun) is every rank's: replicas must take the same updates
            agreed = max_over_ranks(int(vetoed), int(rerun))
            vetoed, rerun = bool(agreed[0]), bool(agreed[1])
        elif vetoed and self.world > 1:
            raise RunFailure(undeclared_veto(self.run, step, control.skip_reason))
        control.skip_reason = None
        control.rerun = False
        skipped = vetoed and not rerun  # a rerun replaces the veto: the step runs again, it is not skipped
        if skipped:
            self.run.state.skipped_updates += 1
        return skipped, rerun

    def _scaled_update(self, scaler: torch.amp.GradScaler, global_batch: int) -> tuple[bool, torch.Tensor | None]:
        """fp16: unscale, clip, step unless gradients overflowed; (skipped, grad norm).

        Knowing whether to advance the schedule needs the overflow flag on the host: one sync
        per step, as Megatron's fp16 path has.
        """
        run = self.run
        scaler.unscale_(run.optimizer)
        grad_norm = self._clip() if self.clip > 0 else None
        # the overflow unscale_ found, which makes step() skip (a scaler with hysteresis may keep its scale)
        overflowed = any(found.item() for found in scaler._found_inf_per_device(run.optimizer).values())
        scaler.step(run.optimizer)
        scaler.update()
        if overflowed:
            run.state.skipped_updates += 1
            return True, None  # an overflowed norm would poison the interval's mean
        run.scheduler.step(global_batch)
        return False, grad_norm

    def _accumulate(self, batches: list[Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward over the micro-batches (DDP syncs only on the last);
        the mean loss and the mean of each named value the model returned (per-token
        weighting when the model says its tokens, :data:`coretrain.outputs.NUM_TOKENS`)."""
        run, model = self.run, self.run.model
        no_sync = getattr(model, "no_sync", None)  # DDP
        set_gradient_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
        n_micro, losses, values = len(batches), [], []
        for i, batch in enumerate(batches):
            last = i == n_micro - 1
            if set_gradient_sync is not None:
                set_gradient_sync(last)
            sync = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
            with sync, outputs.autocast(run):
                loss, named = outputs.call(model, batch, run.loss_fn)
            tokens = named.get(outputs.NUM_TOKENS)
            scaled = loss * tokens if tokens is not None else loss / n_micro if n_micro > 1 else loss
            torch.autograd.backward(run.grad_scaler.scale(scaled) if run.grad_scaler is not None else scaled)
            losses.append(loss.detach())
            values.append(named)
        if outputs.NUM_TOKENS in values[0]:
            return self._per_token(losses, values)
        if n_micro == 1:
            return losses[0], values[0]
        return torch.stack(losses).mean(), {
            name: torch.stack([v[name] for v in values]).float().mean() for name in values[0]
        }

    def _per_token(
        self, losses: list[torch.Tensor], values: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Megatron's per-token loss: gradients of sum(loss_i · tokens_i) scaled by
        world / (tokens over every micro-batch and rank) — data parallelism averages over ranks —
        so each token weighs the same however the tokens fall into micro-batches, padding and
        ranks. One all-reduce of the token count per step; no host sync."""
        counts = torch.stack([v[outputs.NUM_TOKENS].float() for v in values])
        total = sum_over_ranks(counts.sum()).clamp(min=1.0)
        scale = self.world / total
        for param in self.params:
            if param.grad is not None:
                param.grad.mul_(scale)
        loss = (torch.stack(losses).float() * counts).sum() * scale  # this rank's share of the global mean
        named = {name: torch.stack([v[name] for v in values]).float().mean() for name in values[0]}
        return loss, named
