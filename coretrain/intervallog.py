"""The steps since the last log, held as device tensors and turned into metrics with one sync.

What ``on_log`` receives: loss, grad norm, the model's named values and plugins'
``run.log_tensors``, averaged over the interval and over ranks with one collective, and the
run's counters. Time — the rates, where it went (``time/*``), FLOPs, MFU — and memory are the
``timers`` plugin's.
"""

from __future__ import annotations

from typing import Any

import torch

from coretrain.dist import mean_over_ranks, sum_over_ranks
from coretrain.errors import RunFailure
from coretrain.run import Run


class IntervalLog:
    """The steps since the last log, turned into floats with one host sync at flush.

    Per step this only appends references to the loss, grad-norm and the model's named-value
    tensors (no device op, no allocation); the backward graph they point to is already freed,
    so holding them for one interval costs a few hundred bytes each.
    """

    def __init__(self, device: torch.device) -> None:
        self.losses: list[torch.Tensor] = []
        """The losses of the steps that updated: the interval's mean is theirs (Megatron's)."""
        self.steps: list[int] = []
        """The step of each of ``losses``."""
        self.skipped = 0
        """Steps of the interval without an update (vetoed, overflowed, or their batch skipped):
        their loss, grad norm and values are left out, and their count is logged."""
        self.grad_norms: list[torch.Tensor] = []
        self.values: dict[str, list[torch.Tensor]] = {}

    def add(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None,
        values: dict[str, torch.Tensor] | None,
        step: int = 0,
        skipped: bool = False,
    ) -> None:
        """One step's device tensors, kept by reference (no sync, no copy); a step without an
        update is only counted."""
        if skipped:  # a NaN that was not applied must not reach the mean
            self.skipped += 1
            return
        self.steps.append(step)
        self.losses.append(loss)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        if values:
            for name, value in values.items():
                self.values.setdefault(name, []).append(value)

    def flush(self, run: Run) -> dict[str, float]:
        """The interval's metrics; ``loss``, ``grad_norm`` and the model's values are means over
        the steps that updated, absent when none did (the ranks skip the same steps)."""
        world = run.dist.world_size
        device = self.losses[0].device if self.losses else run.device
        with torch.no_grad():
            series = {"loss": self.losses, "grad_norm": self.grad_norms}
            series.update({f"train/{name}": values for name, values in self.values.items()})
            series = {name: values for name, values in series.items() if values}
            reports = torch.tensor([float(run.reports_loss)], device=device)  # the loss and values: its ranks'
            means = [torch.stack(v).float().mean() * (1 if n == "grad_norm" else reports[0]) for n, v in series.items()]
            extra = list(run.log_tensors)
            means.extend(run.log_tensors[name].detach().float().to(device) for name in extra)
            run.log_tensors.clear()
            # the interval's one collective and host sync: sums over ranks, then means on the host
            summed = sum_over_ranks(
                torch.cat([*(m.reshape(1) for m in means), reports, self._nonfinite_applied(device)])
            )
        *sums, reporters, nonfinite = summed.tolist()
        if nonfinite:
            raise RunFailure(self._nonfinite_message(int(nonfinite)))
        by = {name: world if name == "grad_norm" or name in extra else reporters for name in [*series, *extra]}
        metrics = {name: value / by[name] for name, value in zip([*series, *extra], sums)}
        if run.grad_scaler is not None:  # fp16: the scale the next step multiplies the loss by
            metrics["loss_scale"] = run.grad_scaler.get_scale()
        counts = {
            "global_batch_size": run.global_batch_size,
            "consumed_samples": run.state.consumed_samples,
            "skipped_updates": run.state.skipped_updates,
            "skipped_steps": self.skipped,
        }
        metrics.update({name: float(count) for name, count in counts.items()})
        self.losses, self.steps, self.grad_norms, self.values, self.skipped = [], [], [], {}, 0
        return metrics

    def check_finite(self, run: Run) -> None:
        """Before a checkpoint: no update of the pending interval came from a NaN/Inf loss (one
        all-reduce and sync; every rank saves at the same steps)."""
        count = int(sum_over_ranks(self._nonfinite_applied(run.device)).item())
        if count:
            raise RunFailure(self._nonfinite_message(count))

    def _nonfinite_applied(self, device: torch.device | None = None) -> torch.Tensor:
        """How many of the interval's applied updates came from a NaN/Inf loss (device ops, no sync)."""
        if not self.losses:
            return torch.zeros(1, device=device)
        bad = ~torch.isfinite(torch.stack(self.losses).float())
        return bad.sum(dtype=torch.float32).reshape(1)

    def _nonfinite_message(self, count: int) -> str:
        """The error once applied updates had a NaN/Inf loss: the first such step (this rank's),
        why the run stops rather than train on ruined weights, and what to look at."""
        bad = [i for i, loss in enumerate(self.losses) if not torch.isfinite(loss).item()]
        where = f"at step {self.steps[bad[0]]} (loss {self.losses[bad[0]].item()})" if bad else "on another rank"
        return (
            f"the loss is not finite {where}, and {count} update(s) with such a loss were applied in the last "
            "log interval: the weights are no longer usable. Check the input data (NaN or Inf in a batch?) and "
            "the learning rate; the guards plugin ([plugins.guards]) skips such steps instead. Checkpoints of "
            "earlier steps are intact"
        )

    def pending(self, over_ranks: bool = False, reports: bool = True) -> dict[str, Any]:
        """What a checkpoint must carry so the next log after resume averages the same steps.

        ``over_ranks``: averaged over the ranks that ``reports`` a loss, step by step (one
        all-reduce; every rank must call it) — what a resume on another number of ranks continues
        from, so no rank has to read every other rank's file."""
        if not self.losses and not self.skipped:
            return {}
        with torch.no_grad():
            series = {
                "losses": self.losses,
                "grad_norms": self.grad_norms,
                **{f"values/{name}": values for name, values in self.values.items()},
            }
            stacked = {name: torch.stack(t).float() if t else torch.empty(0) for name, t in series.items()}
            present = {name: t for name, t in stacked.items() if t.numel()}
            if over_ranks and present:
                flat = torch.cat(list(present.values()))
                flat = mean_over_ranks(torch.cat([flat * float(reports), flat.new_tensor([float(reports)])]))
                flat = flat[:-1] / flat[-1]
                parts = torch.split(flat, [t.numel() for t in present.values()])
                stacked.update({name: part.view_as(t) for (name, t), part in zip(present.items(), parts)})
            on_host = {name: t.cpu() for name, t in stacked.items()}
            steps = torch.tensor(self.steps, dtype=torch.int64)
            values = {name: on_host[f"values/{name}"] for name in self.values}
            saved = {"losses": on_host["losses"], "grad_norms": on_host["grad_norms"], "values": values}
            return {**saved, "steps": steps, "skipped": self.skipped}

    def restore(self, state: dict[str, Any], device: torch.device, step: int = 0) -> None:
        """Continue the interval a checkpoint at ``step`` saved (one before the skipped steps
        were kept apart holds consecutive steps ending at ``step``)."""
        if state:
            count = len(state["losses"])
            steps = state.get("steps")
            self.steps = steps.tolist() if steps is not None else list(range(step - count + 1, step + 1))
            self.skipped = int(state.get("skipped", 0))
            self.losses = list(state["losses"].to(device).unbind())
            self.grad_norms = list(state["grad_norms"].to(device).unbind())
            self.values = {name: list(values.to(device).unbind()) for name, values in state.get("values", {}).items()}
