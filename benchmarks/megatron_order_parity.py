"""Does the ``indexed`` provider hand out Megatron-Core's samples, in Megatron's order? Checked
against Megatron-Core's own ``GPTDataset`` and ``BlendedDataset``, built by its own
``BlendedMegatronDatasetBuilder`` (its split of the documents included), on the same files.

    pip download --no-deps --ignore-requires-python megatron-core==0.19.2 -d /tmp/mcore
    unzip -q /tmp/mcore/megatron_core-*.whl -d /tmp/mcore/x
    # on Python 3.11 (the wheel's helpers are built for 3.12): its helpers.cpp, built as its Makefile does
    cd /tmp/mcore/x/megatron/core/datasets && pip install pybind11 && \
      g++ -O3 -shared -std=c++17 -fPIC $(python -m pybind11 --includes) helpers.cpp \
      -o helpers_cpp$(python3-config --extension-suffix)
    python benchmarks/megatron_order_parity.py --megatron /tmp/mcore/x --work /tmp/order

Megatron-Core's package ``__init__`` imports Transformer Engine and Triton, so it is bypassed:
``megatron.core`` is made a bare package over the wheel's directory, and the four modules the
datasets import from outside ``megatron.core.datasets`` are stood in for (a logging helper,
the tokenizer base class, ``safe_numpy_load`` as ``numpy.load``). Its compiled ``helpers``
(``build_sample_idx``, ``build_blending_indices``) are the wheel's own source. For each case of
two prefixes of documents with distinct token ids, one prefix and a blend of both, and each
(seed, seq_length, samples) setting, every sample of train, valid and test is compared token
for token with coretrain's ``train[k]``, ``valid[k]``, ``test[k]``, with the default
``split_rule`` (Megatron-Core's) and with ``megatron-lm-legacy`` (which should differ wherever
the two rules split the documents differently).
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

SETTINGS = [(1234, 16, 400, 40, 20, (0.7, 0.3)), (7, 8, 3000, 300, 30, (0.5, 0.5)), (1, 32, 50, 10, 10, (0.2, 0.8))]
"""(seed, seq_length, train, valid and test samples, blend weights)."""
CASES = [(40, 60, "90,8,2"), (520, 1500, "969,30,1"), (49, 30, "80,15,5"), (150, 250, "98,1,1")]
"""(documents of the first prefix, of the second, split): Megatron-LM's legacy rounding of the
split agrees with Megatron-Core's on 40 and 60 documents with "90,8,2", on none of the others.
Each split has documents here: Megatron-Core asked for samples of a split with none (49
documents with "969,30,1" leave the test split none) loops for ever in ``_get_num_epochs``."""


def import_megatron(directory: Path) -> Any:
    """Megatron-Core's dataset builder and GPTDataset classes, without its package __init__."""
    sys.path.insert(0, str(directory))
    core = types.ModuleType("megatron.core")
    core.__path__ = [str(directory / "megatron" / "core")]
    stand_ins = {
        "megatron.core": core,
        "megatron.core.utils": {"log_single_rank": lambda *args, **kwargs: None},
        "megatron.core.tokenizers": {"MegatronTokenizerBase": object},
        "megatron.core.safe_globals": {"safe_numpy_load": lambda *args, **kwargs: np.load(*args, **kwargs)},
    }
    for name, attributes in stand_ins.items():
        module = attributes if isinstance(attributes, types.ModuleType) else types.ModuleType(name)
        for attribute, value in attributes.items() if isinstance(attributes, dict) else []:
            setattr(module, attribute, value)
        sys.modules[name] = module
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


class Tokenizer:
    """What GPTDatasetConfig asks of a tokenizer (its ids are not used to cut samples)."""

    eod, pad, vocab_size, unique_identifiers = 0, 0, 1 << 16, {"class": "Tokenizer"}


