"""Does the ``indexed`` provider hand out Megatron-Core's samples, in Megatron's order? Checked
against Megatron-Core's own ``GPTDataset`` and ``BlendedDataset``, built by its own
``BlendedMegatronDatasetBuilder``, on the same files.

    pip download --no-deps --ignore-requires-python megatron-core==0.19.2 -d /tmp/mcore
    unzip -q /tmp/mcore/megatron_core-*.whl -d /tmp/mcore/x
    python benchmarks/megatron_order_parity.py --megatron /tmp/mcore/x --work /tmp/order

Megatron-Core's package ``__init__`` imports Transformer Engine and Triton, so it is bypassed:
``megatron.core`` is made a bare package over the wheel's directory, and the four modules the
datasets import from outside ``megatron.core.datasets`` are stood in for (a logging helper,
the tokenizer base class, ``safe_numpy_load`` as ``numpy.load``). Its compiled ``helpers``
(``build_sample_idx``, ``build_blending_indices``) are the wheel's own. Two prefixes of
documents with distinct token ids are written; for one prefix and a blend of both, and for
each (seed, seq_length, train samples) setting, every sample of train, valid and test is
compared token for token with coretrain's ``train[k]``, ``valid[k]``, ``test[k]``.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

SETTINGS = [(1234, 16, 200, 40, 20, (0.7, 0.3)), (7, 8, 3000, 300, 30, (0.5, 0.5)), (1, 32, 50, 10, 10, (0.2, 0.8))]
"""(seed, seq_length, train, valid and test samples, blend weights)."""
SPLIT = "90,8,2"


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
    """Megatron's MMIDIDX .bin/.idx of ``documents`` documents, each of distinct ids, 3-40 long."""
    import struct

    rng = np.random.default_rng(seed)
    docs = [np.arange(first + 64 * d, first + 64 * d + int(rng.integers(3, 41)), dtype="<u2") for d in range(documents)]
    prefix.with_suffix(".bin").write_bytes(b"".join(d.tobytes() for d in docs))
    lengths = [len(d) for d in docs]
    pointers = [2 * sum(lengths[:i]) for i in range(len(lengths))]
    index = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    index += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(docs) + 1)
    index += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
    index += struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1))
    prefix.with_suffix(".idx").write_bytes(index)


def window(sample: Any) -> list[int]:
    """A sample's seq_length + 1 tokens: Megatron's tokens and last label, or coretrain's (x, y)."""
    if isinstance(sample, dict):
        return [*sample["tokens"].tolist(), int(sample["labels"][-1])]
    return [*sample[0].tolist(), int(sample[1][-1])]


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
    prefixes = [str(args.work / "web"), str(args.work / "code")]
    write_prefix(Path(prefixes[0]), 40, 1, 0)
    write_prefix(Path(prefixes[1]), 60, 3000, 1)
    equal = total = 0
    for seed, seq, train, valid, test, weights in SETTINGS:
        for blend in ([prefixes[0]], prefixes):
            blend_weights = list(weights) if len(blend) > 1 else None
            data_path = [x for w, p in zip(blend_weights or [1.0], blend, strict=True) for x in (w, p)]
            context = DatasetContext(train_samples=train, valid_samples=valid, test_samples=test, seed=seed)
            ours = Indexed(data_path=data_path, split=SPLIT, seq_length=seq, cache_dir=str(args.work / "ours"))
            mine = ours.provide_datasets(run=types.SimpleNamespace(config=Config()), context=context)
            config = dataset_config(
                random_seed=seed, sequence_length=seq, blend=(blend, blend_weights), split=SPLIT,
                tokenizer=Tokenizer(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                path_to_cache=str(args.work / "megatron"), mid_level_dataset_surplus=0.005,
            )  # fmt: skip
            theirs = builder(dataset, [train, valid, test], lambda: True, config).build()
            for name, a, b in zip(("train", "valid", "test"), (mine.train, mine.valid, mine.test), theirs, strict=True):
                same = sum(window(a[k]) == window(b[k]) for k in range(len(b)))
                equal, total = equal + same, total + len(b)
                kind = "blend" if blend_weights else "one prefix"
                print(f"seed {seed}, seq {seq}, {kind}, {name}: {same} of {len(b)} equal (lengths {len(a)}, {len(b)})")
    print(f"all: {equal} of {total} samples equal")


if __name__ == "__main__":
    main()
