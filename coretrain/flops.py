"""FLOPs per training sample, for TFLOP/s and MFU of any model.

A model that knows its cost says so with ``flops_per_token()`` (the ``gpt`` plugin uses
Megatron's formula). Any other model — a CNN, a Hugging Face model, yours — is measured once
before training: one micro-batch's forward under ``torch.utils.flop_counter.FlopCounterMode``,
times 3 for forward + backward (backward costs about twice the forward, the convention MFU
figures use). Counted on the plain model in eval mode, before any wrapper (DDP, FSDP,
compile) exists, leaving the model and the RNG as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coretrain.run import Run

import logging

import torch

from coretrain import outputs
from coretrain.data import batch_size, to_device

log = logging.getLogger("coretrain")


def flops_per_sample(run: Run, loss_fn: outputs.LossFn | None) -> float | None:
    model, datasets = run.model, run.datasets
    method = getattr(model, "flops_per_token", None)
    if callable(method) and datasets.seq_length:
        return float(method()) * datasets.seq_length
    from torch.utils.flop_counter import FlopCounterMode

    from coretrain.loader import first_batch

    batch = first_batch(datasets.train, run.config.train.micro_batch_size, datasets.collate_fn)
    count = batch_size(batch)
    batch = to_device(batch, run.device) if run.device.type != "cpu" else batch
    rng, was_training = torch.get_rng_state(), model.training
    model.eval()  # counting must leave no trace: no BatchNorm statistics updated, no dropout drawn
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            outputs.call(model, batch, loss_fn)
    except Exception as exc:  # an op the counter cannot trace must not stop training
        log.warning(
            "could not count the model's FLOPs (%s: %s); TFLOP/s and MFU are not reported", type(exc).__name__, exc
        )
        return None
    finally:
        model.train(was_training)
        torch.set_rng_state(rng)
    total = counter.get_total_flops()
    return 3.0 * total / count if total else None
