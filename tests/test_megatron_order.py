"""Megatron-Core's sample order: the k-th sample the training loop feeds from an ``indexed``
2-prefix blend, over 2 epochs of each prefix, on 1 rank, on 2 ranks and across a resume from 1
rank onto 2, is ``train[k]`` of Megatron's ``BlendedDataset`` over its ``GPTDataset``s; the
evaluations read ``valid[k]`` on, block after block, as Megatron's do.

The reference below is Megatron-Core 0.19.2's algorithm written out from its source, function
by function (``gpt_dataset.py``: ``_get_num_epochs``, ``_build_document_index``,
``_build_shuffle_index``, ``_build_document_sample_shuffle_indices``,
``_query_document_sample_shuffle_indices``; ``helpers.cpp``: ``build_sample_idx``,
``build_blending_indices``; ``blended_megatron_dataset_builder.py``: the split bounds and the
per-prefix sizes), independent of the provider's code. (Against Megatron-Core itself, which CI
does not install: ``benchmarks/megatron_order_parity.py``, 33,145 of 33,145 samples equal.)"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import config_file, gpt_preset, in_one_job, run_train
from test_indexed import write_from_spec

SEQ, SEED, STEPS, GLOBAL, EVERY = 16, 1234, 20, 8, 8
WEIGHTS = (0.7, 0.3)  # (0.6/0.4 hides an off-by-one in the blend index; 0.7/0.3 shows it)


def split_bounds(split: str, documents: int) -> list[int]:
    """parse_and_normalize_split, convert_split_vector_to_split_matrix's running sums, and the
    builder's ``int(round(bound * float(num_elements)))``."""
    weights = np.array([float(s) for s in split.split(",")], dtype=np.float64)
    bounds = [0.0]
    for share in (weights / np.sum(weights)).tolist():
        bounds.append(bounds[-1] + share)
    return [int(round(bound * float(documents))) for bound in bounds]


def document_index(documents: np.ndarray, epochs: int, state: np.random.RandomState, separate: bool) -> np.ndarray:
    if not separate or epochs == 1:
        index = np.mgrid[0:epochs, 0 : len(documents)][1]
        index[:] = documents
        index = index.reshape(-1).astype(np.int32)
        state.shuffle(index)
        return index
    first = document_index(documents, epochs - 1, state, False)
    return np.concatenate((first, document_index(documents, 1, state, False)))


def shuffle_index(samples: int, total: int, state: np.random.RandomState) -> np.ndarray:
    first = np.arange(0, samples, dtype=np.uint32)
    state.shuffle(first)
    if samples == total:
        return first
    last = np.arange(samples, total, dtype=np.uint32)
    state.shuffle(last)
    return np.concatenate((first, last))


