"""How long a checkpoint blocks training: synchronous save vs ``checkpoint.async_save``.

    python benchmarks/checkpoint_async.py [--layers 14] [--rounds 3]

A ~100M-parameter GPT with AdamW state on CPU (about 1.2 GB to write). Sync and async saves
alternate in one process (after one warm-up round each); for async we report the training-thread blocking time (the copy
to host memory) and, separately, how long the background write took to commit.
Target: async blocking <= 10% of the synchronous save.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from coretrain_gpt.model import GPT, GPTConfig

from coretrain.build import build_run
from coretrain.checkpoint.writer import Checkpointer
from coretrain.config import Config
from coretrain.configload import structure
from coretrain.pluginmanager import load_plugins
from coretrain.run import Datasets

LAYERS = 14


def make_model() -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=LAYERS, n_head=12, n_embd=768, dropout=0.0, bias=False))


def make_data() -> Datasets:
    from coretrain_windows import TokenWindows

    return Datasets(train=TokenWindows(torch.randint(0, 256, (10_000,)), 64), seq_length=64, vocab_size=256)


def build(output_dir: str, asynchronous: bool):
    cfg = structure(
        {
            "run": {"output_dir": output_dir},
            "model": {"provider": "checkpoint_async:make_model"},
            "data": {"provider": "checkpoint_async:make_data"},
            "train": {"micro_batch_size": 2, "train_iters": 1, "eval_iters": 0},
            "checkpoint": {"async_save": asynchronous, "resume": "never"},
        },
        Config,
    )
    return build_run(cfg, load_plugins(cfg, installed={}))


def main() -> None:
    global LAYERS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    LAYERS = args.layers
    sys.modules.setdefault("checkpoint_async", sys.modules[__name__])
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        run = build(tmp, asynchronous=False)
        x, y = run.datasets.train.get_batch(torch.arange(2))
        run.model(x, y).backward()
        run.optimizer.step()  # materialize AdamW state
        params = sum(p.numel() for p in run.model.parameters())
        size = sum(t.numel() * t.element_size() for t in run.model.state_dict().values()) * 3
        sync_s, async_block_s, async_total_s = [], [], []
        run.config.checkpoint.async_save = True
        saver = Checkpointer(run)  # one per run, as in training: staging buffers persist
        run.config.checkpoint.async_save = False
        syncer = Checkpointer(run)
        for i in range(args.rounds + 1):
            run.state.step = 2 * i + 1
            _, blocked = syncer.save({}, [])
            sync_s.append(blocked)
            run.state.step = 2 * i + 2
            start = time.perf_counter()
            _, blocked = saver.save({}, [])
            saver.wait()
            async_block_s.append(blocked)
            async_total_s.append(time.perf_counter() - start)
        first_block = async_block_s.pop(0)  # the first async save allocates its staging buffers
        sync_s.pop(0), async_total_s.pop(0)
        sync, block, total = (statistics.median(v) for v in (sync_s, async_block_s, async_total_s))
        print(
            f"checkpoint of a {params / 1e6:.0f}M-parameter GPT + AdamW state (~{size / 2**30:.2f} GiB), "
            f"median of {args.rounds} rounds after a warm-up round, written under {Path.cwd()}"
        )
        print(f"  synchronous save          {sync:7.3f} s blocked   (rounds: {', '.join(f'{s:.3f}' for s in sync_s)})")
        print(
            f"  async save: blocked       {block:7.3f} s           "
            f"(rounds: {', '.join(f'{s:.3f}' for s in async_block_s)}; "
            f"first save, allocating its staging buffers: {first_block:.3f} s)"
        )
        print(f"  async save: committed in  {total:7.3f} s (in the background)")
        print(f"  blocking ratio async/sync {block / sync:7.3f}   (target <= 0.10)")


if __name__ == "__main__":
    main()
