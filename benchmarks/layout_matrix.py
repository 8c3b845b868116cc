"""Every layout that fits on N ranks against one rank: pp × dp_replicate × dp_shard × cp × tp, and
every expert-parallel size each can take, for a mixture-of-experts GPT.

    python benchmarks/layout_matrix.py [--ranks 4] [--steps 6] [--only pp2-cp2] [--keep DIR]

The slow tier (tests/test_parallel_matrix.py) tests a representative set of layouts on 2, 4
and 8 gloo ranks; this script tries all of them for one rank count, as a user would: each
factorization of the ranks over the mesh's dimensions (powers of two; ``tp`` at most the 4
heads, ``pp`` at most the 4 blocks), with each ``ep_size`` that divides its ``dp_shard × cp``
and that ``cp_size`` divides. A 4-block GPT (width 32, 4 heads) of 4 experts, top 2, with the
load-balancing and z losses, a capacity of 1.0, biases and a shared expert trains 6 steps
(``--steps``) on the byte-level standard library (global batch 8, micro-batches of 8 / N, an
evaluation halfway and at the end),
first on one rank, then every layout in one torchrun job (gloo, one thread per rank). Reports,
per layout, the worst relative difference from one rank over the loss, gradient norm, the
language-model and routers' losses, the experts' loads and the validation loss (the slow
tier's bound: 1e-5), or the error line of a layout coretrain refuses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STDLIB = Path(os.__file__).parent
JOB = REPO / "tests" / "fixtures" / "commands_in_one_job.py"
KEPT = ("loss", "grad_norm", "lm_loss", "moe_", "moe/", "valid/loss")

CONFIG = """
[run]
output_dir = "unused"
threads = 1
[model]
provider = "gpt"
[model.options]
n_layer = 4
n_head = 4
n_embd = 32
bias = true
n_experts = 4
moe_top_k = 2
moe_aux_loss_coeff = 0.01
moe_z_loss_coeff = 0.001
moe_capacity_factor = 1.0
moe_shared_experts = 1
[data]
provider = "text-bytes"
[data.options]
globs = ["{stdlib}/a*.py"]
seq_length = 32
max_bytes = 100000
[train]
micro_batch_size = {micro}
global_batch_size = 8
train_iters = {steps}
log_interval = 1
eval_iters = 1
eval_interval = {eval_interval}
[optimizer]
lr = 3e-3
[checkpoint]
save = false  # what is compared is the metrics; test_layouts.py resumes every layout from every other
[distributed]
backend = "gloo"
"""


def layouts(ranks: int) -> dict[str, dict[str, int]]:
    """Every (pp, dp_replicate, dp_shard, cp, tp, ep) of ``ranks`` this model can take, by name
    (``shard``: the data-parallel ranks of a replica, FSDP2 over them; DDP too where nothing else
    splits the model)."""
    found: dict[str, dict[str, int]] = {}
    powers = [2**k for k in range(ranks.bit_length()) if 2**k <= ranks]
    for pp, rep, shard, cp, tp in itertools.product(powers, repeat=5):
        if pp * rep * shard * cp * tp != ranks or tp > 4 or pp > 4:
            continue
        for ep in [1, *(e for e in (2, 4) if (shard * cp) % e == 0 and e % cp == 0)]:
            sizes = {"pp": pp, "rep": rep, "shard": shard, "cp": cp, "tp": tp, "ep": ep}
            name = "-".join(f"{key}{size}" for key, size in sizes.items() if size > 1)
            found[name] = sizes | {"ddp": 0}
            if name == f"shard{ranks}":
                found[f"ddp{ranks}"] = sizes | {"ddp": 1}
    return found


KEYS = {"pp": "pp_size", "rep": "dp_replicate", "cp": "cp_size", "tp": "tp_size", "ep": "ep_size"}


def command(config: Path, out: Path, sizes: dict[str, int]) -> list[str]:
    sets = [f"distributed.{key}={sizes[name]}" for name, key in KEYS.items() if sizes[name] > 1]
    sets += [f'distributed.strategy="{"ddp" if sizes["ddp"] else "fsdp"}"', f"run.output_dir={json.dumps(str(out))}"]
    return ["run", str(config), *(arg for value in sets for arg in ("--set", value))]


def figures(out: Path) -> dict[tuple[int, str], float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        (row["step"], name): value
        for row in rows
        for name, value in row.items()
        if isinstance(value, float) and any(part in name for part in KEPT)
    }


def worst(reference: dict[tuple[int, str], float], got: dict[tuple[int, str], float]) -> float | str:
    """The worst relative difference, or what is not there to compare."""
    if sorted(got) != sorted(reference):
        return f"other figures: {sorted(set(reference) ^ set(got))[:3]}"
    return max(abs(got[k] - v) / max(abs(v), 1e-12) for k, v in reference.items())


def write_config(root: Path, ranks: int, steps: int) -> Path:
    """The matrix's config in ``root``: micro-batches of 8 / ``ranks`` (one pass on every rank),
    evaluations halfway and at the end."""
    config = root / "moe.toml"
    micro = max(1, 8 // ranks)
    config.write_text(CONFIG.format(stdlib=STDLIB, micro=micro, steps=steps, eval_interval=steps // 2))
    return config


def plan(config: Path, root: Path, chosen: dict[str, dict[str, int]]) -> list[dict[str, object]]:
    """One job's commands: every chosen layout, each run whatever the one before it ended with."""
    return [{"args": command(config, root / name, sizes), "expect": None} for name, sizes in chosen.items()]