def sample_index(sizes: np.ndarray, documents: np.ndarray, epochs: int, per_epoch: int) -> list[tuple[int, int]]:
    """helpers.cpp build_sample_idx with add_extra_token_to_sequence = 1, partial sequence dropped."""
    count = (epochs * per_epoch - 1) // SEQ
    index, position, offset = [(0, 0)], 0, 0
    while len(index) <= count:
        remaining = SEQ + 1
        while remaining != 0:
            length = int(sizes[documents[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            elif position == len(documents) - 1:
                offset = int(sizes[documents[position]]) - 1
                break
            else:
                position, offset = position + 1, 0
        index.append((position, offset))
    return index


def gpt_dataset(
    tokens: list[np.ndarray], documents: np.ndarray, samples: int
) -> tuple[Callable[[int], np.ndarray], int]:
    """GPTDataset: sample k's seq_length + 1 tokens, and how many samples (and epochs) it has."""
    sizes = np.array([len(t) for t in tokens])
    per_epoch = int(sizes[documents].sum())
    epochs, covered = 1, per_epoch
    while covered < samples * SEQ + 1:
        epochs, covered = epochs + 1, covered + per_epoch
    separate, sans_final = False, 0
    if epochs > 1:
        sans_final = ((epochs - 1) * per_epoch - 1) // SEQ
        separate = samples - sans_final < int(0.80 * ((per_epoch - 1) // SEQ))
    state = np.random.RandomState(SEED)
    order = document_index(documents, epochs, state, separate)
    starts = sample_index(sizes, order, epochs, per_epoch)
    shuffle = shuffle_index(sans_final if separate else len(starts) - 1, len(starts) - 1, state)

    def sample(k: int) -> np.ndarray:
        (first, begin), (last, end) = starts[shuffle[k]], starts[shuffle[k] + 1]
        if first == last:
            return tokens[order[first]][begin : end + 1]
        middle = [tokens[order[d]] for d in range(first + 1, last)]
        return np.concatenate([tokens[order[first]][begin:], *middle, tokens[order[last]][: end + 1]])

    return sample, epochs


def megatron_blend(
    corpora: list[list[np.ndarray]], split: str, samples: int, part: int
) -> tuple[list[np.ndarray], list[int]]:
    """BlendedDataset over the prefixes' ``part`` split (0 train, 1 valid) sized for ``samples``:
    its samples, and the epochs each prefix's GPTDataset spans."""
    weights = [w / sum(WEIGHTS) for w in WEIGHTS]
    sizes = [int(math.ceil(math.ceil(samples * w) * 1.005)) for w in weights]
    parts = []
    for tokens, size in zip(corpora, sizes, strict=True):
        low, high = split_bounds(split, len(tokens))[part : part + 2]
        parts.append(gpt_dataset(tokens, np.arange(low, high, dtype=np.int32), size))
    taken, blended = [0] * len(weights), []
    for k in range(samples):  # build_blending_indices
        errors = [w * max(k, 1.0) - taken[i] for i, w in enumerate(weights)]
        chosen = errors.index(max(errors))
        blended.append(parts[chosen][0](taken[chosen]))
        taken[chosen] += 1
    return blended, [epochs for _, epochs in parts]


RECORDER = '''
import json
import traceback
from coretrain_indexed import Indexed


class Fed:
    """A split, writing each batch that ``reader`` asks for (its samples' tokens) to a file per
    rank: the loop's BatchReader.read for train, an evaluation's SplitBatches for valid (not the
    probes of the data checks and the FLOPs count)."""

    def __init__(self, data, path, reader):
        self.data, self.path, self.reader = data, path, reader

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]

    def get_batch(self, indices):
        inputs, targets = self.data.get_batch(indices)
        if any(frame.name == self.reader for frame in traceback.extract_stack()):
            rows = [row + [tail] for row, tail in zip(inputs.tolist(), targets[:, -1].tolist())]
            with open(self.path, "a") as file:
                file.write(json.dumps(rows) + "\\n")
        return inputs, targets


def provide(run, context, **options):
    datasets = Indexed(**options).provide_datasets(run=run, context=context)
    datasets.train = Fed(datasets.train, f"{run.output_dir}/fed.rank{run.dist.rank}.jsonl", "read")
    datasets.valid = Fed(datasets.valid, f"{run.output_dir}/valid.rank{run.dist.rank}.jsonl", "_counted")
    return datasets
'''


def fed_rows(out: Path, rank: int, split: str = "fed") -> list[list[int]]:
    """The samples one rank read of a split (``fed``: train), in the order it read them."""
    lines = (out / f"{split}.rank{rank}.jsonl").read_text().splitlines()
    return [row for line in lines for row in json.loads(line)]


def in_consumed_order(blocks: list[list[list[int]]], per_rank: int) -> list[list[int]]:
    """The ranks' samples step by step, rank 0's block of each global batch first."""
    steps = len(blocks[0]) // per_rank
    return [row for s in range(steps) for rows in blocks for row in rows[s * per_rank : (s + 1) * per_rank]]


@pytest.mark.slow  # 2 gloo ranks
def test_the_loop_feeds_megatrons_blended_samples_in_order_on_any_ranks_and_across_a_resume(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    corpora = [
        [np.arange(base + 64 * d, base + 64 * d + int(rng.integers(3, 41)), dtype=np.int64) for d in range(count)]
        for base, count in ((1, 49), (4000, 30))
    ]
    for name, tokens in zip(("web", "code"), corpora, strict=True):
        write_from_spec(tmp_path / name, [t.tolist() for t in tokens])
    (tmp_path / "recorded.py").write_text(RECORDER)
    split = "80,15,5"  # 49 and 30 documents: Megatron-LM's legacy rounding gives 40 train and 28 valid
    assert (split_bounds(split, 49)[1], split_bounds(split, 30)[2]) == (39, 29)
    expected, epochs = megatron_blend(corpora, split, STEPS * GLOBAL, part=0)
    assert min(epochs) >= 2, epochs  # every prefix is read over more than one epoch
    evaluations = STEPS // EVERY + 1  # at 8 and 16, and after training at 20
    expected_valid, _ = megatron_blend(corpora, split, evaluations * GLOBAL, part=1)

    def write(name: str) -> Path:
        preset = gpt_preset(tmp_path / name)
        options = {"data_path": [WEIGHTS[0], str(tmp_path / "web"), WEIGHTS[1], str(tmp_path / "code")]}
        options |= {"split": split, "seq_length": SEQ, "cache_dir": str(tmp_path / "cache")}
        preset["data"] = {"provider": "recorded:provide", "options": options}
        preset["run"] |= {"seed": SEED}
        train = {"micro_batch_size": 2, "global_batch_size": GLOBAL, "train_iters": STEPS}
        train |= {"eval_interval": EVERY, "eval_iters": 1}
        return config_file(tmp_path / f"{name}.toml", preset, **train, log_interval=5)

    one, resumed = write("one"), write("resumed")
    assert run_train(str(one), cwd=tmp_path).returncode == 0
    assert run_train(str(resumed), "--set", "train.exit_interval=8", cwd=tmp_path).returncode == 0
    in_one_job(tmp_path, 2, [["run", str(write("two"))], ["run", str(resumed)]], "two")
    reference = [sample.tolist() for sample in expected]
    assert fed_rows(tmp_path / "one", 0) == reference
    assert in_consumed_order([fed_rows(tmp_path / "two", r) for r in range(2)], GLOBAL // 2) == reference
    first, second = fed_rows(tmp_path / "resumed", 0), fed_rows(tmp_path / "resumed", 1)  # steps 1-8 on one rank
    after = in_consumed_order([first[8 * GLOBAL :], second], GLOBAL // 2)  # 9-20 on two
    assert first[: 8 * GLOBAL] + after == reference
    # each evaluation reads the next global batch of valid, as Megatron's validation iterator does
    valid = [sample.tolist() for sample in expected_valid]
    assert len(valid) == 3 * GLOBAL and fed_rows(tmp_path / "one", 0, "valid") == valid
    assert in_consumed_order([fed_rows(tmp_path / "two", r, "valid") for r in range(2)], GLOBAL // 2) == valid
    first, second = fed_rows(tmp_path / "resumed", 0, "valid"), fed_rows(tmp_path / "resumed", 1, "valid")
    assert first[:GLOBAL] + in_consumed_order([first[GLOBAL:], second], GLOBAL // 2) == valid
