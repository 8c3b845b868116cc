"""``out-of-memory`` (on by default): a run that runs out of memory ends with one line naming
the sizes that decide memory and what to lower, instead of an allocator's traceback.

Knows CUDA's ``torch.OutOfMemoryError``, Python's ``MemoryError`` and the CPU allocator's
"can't allocate memory"; any other exception is left as it is (hook ``explain_failure``).
"""

from __future__ import annotations

from attrs import define

from coretrain import Run, hookimpl


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(error)


@define
class OutOfMemory:
    """Explain an out-of-memory failure in one line: micro-batch, sequence and model sizes."""

    @hookimpl
    def explain_failure(self, run: Run, error: BaseException) -> str | None:
        if not is_out_of_memory(error):
            return None
        params = sum(p.numel() for p in run.model.parameters()) if Run.model.is_built(run) else 0
        seq = run.datasets.seq_length if Run.datasets.is_built(run) else None
        shape = f"micro_batch_size {run.config.train.micro_batch_size}" + (f" × seq_length {seq}" if seq else "")
        text = str(error)
        detail = (
            text[text.index("you tried") :].split(".")[0]
            if "you tried" in text
            else next((line for line in text.splitlines() if line.strip()), type(error).__name__)[:160]
        )
        return (
            f"out of memory at step {run.state.step + 1} on {run.device} ({shape}, model {params / 1e6:.1f}M "
            f"parameters): {detail}; lower train.micro_batch_size (global_batch_size stays, through "
            "gradient accumulation) or the model size"
        )
