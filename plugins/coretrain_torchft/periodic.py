"""Semi-synchronous replica groups: torchft's LocalSGD and DiLoCo, synced at step boundaries.

Each group trains on its own (its own updates, no exchange of gradients) and every ``sync_every``
steps the groups meet in a quorum: LocalSGD averages their weights, DiLoCo averages their
pseudo-gradients (the weights at the last sync minus today's) and takes an outer optimizer step
from the last sync's weights. The arithmetic is torchft's (``torchft.local_sgd``); what this module
changes is *when* it runs. torchft hooks the optimizer's step, i.e. the middle of coretrain's
update (the schedule not yet stepped, the step not yet counted); a group that heals there would
take a state half a step old. Here the sync runs at the boundary between two steps (the next
step's ``pre_step``), so that a joining group, which meets the live groups in that sync's quorum,
takes their state as of the end of the step and then does the same averaging they do.
"""

from __future__ import annotations

from typing import Any

import torch


class PeriodicSync:
    """torchft's LocalSGD or DiLoCo over one model, driven by :meth:`average` after each quorum.

    ``outer``: DiLoCo's outer SGD settings (``lr``, ``momentum``, ``nesterov``)."""

    def __init__(self, mode: str, manager: Any, model: torch.nn.Module, optimizer: Any, **outer: Any) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        self._manager, self._model = manager, model
        self._local_sgd: LocalSGD | None = None
        self._outer: torch.optim.Optimizer | None = None
        if mode == "localsgd":
            self._local_sgd = LocalSGD(manager, model, optimizer, sync_every=1)
            return
        self._outer = torch.optim.SGD(model.parameters(), **outer)
        diloco = DiLoCo(
            manager,
            [model],
            optimizer,
            self._outer,
            sync_every=1,  # (when to sync is decided by the caller: every sync_every steps)
            pin_memory=torch.cuda.is_available(),  # the weights of the last sync, kept in host memory
        )
        self._fragment = diloco._fragments[0]  # the whole model is one fragment (no streaming)

    def average(self) -> bool:
        """The groups of the quorum just started averaged; False when the quorum did not commit:
        the weights are as before the call, and the sync may run again under a new quorum."""
        step = self._manager.current_step()  # a commit counts one more
        if self._local_sgd is not None:
            self._local_sgd._perform_sync()  # the averaged weights are copied in only on commit
            return bool(self._manager.current_step() > step)
        local = [p.detach().clone() for p in self._model.parameters()]
        self._fragment.prepare_sync()
        self._fragment.perform_sync()  # on commit the outer step; otherwise the last sync's weights
        if self._manager.current_step() > step:
            return True
        with torch.no_grad():  # this sync runs again: from the weights the groups came with
            for p, kept in zip(self._model.parameters(), local):
                p.copy_(kept)
        return False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of DiLoCo: the weights of the last sync, the outer optimizer's
        state (LocalSGD keeps nothing: the weights are the model's)."""
        if self._outer is None:
            return {}
        original = {name: tensor.clone() for name, tensor in self._fragment.original_parameters.items()}
        return {"last_sync": original, "outer_optimizer": self._outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._outer is None or not state:
            return
        for name, tensor in state["last_sync"].items():
            self._fragment.original_parameters[name].copy_(tensor)
        self._outer.load_state_dict(state["outer_optimizer"])
