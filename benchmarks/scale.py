"""What grows with the number of ranks: collectives per step, checkpoint files and metadata.

    python benchmarks/scale.py [--ranks 1 2 4 8] [--layers 2 4] [--layouts ddp fsdp ... moe-tp]

For each layout (ddp; fsdp; hsdp: FSDP2 on a 2 × ranks/2 mesh, replicated over 2; tp: tensor
parallel over 2, FSDP2 over the rest; cp: each sequence split over 2 ranks, DDP over all; ep: a
mixture of max(4, ranks) experts, top 2, spread over every rank, FSDP2 for the rest; pp: two
pipeline stages, 1F1B, FSDP2 over the rest; zbv: the same on the ZBVZeroBubble schedule, two
stages per rank — its depth must be a multiple of 4; moe-pp: a mixture of 4 experts, top 2,
in two pipeline stages; ep2: those 4 experts spread over 2 ranks of every data-parallel pair
(EP < DP from 4 ranks), FSDP2 over the pairs; cp-pp: CP 2 × PP 2, FSDP2 over the rest; moe-tp:
the 4 experts' hidden units split over TP 2), GPT depth and rank count, trains the tiny
byte-level GPT for 4 steps under torchrun (gloo, one thread per rank), saving a checkpoint at
step 4, with the ``profiler`` plugin tracing step 3 on rank 0 (with shapes).
Reports the collectives in that step's trace (every ``c10d::`` op between pre_step and
post_step: DDP's gradient all-reduce, FSDP's all-gathers and reduce-scatters, the gradient-norm
all-reduce; coretrain's own agreement runs after post_step, one asynchronous all-reduce of 4
integers a step — benchmarks/agreement.py) and the bytes they moved on rank 0 (each one's first
argument: the tensor sent, received into, reduced, or its own part of a gather or scatter), the
files of the step-4 checkpoint, their bytes, and the size of DCP's ``.metadata`` (sharded
checkpoints) and of coretrain's ``checkpoint.json``. docs/scaling.md extrapolates from these.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STDLIB = Path(os.__file__).parent


LAYOUTS = {  # name: the [distributed] table
    "ddp": 'strategy = "ddp"',
    "fsdp": 'strategy = "fsdp"',
    "hsdp": 'strategy = "fsdp"\ndp_replicate = 2',
    "tp": "tp_size = 2",
    "cp": "cp_size = 2",
    "ep": 'strategy = "fsdp"\nep_size = {ranks}',
    "pp": "pp_size = 2",
    "zbv": 'pp_size = 2\n[plugins.pipeline-parallel]\npp_schedule = "ZBVZeroBubble"',
    "moe-pp": "pp_size = 2",
    "ep2": 'strategy = "fsdp"\nep_size = 2',
    "cp-pp": "cp_size = 2\npp_size = 2",
    "moe-tp": "tp_size = 2",
}
EXPERTS = ("ep", "moe-pp", "ep2", "moe-tp")
"""The layouts of a mixture of experts (4 experts, or one per rank for ``ep``; top 2)."""


def unfit(layout: str, ranks: int, layers: int) -> str | None:
    """Why ``layout`` cannot run on ``ranks`` ranks with ``layers`` blocks (None: it can). HSDP
    replicates over 2, TP, CP and PP split over 2: they need an even number of ranks; EP two;
    ZBV's four stages a depth they divide."""
    if layout == "zbv" and layers % 4:
        return f"its 4 stages (2 per rank, in a V) need a number of layers divisible by 4, not {layers}"
    if layout in ("ddp", "fsdp"):
        return None
    if layout in ("ep", "ep2"):
        return None if ranks >= 2 and ranks % 2 == 0 else "experts are split over an even number of ranks"
    if layout == "cp-pp":
        return None if ranks % 4 == 0 else f"it splits over 2 × 2 ranks, and {ranks} is not a multiple of 4"
    return None if ranks % 2 == 0 else f"it splits over 2 ranks, and {ranks} is odd"


def config(out: Path, layers: int, layout: str, ranks: int) -> str:
    count = max(4, ranks) if layout == "ep" else 4
    experts = f"n_experts = {count}\nmoe_top_k = 2" if layout in EXPERTS else ""
    return f"""
[run]
output_dir = "{out}"
threads = 1
[model]
provider = "gpt"
[model.options]
n_layer = {layers}
n_head = 2
n_embd = 32
{experts}
[data]
provider = "text-bytes"
[data.options]
globs = ["{STDLIB}/a*.py"]
seq_length = 32
max_bytes = 100000
[train]
micro_batch_size = 1
global_batch_size = 8
train_iters = 4
log_interval = 4
eval_iters = 0
[checkpoint]
save_interval = 4
[distributed]
{LAYOUTS[layout].format(ranks=ranks)}
[plugins.profiler]
start = 3
end = 3
record_shapes = true
"""


def measure(ranks: int, layers: int, layout: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        path = Path(tmp) / "c.toml"
        path.write_text(config(out, layers, layout, ranks))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([*command, "-m", "coretrain", "run", str(path)], check=True, capture_output=True, env=env)
        trace = json.loads(next((out / "profile").glob("rank0_*.json")).read_text())
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name", "").startswith("c10d::")]
        ops = collections.Counter(e["name"].removeprefix("c10d::").rstrip("_") for e in events)
        step = out / "checkpoints" / "step_00000004"
        files = [p for p in step.rglob("*") if p.is_file()]
        metadata = step / "sharded" / ".metadata"
        return {
            "collectives": dict(sorted(ops.items())),
            "moved": sum(payload(e) for e in events),
            "files": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "metadata": metadata.stat().st_size if metadata.exists() else 0,
            "manifest": (step / "checkpoint.json").stat().st_size,
            "rank_file": (step / "rank_00000.pt").stat().st_size,
        }


def payload(event: dict[str, Any]) -> int:
    """Bytes of a collective's first argument (the tensor or tensors it sends, receives into or
    reduces; what the profiler records of its shapes and element type), 0 when it recorded none."""
    args = event.get("args", {})
    dims, kinds = args.get("Input Dims") or [[]], args.get("Input type") or [""]
    first = dims[0]
    shapes = first if first and isinstance(first[0], list) else [first]
    width = BYTES.get(str(kinds[0]).split("(")[0].strip(), 4)  # a tensor list's type names no dtype: fp32 here
    return sum(width * math.prod(shape) for shape in shapes if shape)


BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "double": 8, "bool": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    print("tiny GPT (n_embd 32), 4 steps, checkpoint at step 4, gloo on CPU; collectives of step 3 on rank 0")
    print(
        f"{'layout':<8} {'layers':>6} {'ranks':>5} {'files':>5} {'bytes':>9} {'.metadata':>9} "
        f"{'manifest':>8} {'rank_0':>6} {'moved':>9}  collectives in one step (moved: their bytes on rank 0)"
    )
    for layout in args.layouts:
        for layers in args.layers:
            for ranks in args.ranks:
                if (why := unfit(layout, ranks, layers)) is not None:
                    print(f"{layout:<8} {layers:>6} {ranks:>5}  skipped: {why}", flush=True)
                    continue
                m = measure(ranks, layers, layout)
                ops = ", ".join(f"{name} {count}" for name, count in m["collectives"].items()) or "none"  # type: ignore[attr-defined]
                print(
                    f"{layout:<8} {layers:>6} {ranks:>5} {m['files']:>5} {m['bytes']:>9} {m['metadata']:>9} "
                    f"{m['manifest']:>8} {m['rank_file']:>6} {m['moved']:>9}  {ops}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
