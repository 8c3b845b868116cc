"""Activation memory per rank of the ``gpt`` provider with its sequences split by the
``context-parallel`` plugin, for each ``cp_comm_type``, against one rank holding whole sequences.

    python benchmarks/context_memory.py [--seqs 256 512 1024] [--cp 1 2 4] [--types all_gather a2a p2p]

For each sequence length, context-parallel size and communication type, ranks started with
torchrun (gloo, one thread each) build the same model (4 layers × 128, 4 heads, micro-batch 2,
fp32) and run one forward with rank 0 counting the distinct storages autograd saves for
backward (``benchmarks/memory.py``'s measure). Reported: those bytes on rank 0, and their ratio
to one rank's at the same length. With ``all_gather`` every rank keeps each layer's gathered keys
and values for the whole sequence; ``a2a`` keeps every position of its share of the heads;
``p2p`` keeps only its own positions (backward passes the others round again).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def worker(seqs: list[int], types: list[str], out: Path) -> None:
    import torch
    import torch.distributed as dist
    from coretrain_context_parallel.exchanges import EXCHANGES
    from coretrain_gpt.model import GPT, GPTConfig
    from memory import saved_for_backward

    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rows = []
    for seq in seqs:
        for kind in types if ranks > 1 else ["one rank"]:
            torch.manual_seed(0)
            config = GPTConfig(vocab_size=256, block_size=seq, n_layer=4, n_head=4, n_embd=128, dropout=0, bias=False)
            model = GPT(config)
            idx, targets = torch.randint(0, 256, (2, seq)), torch.randint(0, 256, (2, seq))
            if ranks > 1:
                attention = EXCHANGES[kind](dist.group.WORLD, ranks, rank, seq, torch.device("cpu"))
                model.positions = attention.queries
                for module in model.modules():
                    if hasattr(module, "exchange"):
                        module.exchange = attention
            _, saved = saved_for_backward(lambda m=model, i=idx, t=targets: m(i, t))  # type: ignore[misc]
            rows.append({"seq": seq, "cp": ranks, "type": kind, "saved": saved})
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--types", nargs="+", default=["all_gather", "a2a", "p2p"])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.seqs, args.types, args.worker)
    here = Path(__file__).resolve()
    results: dict[tuple[int, int, str], int] = {}
    for cp in args.cp:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"]
            command += [str(here), "--worker", str(out), "--seqs", *map(str, args.seqs), "--types", *args.types]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(here.parent)}
            subprocess.run(command, check=True, capture_output=True, env=env)
            results |= {(row["seq"], row["cp"], row["type"]): row["saved"] for row in json.loads(out.read_text())}
    columns = [(cp, kind) for cp in args.cp for kind in (args.types if cp > 1 else ["one rank"])]
    print("gpt 4 × 128, micro-batch 2, fp32: MB saved for backward on rank 0 (ratio to one rank)")
    print(f"{'seq':>6} " + " ".join(f"{f'cp {cp} {kind}':>20}" for cp, kind in columns))
    for seq in args.seqs:
        base = results.get((seq, 1, "one rank"))
        cells = []
        for cp, kind in columns:
            saved = results[(seq, cp, kind)]
            cells.append(f"{saved / 2**20:8.1f}" + (f" ({saved / base:.2f})" if base else ""))
        print(f"{seq:>6} " + " ".join(f"{cell:>20}" for cell in cells))


if __name__ == "__main__":
    main()