def write_prefix(prefix: Path, documents: int, first: int, seed: int) -> None:
    """Megatron's MMIDIDX .bin/.idx (int32) of ``documents`` documents, each of distinct ids, 3-40 long."""
    import struct

    rng = np.random.default_rng(seed)
    docs = [np.arange(first + 64 * d, first + 64 * d + int(rng.integers(3, 41)), dtype="<i4") for d in range(documents)]
    prefix.with_suffix(".bin").write_bytes(b"".join(d.tobytes() for d in docs))
    lengths = [len(d) for d in docs]
    pointers = [4 * int(np.sum(lengths[:i])) for i in range(len(lengths))]
    index = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4)
    index += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(docs) + 1)
    index += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
    index += struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1))
    prefix.with_suffix(".idx").write_bytes(index)


def window(sample: Any) -> list[int]:
    """A sample's seq_length + 1 tokens: Megatron's tokens and last label, or coretrain's (x, y)."""
    if isinstance(sample, dict):
        return [*sample["tokens"].tolist(), int(sample["labels"][-1])]
    return [*sample[0].tolist(), int(sample[1][-1])]


def agreement(mine: Any, theirs: list[Any]) -> list[tuple[str, int, int]]:
    """(split, samples equal, Megatron's samples) for each split Megatron built."""
    rows = []
    for name, a, b in zip(("train", "valid", "test"), (mine.train, mine.valid, mine.test), theirs, strict=True):
        if b is None or len(b) == 0:
            continue
        rows.append(
            (name, sum(a is not None and k < len(a) and window(a[k]) == window(b[k]) for k in range(len(b))), len(b))
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron", type=Path, required=True, help="the unzipped megatron-core wheel")
    parser.add_argument("--work", type=Path, required=True, help="a directory for the corpora and caches")
    args = parser.parse_args()
    builder, dataset, dataset_config = import_megatron(args.megatron)
    from coretrain_indexed import Indexed

    from coretrain import DatasetContext
    from coretrain.config import Config

    args.work.mkdir(parents=True, exist_ok=True)
    equal = {"megatron-core": 0, "megatron-lm-legacy": 0}
    total = 0
    for first, second, split in CASES:
        prefixes = [str(args.work / f"web{first}"), str(args.work / f"code{second}")]
        write_prefix(Path(prefixes[0]), first, 1, first)
        write_prefix(Path(prefixes[1]), second, 200_000, second)
        for seed, seq, train, valid, test, weights in SETTINGS:
            for blend in ([prefixes[0]], prefixes):
                blend_weights = list(weights) if len(blend) > 1 else None
                config = dataset_config(
                    random_seed=seed, sequence_length=seq, blend=(blend, blend_weights), split=split,
                    tokenizer=Tokenizer(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                    path_to_cache=str(args.work / "megatron"), mid_level_dataset_surplus=0.005,
                )  # fmt: skip
                theirs = builder(dataset, [train, valid, test], lambda: True, config).build()
                data_path = [x for w, p in zip(blend_weights or [1.0], blend, strict=True) for x in (w, p)]
                context = DatasetContext(train_samples=train, valid_samples=valid, test_samples=test, seed=seed)
                kind = "blend" if blend_weights else "one prefix"
                line = f"{first}/{second} documents, {split}, seed {seed}, seq {seq}, {kind}:"
                for rule in equal:
                    ours = Indexed(data_path=data_path, split=split, split_rule=rule, seq_length=seq)
                    ours.cache_dir = str(args.work / "ours")
                    rows = agreement(
                        ours.provide_datasets(run=types.SimpleNamespace(config=Config()), context=context), theirs
                    )
                    equal[rule] += sum(same for _, same, _ in rows)
                    total += sum(count for _, _, count in rows) if rule == "megatron-core" else 0
                    line += " |" if rule != "megatron-core" else ""
                    line += "".join(f" {name} {same}/{count}" for name, same, count in rows)
                print(line + " (with the legacy rule)")
    core, legacy = equal.values()
    print(f"all: {core} of {total} samples equal; with Megatron-LM's legacy split rule {legacy} of {total}")


if __name__ == "__main__":
    main()
