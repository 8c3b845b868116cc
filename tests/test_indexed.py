"""The indexed provider reads Megatron's .bin/.idx as a writer written here from the format's
spec makes them: windows across document boundaries, splits by documents, weighted blends,
cached orders, clear errors, and exact resume of a GPT trained on them."""

from __future__ import annotations

import math
import struct
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coretrain import DatasetContext, UserError
from coretrain.config import Config
from coretrain.testing import run_steps


def write_from_spec(prefix: Path, documents: list[list[int]], code: int = 8, dtype: str = "<u2") -> None:
    """Megatron's MMIDIDX layout, from its description: header, version 1, dtype code, counts,
    int32 lengths, int64 byte pointers, int64 document indices; the tokens back to back."""
    width = np.dtype(dtype).itemsize
    prefix.with_suffix(".bin").write_bytes(b"".join(np.asarray(d, dtype=dtype).tobytes() for d in documents))
    lengths = [len(d) for d in documents]
    pointers = [sum(lengths[:i]) * width for i in range(len(lengths))]
    index = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    index += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(documents) + 1)
    index += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
    index += struct.pack(f"<{len(documents) + 1}q", *range(len(documents) + 1))
    prefix.with_suffix(".idx").write_bytes(index)


def tagged_documents(count: int, first_tag: int = 1, seed: int = 0) -> list[list[int]]:
    """Document d holds only the id first_tag + d, with a length of 3..40 tokens."""
    rng = np.random.default_rng(seed)
    return [[first_tag + d] * int(rng.integers(3, 41)) for d in range(count)]


def provider(tmp_path: Path, **options: Any) -> Any:
    from coretrain_indexed import Indexed

    return Indexed(**{"seq_length": 16, "cache_dir": str(tmp_path / "cache"), **options})


def datasets(tmp_path: Path, train: int = 200, valid: int = 20, test: int = 10, **options: Any) -> Any:
    context = DatasetContext(train_samples=train, valid_samples=valid, test_samples=test, seed=1234)
    run = types.SimpleNamespace(config=Config())  # what the provider reads of the run: its [tokenizer]
    return provider(tmp_path, **options).provide_datasets(run=run, context=context)


def test_windows_run_across_document_boundaries_of_a_shuffled_order(tmp_path: Path) -> None:
    documents = tagged_documents(50)
    write_from_spec(tmp_path / "corpus", documents)
    train = datasets(tmp_path, data_path=str(tmp_path / "corpus"), split="1").train
    stream = np.concatenate([documents[d] for d in train.order])
    epochs = len(train.order) // 50  # as many as 200 samples need, shuffled together (as Megatron does)
    assert epochs > 1 and np.bincount(train.order).tolist() == [epochs] * 50
    assert train.order[:50].tolist() != list(range(50))
    for index in (0, 1, 7, len(train) - 1):
        x, y = train[index]
        start = int(train.shuffle[index]) * 16  # the sample the shuffle index puts at this position
        window = stream[start : start + 17]
        assert x.tolist() == window[:-1].tolist() and y.tolist() == window[1:].tolist()
    assert len(train) >= 200 and len({int(t) for i in range(len(train)) for t in train[i][0]}) == 50
    x, y = train.get_batch(torch.tensor([3, 0]))
    assert torch.equal(x[0], train[3][0]) and torch.equal(y[1], train[0][1])
    assert x.is_contiguous() and y.is_contiguous()  # a model's targets.view(-1) (nanoGPT's loss) works


# Megatron-Core's own ranges (BlendedMegatronDatasetBuilder: parse_and_normalize_split,
# convert_split_vector_to_split_matrix, round(bound * n)), printed by megatron-core itself, at
# corpus sizes where Megatron-LM's legacy rounding gives other ranges; then its train documents.
MEGATRON_CORE_RANGES = [
    ("969,30,1", 49, [(0, 47), (47, 49), (49, 49)], 48),
    ("969,30,1", 520, [(0, 504), (504, 519), (519, 520)], 503),
    ("969,30,1", 1500, [(0, 1454), (1454, 1498), (1498, 1500)], 1453),
    ("80,15,5", 49, [(0, 39), (39, 47), (47, 49)], 40),
    ("98,1,1", 30, [(0, 29), (29, 30), (30, 30)], 30),
    ("969,30,1", 100, [(0, 97), (97, 100), (100, 100)], 97),  # the rules agree
]


