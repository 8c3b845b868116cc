"""Activation memory and step time of the ``gpt`` provider with activation checkpointing off,
selective (every 2nd block), full, op-level, offload and selective + offload — the
``activation-checkpointing`` plugin's modes. (On CPU, offloading moves nothing: the activations
are in host memory already; its "kept" is what the device would keep, on CUDA, and its saved
tensors are those outside the offload hooks, the embeddings and head.)

    python benchmarks/memory.py                                    # CPU: the small size
    python benchmarks/memory.py --device cuda --sizes 124M,350M --precision bf16

Per mode, on a fresh model with the same seed and batch: one forward and backward as warm-up,
then ``--steps`` timed ones. Memory kept for backward is measured at the end of the forward,
when it peaks: on CUDA ``memory_allocated`` after the forward minus before it, and the step's
``max_memory_allocated`` above the start; on CPU the bytes malloc holds after the forward minus
before it (glibc's ``mallinfo2``; torch's CPU allocator has no statistics of its own), and the
distinct storages autograd saved through ``torch.autograd.graph.saved_tensors_hooks`` (what the
op-level mode keeps lives in its own cache, outside those hooks: that column undercounts it).
Each figure is also given as a ratio of the run without checkpointing, measured in the same
process; the goal for ``full`` is at most 0.5.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from coretrain_activation_checkpointing import apply
from coretrain_gpt.model import GPT, GPTConfig

SIZES = {  # name: (n_layer, n_head, n_embd, seq_length, micro_batch)
    "small": (12, 6, 384, 256, 8),
    "124M": (12, 12, 768, 1024, 8),
    "350M": (24, 16, 1024, 1024, 8),
}
MODES = ("none", "selective", "full", "op", "offload", "selective+offload")
VOCAB = 50304


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def malloc_in_use() -> Callable[[], int]:
    """Bytes glibc's malloc has handed out and not got back (heap and mmapped chunks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def used() -> int:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return used


def saved_for_backward(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The loss, and the bytes of the distinct storages autograd saved while computing it."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    return loss, sum(seen.values())


def measure(
    size: tuple[int, ...], mode: str, device: torch.device, precision: str, steps: int, vocab: int = VOCAB
) -> dict[str, float]:
    """Memory kept for backward, saved tensors, step time (and on CUDA the peak) for one mode."""
    n_layer, n_head, n_embd, seq, batch = size
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=0.0, bias=False
    )
    model = GPT(cfg).to(device)
    if mode != "none":
        apply(model, mode.split("+"), every=2)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    cuda = device.type == "cuda"
    in_use = torch.cuda.memory_allocated if cuda else malloc_in_use()

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss: torch.Tensor = model(inputs, targets)
        return loss

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    forward().backward()  # warm-up: kernels chosen, gradient buffers allocated
    times, kept, saved, peaks = [], [], [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        before = in_use()
        start = time.perf_counter()
        loss, saved_bytes = saved_for_backward(forward)
        sync()
        kept.append(in_use() - before)
        loss.backward()
        sync()
        times.append(time.perf_counter() - start)
        saved.append(saved_bytes)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated(device) - before)
    result = {"kept": statistics.median(kept), "saved": statistics.median(saved), "seconds": statistics.median(times)}
    if peaks:
        result["peak"] = statistics.median(peaks)
    return result


def report(name: str, size: tuple[int, ...], rows: dict[str, dict[str, float]], device: torch.device) -> None:
    base = rows["none"]
    n_layer, _, n_embd, seq, batch = size
    print(f"\ngpt {name}: {n_layer} layers × {n_embd}, seq {seq}, micro-batch {batch}, on {device}")
    header = f"{'mode':<18} {'kept for backward':>22} {'saved tensors':>22} {'step time':>18}"
    print(header + (f" {'peak above start':>22}" if "peak" in base else ""))
    for mode, row in rows.items():
        line = f"{mode:<18} {row['kept'] / 2**20:>10.1f} MB ({row['kept'] / base['kept']:.2f}×)"
        line += f" {row['saved'] / 2**20:>10.1f} MB ({row['saved'] / base['saved']:.2f}×)"
        line += f" {row['seconds'] * 1e3:>8.1f} ms ({row['seconds'] / base['seconds']:.2f}×)"
        if "peak" in row:
            line += f" {row['peak'] / 2**20:>10.1f} MB ({row['peak'] / base['peak']:.2f}×)"
        print(line)
    full = rows["full"]
    kept, saved, slower = full["kept"] / base["kept"], full["saved"] / base["saved"], full["seconds"] / base["seconds"]
    print(
        f"full keeps {kept:.2f} of no checkpointing's activation memory ({saved:.2f} of its saved tensors), "
        f"at {slower:.2f}× the step time"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="small", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    for name in args.sizes.split(","):
        rows: dict[str, Any] = {mode: measure(SIZES[name], mode, device, args.precision, args.steps) for mode in MODES}
        report(name, SIZES[name], rows, device)


if __name__ == "__main__":
    main()
