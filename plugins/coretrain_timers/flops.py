"""FLOPs per training sample, for TFLOP/s and MFU of any model.

A model that knows its cost says so with ``flops_per_token()`` (the ``gpt`` plugin uses
Megatron's formula). Any other model — a CNN, a Hugging Face model, yours — is measured once
before training: one micro-batch's forward under ``torch.utils.flop_counter.FlopCounterMode``,
times 3 for forward + backward (backward costs about twice the forward, the convention MFU
figures use). Counted on the plain model in eval mode, before any wrapper (DDP, FSDP,
compile) exists, leaving the model and the RNG as they were.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from coretrain import Run, UserError, fetch, forward, is_stream, to_device

log = logging.getLogger("coretrain")


def flops_per_sample(run: Run) -> float | None:
    model, datasets = run.model, run.datasets
    method = getattr(model, "flops_per_token", None)
    if callable(method) and datasets.seq_length:
        return float(method()) * datasets.seq_length
    from torch.utils.flop_counter import FlopCounterMode

    rng, was_training = torch.get_rng_state(), model.training
    model.eval()  # counting must leave no trace: no BatchNorm statistics updated, no dropout drawn
    try:
        batch, count = first_batch(run)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            forward(run, batch)
    except Exception as exc:  # an op the counter cannot trace must not stop training
        # a mistake in the batch or config (a UserError) ends the run at its first step, which says it once
        level = logging.DEBUG if isinstance(exc, UserError) else logging.WARNING
        what = f"{type(exc).__name__}: {exc}"
        log.log(level, "could not count the model's FLOPs (%s); TFLOP/s and MFU are not reported", what)
        return None
    finally:
        model.train(was_training)
        torch.set_rng_state(rng)
    total = counter.get_total_flops()
    return 3.0 * total / count if total else None


def first_batch(run: Run) -> tuple[Any, int]:
    """One micro-batch of the train split's first samples, on the device, and its sample count."""
    dataset, collate = run.datasets.train, run.datasets.collate_fn
    count = run.config.train.micro_batch_size
    if is_stream(dataset):
        samples = [item for _, item in zip(range(count), iter(dataset))]
        batch = (collate or torch.utils.data.default_collate)(samples)
        count = len(samples)
    else:
        count = min(count, len(dataset))
        batch = fetch(dataset, torch.arange(count), collate)
    return (to_device(batch, run.device) if run.device.type != "cpu" else batch), count