@pytest.mark.parametrize(("split", "documents", "expected", "legacy_train"), MEGATRON_CORE_RANGES)
def test_split_by_documents_as_megatron_core_rounds_it_or_as_the_legacy_rule(
    tmp_path: Path, split: str, documents: int, expected: list[tuple[int, int]], legacy_train: int
) -> None:
    write_from_spec(tmp_path / "corpus", tagged_documents(documents))
    built = datasets(tmp_path, data_path=str(tmp_path / "corpus"), split=split)
    for dataset, (low, high) in zip((built.train, built.valid, built.test), expected, strict=True):
        if low == high:
            assert dataset is None
        else:
            assert sorted(set(dataset.order.tolist())) == list(range(low, high))
    legacy = datasets(tmp_path, data_path=str(tmp_path / "corpus"), split=split, split_rule="megatron-lm-legacy")
    assert sorted(set(legacy.train.order.tolist())) == list(range(legacy_train))


def test_a_blend_follows_its_weights_at_every_prefix_of_the_data(tmp_path: Path) -> None:
    write_from_spec(tmp_path / "web", tagged_documents(40, first_tag=1))
    write_from_spec(tmp_path / "code", tagged_documents(40, first_tag=1000, seed=1))
    blend = [0.7, str(tmp_path / "web"), 0.3, str(tmp_path / "code")]
    train = datasets(tmp_path, train=300, data_path=blend, split="1").train
    from_code = np.cumsum([int(train[i][0][0]) >= 1000 for i in range(300)])
    for seen in (10, 100, 300):
        assert abs(from_code[seen - 1] - 0.3 * seen) <= 1
    assert len(train) == 300


def test_separate_paths_per_split_and_the_cached_order_is_reused(tmp_path: Path, monkeypatch: Any) -> None:
    write_from_spec(tmp_path / "train", tagged_documents(30))
    write_from_spec(tmp_path / "valid", tagged_documents(5, first_tag=500))
    paths = {"train_data_path": str(tmp_path / "train"), "valid_data_path": [str(tmp_path / "valid")]}
    first = datasets(tmp_path, **paths)
    assert {int(first.valid[0][0][0])} <= set(range(500, 505)) and first.test is None
    kinds = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir())
    assert kinds == ["order", "order", "shuffle", "shuffle"]

    import coretrain_indexed.samples as samples

    monkeypatch.setattr(samples, "megatron_order", lambda *a: pytest.fail("the cached order was rebuilt"))
    again = datasets(tmp_path, **paths)
    assert np.array_equal(again.train.order, first.train.order)
    assert np.array_equal(again.train.shuffle, first.train.shuffle)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda idx: b"NOTANIDX!" + idx[9:], "not a Megatron indexed dataset index"),
        (lambda idx: idx[:9] + struct.pack("<Q", 2) + idx[17:], "index version 2"),
        (lambda idx: idx[:17] + b"\x09" + idx[18:], "unknown token dtype code 9"),
        (lambda idx: idx[:-12], "truncated"),
    ],
)
def test_a_damaged_index_is_one_clear_error(tmp_path: Path, damage: Any, message: str) -> None:
    write_from_spec(tmp_path / "corpus", tagged_documents(10))
    index = tmp_path / "corpus.idx"
    index.write_bytes(damage(index.read_bytes()))
    with pytest.raises(UserError, match=message):
        datasets(tmp_path, data_path=str(tmp_path / "corpus"))


def test_a_bin_that_does_not_match_its_index_and_a_missing_prefix_are_named(tmp_path: Path) -> None:
    write_from_spec(tmp_path / "corpus", tagged_documents(10))
    (tmp_path / "corpus.bin").write_bytes((tmp_path / "corpus.bin").read_bytes()[:-4])
    with pytest.raises(UserError, match="corpus.bin: does not match"):
        datasets(tmp_path, data_path=str(tmp_path / "corpus"))
    with pytest.raises(UserError, match=r"missing\.idx not found.*prefix"):
        datasets(tmp_path, data_path=str(tmp_path / "missing"))


