"""Does ``coretrain lr-find --rule lightning`` land where Lightning's ``Tuner.lr_find`` does?

    python -m venv /tmp/ltn && /tmp/ltn/bin/pip install torch==2.13.0 lightning==2.6.6
    python benchmarks/lr_find_parity.py --lightning-python /tmp/ltn/bin/python --work /tmp/lrparity

The same workload on both sides: a classifier (an MLP over synthetic 8x8 "digits", each class a
noisy prototype), its weights from one seed, AdamW without weight decay or clipping, batches of
32 in coretrain's seeded order (Lightning's DataLoader is given the same permutation). coretrain
runs ``coretrain lr-find`` (this interpreter); Lightning runs ``Tuner(trainer).lr_find`` with
the same ``min_lr``, ``max_lr``, number of steps and early-stop threshold (the other
interpreter, where Lightning is installed). Printed per setting: the steps each ran, the worst
relative difference of the rates and of the smoothed losses (Lightning keeps only those), and
both suggestions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SETTINGS = [(1e-8, 1.0, 100, 1234), (1e-6, 10.0, 100, 7), (1e-5, 1.0, 60, 3)]
"""(min_lr, max_lr, steps, seed)."""

WORKLOAD = """
import torch

CLASSES = 10


class Digits(torch.utils.data.Dataset):
    def __init__(self, count, seed):
        prototypes = torch.randn(CLASSES, 64, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (count,), generator=g)
        self.images = prototypes[self.labels] + 2.5 * torch.randn(count, 64, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))


def build_data():
    from coretrain import Datasets

    return Datasets(train=Digits(6000, 1))
"""

CONFIG = """
[run]
output_dir = "{out}"
seed = {seed}
threads = 1
[model]
provider = "lrwork:build_model"
loss = "cross_entropy"
[data]
provider = "lrwork:build_data"
[optimizer]
lr = 1e-3
weight_decay = 0.0
[train]
micro_batch_size = 32
train_iters = 1000
clip_grad = 0.0
eval_iters = 0
log_interval = 1000
"""

LIGHTNING = """
import json, sys
import torch
import lightning as L
from lightning.pytorch.tuner import Tuner
sys.path.insert(0, sys.argv[1])
import lrwork

min_lr, max_lr, steps, seed = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(seed)  # coretrain seeds torch before it builds the model
        self.model = lrwork.build_model()
        self.lr = 1e-3

    def training_step(self, batch, index):
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(self.model(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)


data = lrwork.Digits(6000, 1)
order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()  # coretrain's epoch 0
loader = torch.utils.data.DataLoader(data, batch_size=32, sampler=order)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[6])
finder = Tuner(trainer).lr_find(Module(), train_dataloaders=loader, min_lr=min_lr, max_lr=max_lr,
                                num_training=steps, early_stop_threshold=4.0, update_attr=False)
print(json.dumps({"lr": finder.results["lr"], "loss": finder.results["loss"], "suggestion": finder.suggestion()}))
"""


def relative(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=False)), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightning-python", required=True, help="an interpreter with torch and lightning")
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "lrwork.py").write_text(WORKLOAD)
    env = {**os.environ, "PYTHONPATH": str(args.work), "OMP_NUM_THREADS": "1"}
    for min_lr, max_lr, steps, seed in SETTINGS:
        out = args.work / f"run-{seed}"
        config = args.work / f"lr-{seed}.toml"
        config.write_text(CONFIG.format(out=out, seed=seed))
        sweep = ["--min-lr", str(min_lr), "--max-lr", str(max_lr), "--steps", str(steps), "--rule", "lightning"]
        ours = subprocess.run(
            [sys.executable, "-m", "coretrain", "lr-find", str(config), *sweep],
            env=env,
            capture_output=True,
            text=True,
        )
        if ours.returncode:
            sys.exit(ours.stderr)
        rows = [json.loads(line) for line in (out / "lr_find" / "lr_find.jsonl").read_text().splitlines()]
        suggested = float(ours.stdout.split("--set optimizer.lr=")[1].split()[0])
        script = [args.lightning_python, "-c", LIGHTNING, str(args.work), str(min_lr), str(max_lr), str(steps)]
        theirs_run = subprocess.run(
            [*script, str(seed), str(out / "lightning")], env=env, capture_output=True, text=True
        )
        if theirs_run.returncode:
            sys.exit(theirs_run.stderr)
        theirs = json.loads(theirs_run.stdout.strip().splitlines()[-1])
        smoothed = relative([row["smoothed"] for row in rows], theirs["loss"])
        lrs = relative([row["lr"] for row in rows], theirs["lr"])
        print(
            f"min_lr {min_lr:g}, max_lr {max_lr:g}, {steps} steps, seed {seed}: coretrain ran {len(rows)} steps, "
            f"Lightning {len(theirs['loss'])}; lr worst {lrs:.1e}, smoothed loss worst {smoothed:.1e}; "
            f"suggested: coretrain {suggested:.3g}, Lightning {theirs['suggestion']:.3g}"
        )


if __name__ == "__main__":
    main()
