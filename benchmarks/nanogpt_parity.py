"""Does coretrain learn what nanoGPT learns? A character-level model of English prose, both ways.

    python benchmarks/nanogpt_parity.py [--iters 600] [--seeds 2]

The text is the English prose Python ships in ``pydoc_data/topics.py`` (about 0.8 MB, no
download), split 90/10 into train.bin / val.bin with a character vocabulary, as nanoGPT's
``data/shakespeare_char/prepare.py`` does. nanoGPT's ``train.py`` loop is written out here at
its shakespeare_char settings, scaled for a CPU (4 layers, 4 heads, 128 wide, block 64, batch
32, AdamW lr 1e-3 betas (0.9, 0.99) weight decay 0.1 on ≥2-D parameters, warmup then cosine to
1e-4, clip 1.0): random-offset batches from ``torch.randint``, its ``estimate_loss``. coretrain
runs the same model, data and settings from TOML with ``sampling = "random"``. Reported: the
final validation loss of each, per seed, and the difference against the spread between seeds.
"""

from __future__ import annotations

import argparse
import ast
import math
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import torch

LAYERS, HEADS, WIDTH, BLOCK, BATCH = 4, 4, 128, 64, 32
LR, MIN_LR, WARMUP, EVAL_ITERS = 1e-3, 1e-4, 50, 40


def prose() -> str:
    """Every string constant of pydoc_data/topics.py: Python's reference prose."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py").read_text()
    return "\n".join(
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def prepare(directory: Path) -> int:
    """train.bin / val.bin of character ids (uint16), as nanoGPT's prepare.py; returns the vocab size."""
    text = prose()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.uint16)
    split = int(0.9 * len(ids))
    ids[:split].tofile(directory / "train.bin")
    ids[split:].tofile(directory / "val.bin")
    return len(chars)


def nanogpt(directory: Path, vocab: int, iters: int, seed: int) -> float:
    """nanoGPT's train.py, trimmed to what runs here; returns the final estimate_loss()['val']."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
    from coretrain_gpt.model import GPT, GPTConfig

    torch.manual_seed(seed)
    data = {
        split: torch.from_numpy(np.fromfile(directory / f"{split}.bin", dtype=np.uint16).astype(np.int64))
        for split in ("train", "val")
    }

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = data[split]
        ix = torch.randint(len(d) - BLOCK, (BATCH,))
        return torch.stack([d[i : i + BLOCK] for i in ix]), torch.stack([d[i + 1 : i + 1 + BLOCK] for i in ix])

    model = GPT(
        GPTConfig(
            vocab_size=vocab, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, dropout=0.0, bias=False
        )
    )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.99)
    )

    def get_lr(it: int) -> float:
        if it < WARMUP:
            return LR * (it + 1) / (WARMUP + 1)
        ratio = (it - WARMUP) / (iters - WARMUP)
        return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (LR - MIN_LR)

    for it in range(iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        x, y = get_batch("train")
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        return float(torch.stack([model(*get_batch("val")) for _ in range(EVAL_ITERS)]).mean())


def coretrain(directory: Path, iters: int, seed: int) -> float:
    """The same run through `coretrain run`; returns its final valid/loss."""
    import json

    out = directory / f"coretrain-{seed}"
    config = directory / f"coretrain-{seed}.toml"
    config.write_text(
        textwrap.dedent(f"""\
        [run]
        seed = {seed}
        output_dir = "{out}"
        threads = 1
        [model]
        provider = "gpt"
        [model.options]
        n_layer = {LAYERS}
        n_head = {HEADS}
        n_embd = {WIDTH}
        [data]
        provider = "token-file"
        [data.options]
        train_path = "{directory / "train.bin"}"
        valid_path = "{directory / "val.bin"}"
        seq_length = {BLOCK}
        sampling = "random"
        [optimizer]
        lr = {LR}
        betas = [0.9, 0.99]
        weight_decay = 0.1
        [plugins.schedule]
        warmup_iters = {WARMUP}
        decay_style = "cosine"
        min_lr = {MIN_LR}
        [train]
        micro_batch_size = {BATCH}
        train_iters = {iters}
        log_interval = {iters}
        eval_iters = {EVAL_ITERS}
        clip_grad = 1.0
        [checkpoint]
        save = false
        [plugins.optimizer-overrides]
        no_decay_1d = true
        """)
    )
    subprocess.run([sys.executable, "-m", "coretrain", "run", str(config)], check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["valid/loss"] for r in reversed(rows) if "valid/loss" in r)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        vocab = prepare(directory)
        print(f"char-level English prose, vocab {vocab}, {args.iters} iterations, batch {BATCH} x {BLOCK}")
        ours, theirs = [], []
        for seed in range(1, args.seeds + 1):
            theirs.append(nanogpt(directory, vocab, args.iters, seed))
            ours.append(coretrain(directory, args.iters, seed))
            print(f"  seed {seed}: nanoGPT loop val loss {theirs[-1]:.4f}   coretrain valid/loss {ours[-1]:.4f}")
    spread = statistics.pstdev(theirs + ours) if len(theirs) > 1 else float("nan")
    print(
        f"  mean: nanoGPT {statistics.mean(theirs):.4f}, coretrain {statistics.mean(ours):.4f}, "
        f"difference {statistics.mean(ours) - statistics.mean(theirs):+.4f} (spread of the runs {spread:.4f})"
    )


if __name__ == "__main__":
    main()