def test_a_cached_order_that_does_not_fit_its_split_is_named_with_the_file_to_delete(tmp_path: Path) -> None:
    """A train order replaced by the valid split's (both are order-*.npy): training on it read the
    validation documents, rc 0. Checked for dtype, length, range and membership, it is refused."""
    write_from_spec(tmp_path / "corpus", tagged_documents(40))
    options = {"data_path": str(tmp_path / "corpus"), "split": "8,2"}
    built = datasets(tmp_path, **options)
    files = {
        name: next(p for p in (tmp_path / "cache").iterdir() if np.array_equal(np.load(p), getattr(built, name).order))
        for name in ("train", "valid")
    }
    valid_order = files["valid"].read_bytes()
    as_long = np.resize(built.valid.order, len(built.train.order))  # validation ids, at the train order's length
    twice = built.train.order.copy()
    twice[0] = twice[1]  # one document twice, another missing: same length, range and dtype
    for damage, detail in (
        (valid_order, "not int32"),
        (as_long, "outside this split's"),
        (b"not an array", "unreadable"),
        (twice, "not each of this split's documents"),
    ):
        if isinstance(damage, bytes):
            files["train"].write_bytes(damage)
        else:
            np.save(files["train"], damage)
        with pytest.raises(
            UserError,
            match=rf"{files['train'].name}: a cached sample order that does not fit this data \(.*{detail}.*delete it",
        ):
            datasets(tmp_path, **options)
    files["train"].unlink()
    assert np.array_equal(datasets(tmp_path, **options).train.order, built.train.order)  # rebuilt as before


def test_a_corrupt_corpus_is_one_error_naming_the_file(tmp_path: Path) -> None:
    write_from_spec(tmp_path / "odd", tagged_documents(10))
    (tmp_path / "odd.bin").write_bytes((tmp_path / "odd.bin").read_bytes() + b"\x00")
    with pytest.raises(UserError, match=r"odd\.bin: \d+ bytes, not a whole number of uint16 tokens"):
        datasets(tmp_path, data_path=str(tmp_path / "odd"))
    write_from_spec(tmp_path / "negative", [[5, 6, -3, 7], [1, 2, 3]], code=3, dtype="<i2")
    with pytest.raises(UserError, match=r"negative\.bin: token id -3 .*token ids are >= 0"):
        datasets(tmp_path, data_path=str(tmp_path / "negative"))
    write_from_spec(tmp_path / "floats", [[5.0, 6.5], [1.0, 2.0]], code=6, dtype="<f8")
    with pytest.raises(UserError, match=r"floats\.idx: its tokens are float64; token ids are integers"):
        datasets(tmp_path, data_path=str(tmp_path / "floats"))
    write_from_spec(tmp_path / "lengths", tagged_documents(10))
    index = bytearray((tmp_path / "lengths.idx").read_bytes())
    index[34:38] = struct.pack("<i", -5)  # the first sequence's length
    (tmp_path / "lengths.idx").write_bytes(bytes(index))
    with pytest.raises(UserError, match=r"lengths\.idx: negative sequence lengths"):
        datasets(tmp_path, data_path=str(tmp_path / "lengths"))
    write_from_spec(tmp_path / "ok", tagged_documents(10))
    words = "data.options.vocab_size: the vocabulary has 5 tokens, but the data holds token id 10; set data"
    with pytest.raises(UserError, match=words):
        datasets(tmp_path, data_path=str(tmp_path / "ok"), vocab_size=5)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"data_path": [math.inf, "a", 1.0, "b"]}, "data_path"),
        ({"data_path": [1e308, "a", 1e308, "b"]}, "data_path"),
        ({"data_path": "a", "split": "inf,1,1"}, "split"),
        ({"data_path": "a", "split": "1e308,1e308,1"}, "split"),
        ({"data_path": "a", "split": "nan,1"}, "split"),
    ],
)
def test_infinite_weights_and_splits_are_a_config_error_naming_the_key(
    tmp_path: Path, options: dict[str, Any], key: str
) -> None:
    with pytest.raises(UserError, match=rf"data\.options\.{key}: .*finite"):
        run_steps(tmp_path, 2, config={"data": {"provider": "indexed", "options": options}})