def report(root: Path, chosen: dict[str, dict[str, int]], codes: list[int], bound: float) -> tuple[list[str], int]:
    """Each layout's line (its worst relative difference from ``root / "one"``, or its exit code)
    and how many are within ``bound``."""
    reference = figures(root / "one")
    lines, within = [], 0
    for index, name in enumerate(chosen):
        code = codes[index] if index < len(codes) else "not reached"
        result = worst(reference, figures(root / name)) if code == 0 else f"exit code {code}"
        within += isinstance(result, float) and result <= bound
        lines.append(f"  {name:<24} {f'{result:.1e}' if isinstance(result, float) else result}")
    return lines, within


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--only", nargs="*", help="these layouts' names only")
    parser.add_argument("--keep", type=Path, help="write the runs here (default: a temporary directory)")
    parser.add_argument("--bound", type=float, default=1e-5, help="exit 1 unless every layout is within it")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run (an evaluation halfway and at the end)")
    args = parser.parse_args()
    chosen = {n: s for n, s in layouts(args.ranks).items() if not args.only or n in args.only}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        config = write_config(root, args.ranks, args.steps)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        one = subprocess.run(
            [sys.executable, "-m", "coretrain", "run", str(config), "--set", f'run.output_dir="{root / "one"}"'],
            env=env,
            capture_output=True,
            text=True,
        )
        if one.returncode:
            sys.exit(one.stderr)
        commands = root / "plan.json"
        commands.write_text(json.dumps(plan(config, root, chosen)))
        job = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
        done = subprocess.run([*job, str(JOB), str(commands)], env=env, capture_output=True, text=True)
        (root / "job.log").write_text(done.stderr)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        codes_file = commands.with_name(commands.name + ".codes")
        codes = json.loads(codes_file.read_text()) if codes_file.is_file() else []
        lines, within = report(root, chosen, codes, args.bound)
        print(f"{len(chosen)} layouts of {args.ranks} ranks against one rank (worst relative difference):")
        print(*lines, sep="\n")
        print(f"{within} of {len(chosen)} within {args.bound:g}")
        if errors:
            print("errors said:", *sorted(set(errors)), sep="\n  ")
        if len(codes) < len(chosen):
            print(f"the job ended (exit code {done.returncode}) before the last layouts:", done.stderr[-3000:])
    sys.exit(0 if within == len(chosen) else 1)


if __name__ == "__main__":
    main()
