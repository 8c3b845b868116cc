"""What a recovering replica group receives from a live one, and how: the run's state, the
transport (torchft's, read with ``weights_only=True``), sizes."""

from __future__ import annotations

import datetime
import logging
from typing import Any

import attrs
import torch

from coretrain import Run, TrainState, rng_state, set_rng_state

log = logging.getLogger("coretrain")


def run_state(run: Run) -> dict[str, Any]:
    """What a live group sends one that heals: model, optimizer, schedule, counters, random streams."""
    return {
        "model": run.unwrapped_model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "train": attrs.asdict(run.state),
        "rng": rng_state(),
    }


def apply_run_state(run: Run, state: dict[str, Any]) -> None:
    """A live group's :func:`run_state`, applied; the optimizer keeps the config's settings, as a resume does."""
    run.unwrapped_model.load_state_dict(state["model"])
    configured = [{k: v for k, v in group.items() if k != "params"} for group in run.optimizer.param_groups]
    run.optimizer.load_state_dict(state["optimizer"])
    for group, settings in zip(run.optimizer.param_groups, configured):
        group.update(settings)
    run.scheduler.load_state_dict(state["scheduler"])
    run.state = TrainState(**state["train"])
    set_rng_state(state["rng"])


def weights_only_transport(timeout: datetime.timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading what it receives with ``weights_only=True``."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnly(HTTPTransport):  # type: ignore[misc]
        @classmethod
        def _load_from_address(cls, address: str, timeout: datetime.timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    transport = WeightsOnly(timeout=timeout, num_chunks=0)
    server = getattr(transport, "_server", None)  # its HTTP server logs each request to stderr: to our log instead
    if server is not None:
        server.RequestHandlerClass.log_message = lambda handler, form, *args: log.debug("torchft: " + form, *args)
    return transport


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0