@pytest.mark.parametrize("bad", [[0.5, "a", "b"], ["a", 0.5], [-1, "a"], [], 3])
def test_a_malformed_data_path_is_a_config_error_naming_the_key(tmp_path: Path, bad: Any) -> None:
    data = {"provider": "indexed", "options": {"data_path": bad}}
    with pytest.raises(UserError, match=r"data\.options\.data_path.*weight, prefix"):
        run_steps(tmp_path, 2, config={"data": data})


def gpt_on_indexed(tmp_path: Path, **train: Any) -> dict[str, Any]:
    return {
        "model": {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "data": {"provider": "indexed", "options": {"data_path": [0.6, str(tmp_path / "a"), 0.4, str(tmp_path / "b")]}},
        "train": {"micro_batch_size": 4, "train_samples": 34, "log_interval": 1, "eval_iters": 1, **train},
        "scheduler": {"decay_style": "WSD", "wsd_decay_iters": 3, "warmup_iters": 2},
        "checkpoint": {"save_interval": 3},
    }


def test_a_gpt_trains_on_a_blend_by_samples_with_wsd_and_resumes_exactly(tmp_path: Path) -> None:
    write_from_spec(tmp_path / "a", [[i % 50 for i in range(d, d + 60)] for d in range(40)])
    write_from_spec(tmp_path / "b", [[50 + i % 30 for i in range(d, d + 45)] for d in range(40)])
    (tmp_path / "whole").mkdir()
    whole = run_steps(tmp_path / "whole", 8, config=gpt_on_indexed(tmp_path))
    run_steps(tmp_path / "split", 8, config=gpt_on_indexed(tmp_path, exit_interval=3))
    resumed = run_steps(tmp_path / "split", 8, config=gpt_on_indexed(tmp_path))
    assert [r["loss"] for r in resumed.metrics] == [r["loss"] for r in whole.metrics if r["step"] > 3]
    assert whole.metrics[-1]["loss"] < whole.metrics[0]["loss"]
    assert whole.run.train_iters == 8 and whole.run.state.consumed_samples == 32  # 34 samples: 8 whole batches
    assert resumed.run.state.consumed_samples == 32
    assert [round(m["lr"], 6) for m in whole.metrics[1:5]] == [0.01] * 4  # WSD: stable after warmup


def test_mock_data_needs_no_files_and_is_fixed_by_seed_and_index(tmp_path: Path) -> None:
    from coretrain_indexed.mock import Mock

    context = DatasetContext(train_samples=64, valid_samples=8, test_samples=0, seed=3)
    built = Mock(seq_length=8, vocab_size=100).provide_datasets(run=None, context=context)
    again = Mock(seq_length=8, vocab_size=100).provide_datasets(run=None, context=context)
    assert len(built.train) == 64 and torch.equal(built.train[5][0], again.train[5][0])
    assert not torch.equal(built.train[5][0], built.train[6][0]) and int(built.train[5][0].max()) < 100
    mock = {"provider": "mock", "options": {"seq_length": 16, "vocab_size": 64}}
    gpt = {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16}}
    result = run_steps(tmp_path, 4, config={"model": gpt, "data": mock, "train": {"micro_batch_size": 4}})
    assert result.exit_code == 0 and result.run.datasets.vocab_size == 64


def test_the_plugins_writer_makes_the_bytes_the_spec_describes(tmp_path: Path) -> None:
    from coretrain_indexed.format import write_indexed

    documents = tagged_documents(7)
    write_from_spec(tmp_path / "spec", documents)
    write_indexed(str(tmp_path / "ours"), documents)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"spec{suffix}").read_bytes()
