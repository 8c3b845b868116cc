"""First-party providers: byte text, token files, the GPT model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from coretrain_gpt.model import GPT, GPTConfig
from coretrain_text_bytes import TextBytes, is_valid_file
from coretrain_token_file import TokenFile, open_tokens, write_tokens
from coretrain_windows import TokenWindows, windows

from coretrain.data import BatchReader, SampleOrder
from coretrain.run import DatasetContext

CONTEXT = DatasetContext(train_samples=100, valid_samples=10, test_samples=10, seed=0)


def test_token_windows_batch_fast_path_equals_per_sample() -> None:
    windows = TokenWindows(torch.arange(100), seq_length=8)
    assert len(windows) == 12  # (100 - 1) // 8
    x, y = windows.get_batch(torch.tensor([3, 0, 11]))
    for row, i in enumerate([3, 0, 11]):
        sx, sy = windows[i]
        assert torch.equal(x[row], sx) and torch.equal(y[row], sy)
    assert torch.equal(y[0], x[0] + 1)  # targets are the next tokens
    assert x.is_contiguous() and y.is_contiguous()  # a model's targets.view(-1) (nanoGPT's loss) works


def test_sample_order_is_a_seeded_permutation_per_epoch_and_resumable() -> None:
    order = SampleOrder(10, seed=3)
    stream = order.indices(0, 25)
    assert sorted(stream[:10].tolist()) == list(range(10)) and sorted(stream[10:20].tolist()) == list(range(10))
    assert not torch.equal(stream[:10], stream[10:20])
    assert torch.equal(SampleOrder(10, seed=3).indices(7, 9), stream[7:16])  # position alone resumes


def test_a_dataset_in_training_order_is_read_in_it_epoch_after_epoch() -> None:
    order = SampleOrder(10, seed=3, shuffle=False)  # Datasets.in_order: the provider shuffled it
    assert order.indices(0, 4).tolist() == [0, 1, 2, 3]
    assert order.indices(8, 5).tolist() == [8, 9, 0, 1, 2]


def test_ranks_and_micro_batches_split_a_global_batch_without_changing_it() -> None:
    data = TokenWindows(torch.arange(1000), seq_length=4)
    order = SampleOrder(len(data), seed=1)
    cpu = torch.device("cpu")
    whole = torch.cat([x for x, _ in BatchReader(data, order, 0, 1, cpu).read(16, 8, 8)])
    split = torch.cat([x for rank in (0, 1) for x, _ in BatchReader(data, order, rank, 2, cpu).read(16, 8, 2)])
    assert torch.equal(whole, split)


def test_text_bytes_split_is_by_file_name_and_deterministic(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 20)
    provider = TextBytes(globs=[str(tmp_path / "*.txt")], seq_length=16, valid_fraction=0.25)
    datasets = provider.provide_datasets(run=None, context=CONTEXT)
    valid_names = {p.name for p in tmp_path.glob("*.txt") if is_valid_file(str(p), 0.25)}
    assert 0 < len(valid_names) < 40
    valid_text = bytes(datasets.valid.tokens.tolist()).decode()
    assert all(f"file {name[1:-4]} " in valid_text for name in valid_names)
    assert datasets.vocab_size == 256 and datasets.seq_length == 16
    again = TextBytes(globs=[str(tmp_path / "*.txt")], seq_length=16, valid_fraction=0.25).provide_datasets(
        run=None, context=CONTEXT
    )
    assert torch.equal(again.train.tokens, datasets.train.tokens)


def test_token_file_memory_maps_uint16_and_uint32(tmp_path: Path) -> None:
    for dtype, top in (("uint16", 65535), ("uint32", 70000)):
        path = tmp_path / f"train_{dtype}.bin"
        tokens = [i % (top + 1) for i in range(0, 5000)] + [top]
        write_tokens(str(path), tokens, dtype)
        assert path.stat().st_size == len(tokens) * (2 if dtype == "uint16" else 4)
        assert open_tokens(str(path), dtype)[-1].item() == top
        datasets = TokenFile(train_path=str(path), dtype=dtype, seq_length=10).provide_datasets(
            run=None, context=CONTEXT
        )
        assert datasets.vocab_size == top + 1
        x, y = datasets.train.get_batch(torch.tensor([2]))
        assert x[0].tolist() == tokens[20:30] and y[0].tolist() == tokens[21:31]


def test_token_windows_read_ids_above_the_signed_range_exactly(tmp_path: Path) -> None:
    """GPT-2's ids run to 50,256, past int16's 32,767: a batch gathered from a uint16 file (through
    a signed view of its bytes, which torch 2.9 can index) holds them as they were, and a uint32
    file's past 2**31 too, in fixed and in random windows."""
    for dtype, high in (("uint16", [32768, 50256, 65535, 40000]), ("uint32", [2**31, 2**32 - 1, 70000, 5])):
        path = tmp_path / f"high_{dtype}.bin"
        tokens = (high * 50)[:161]
        write_tokens(str(path), tokens, dtype)
        for sampling in ("windows", "random"):
            split = windows(open_tokens(str(path), dtype), seq_length=8, sampling=sampling, count=20, seed=1)
            x, y = split.get_batch(torch.arange(4))
            for row, (inputs, targets) in enumerate(zip(x, y)):
                start = 8 * row if sampling == "windows" else int(split.starts(torch.tensor([row]))[0])
                assert (
                    inputs.tolist() == tokens[start : start + 8] and targets.tolist() == tokens[start + 1 : start + 9]
                )


@pytest.mark.parametrize("sampling", ["windows", "random"])
def test_a_nanogpt_model_trains_as_it_is_on_the_bin_files_its_prepare_writes(tmp_path: Path, sampling: str) -> None:
    """nanoGPT's train.bin / val.bin (uint16, numpy's ``tofile``) through ``token-file``, into a
    model with nanoGPT's forward: the (logits, loss) tuple is its loss, and its
    ``targets.view(-1)`` gets contiguous targets from the batched fast path."""
    import numpy as np

    from coretrain.testing import run_steps

    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 200, dtype=np.uint8)
    ids = (text - 32).astype(np.uint16)  # a character-level vocabulary, as shakespeare_char's prepare.py
    ids[:8000].tofile(tmp_path / "train.bin")
    ids[8000:].tofile(tmp_path / "val.bin")
    options = {"train_path": str(tmp_path / "train.bin"), "valid_path": str(tmp_path / "val.bin")}
    result = run_steps(
        tmp_path / "run",
        30,
        config={
            "model": {"provider": "workloads:nano_lm", "options": {"vocab_size": 96}},
            "data": {"provider": "token-file", "options": {**options, "seq_length": 32, "sampling": sampling}},
            "train": {"micro_batch_size": 8, "eval_interval": 30, "eval_iters": 2},
            "optimizer": {"lr": 0.02},
        },
    )
    assert result.evals[-1]["valid/loss"] < 0.5 * math.log(96)  # far below uniform: it learnt the text
    if sampling == "random":
        return
    # sample.py's way: prompts through the meta.pkl prepare.py wrote beside train.bin, read as data
    import pickle

    from conftest import run_here

    chars = [chr(32 + i) for i in range(96)]
    meta = {"vocab_size": 96, "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(meta))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "the quick"}\n{"prompt": "lazy"}\n')
    predict = ["predict", str(tmp_path / "run" / "config.toml"), "--data", str(tmp_path / "prompts.jsonl")]
    done = run_here(*predict, "--out", str(tmp_path / "gen.jsonl"), "--max-new-tokens", "5", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    completions = [json.loads(line)["completion"] for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert completions == [" the ", " the "]  # a bigram's: after "k" or "y" a space, after a space most often "t"
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "naïve"}\n')
    unknown = run_here(*predict, "--out", str(tmp_path / "x.jsonl"), cwd=tmp_path)
    assert (
        unknown.returncode == 2 and "meta.pkl: the characters ['ï'] are not in this vocabulary of 96" in unknown.stderr
    )


def test_token_file_with_the_wrong_width_is_a_clear_error(tmp_path: Path) -> None:
    from coretrain.errors import UserError

    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 7)
    with pytest.raises(UserError, match="size 7 is not a multiple of 2 bytes"):
        open_tokens(str(path), "uint16")


def test_gpt_loss_starts_near_uniform_and_flops_follow_the_palm_formula() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False)
    model = GPT(cfg)
    idx, targets = torch.randint(0, 256, (2, 4, 32))
    loss = model(idx, targets)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1
    assert model(idx).shape == (4, 32, 256)
    n = sum(p.numel() for p in model.parameters()) - 32 * 32  # tied head counted once, positions excluded
    assert model.flops_per_token() == 6 * n + 12 * 2 * 32 * 32


def test_random_windows_are_fixed_by_seed_and_index_and_cover_the_text() -> None:
    from coretrain_windows import RandomWindows

    tokens = torch.arange(10_000, dtype=torch.int32)
    a, b, other = (RandomWindows(tokens, 16, 5000, seed) for seed in (1, 1, 2))
    indices = torch.tensor([0, 7, 4999, 7])
    x, y = a.get_batch(indices)
    assert torch.equal(x, b.get_batch(indices)[0]) and not torch.equal(x, other.get_batch(indices)[0])
    assert torch.equal(x[1], x[3]) and torch.equal(y[:, :-1], x[:, 1:])  # same index, same window; shifted
    assert torch.equal(a[7][0], x[1]) and x.is_contiguous() and y.is_contiguous()
    starts = a.starts(torch.arange(5000))
    assert int(starts.min()) >= 0 and int(starts.max()) < 10_000 - 16
    assert len(set(starts.tolist())) > 3800 and starts.float().std() > 2700  # as uniform draws: ~3934, ~2882


def test_a_batch_moves_to_the_device_in_its_own_shape() -> None:
    """Tensors in tuples, lists, namedtuples (a collate_fn's Batch(pixels, labels)) and mappings
    move; the containers keep their types; what is not a tensor stays as it is."""
    from collections import namedtuple

    from coretrain.data import to_device

    pair = namedtuple("pair", ["pixels", "labels"])
    batch = {"a": pair(torch.ones(2), torch.zeros(2)), "b": [torch.ones(1), "text"], "c": (torch.ones(1),)}
    moved = to_device(batch, torch.device("meta"))
    assert type(moved["a"]) is pair and moved["a"].pixels.device.type == "meta" and moved["a"].labels.is_meta
    assert type(moved["b"]) is list and moved["b"][0].is_meta and moved["b"][1] == "text"
    assert type(moved["c"]) is tuple and moved["c"][0].is_meta


def test_dataloaders_a_script_holds_train_as_their_datasets_and_a_batching_of_their_own_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A provider that returns a training script's DataLoaders (an iterable of whole batches, which
    read as a stream ended in "fewer samples than one micro-batch") trains exactly as on their
    datasets, collated by the loaders' collate_fn — also with a DDP script's DistributedSampler,
    whose shuffling and sharding coretrain's order does itself; what of the loaders is not used is
    said once. A choice coretrain's order cannot follow is one error: a WeightedRandomSampler, a
    batch_sampler of the script's (its batches were read as coretrain's, silently) and
    batch_size=None (a dataset whose items are batches)."""
    import logging

    import workloads

    from coretrain import UserError
    from coretrain.testing import run_steps

    model = {"provider": "workloads:cnn", "loss": "cross_entropy"}
    train = {"micro_batch_size": 32, "eval_interval": 10, "eval_iters": 2}
    caplog.set_level(logging.WARNING, logger="coretrain")
    workloads.COLLATED.clear()
    loaders = {"provider": "workloads:digit_loaders", "options": {"batch_size": 64, "collate": True}}
    got = run_steps(tmp_path / "loaders", 20, config={"model": model, "data": loaders, "train": train})
    plain = {"provider": "workloads:digits", "collate_fn": "workloads:as_dict"}
    expected = run_steps(tmp_path / "datasets", 20, config={"model": model, "data": plain, "train": train})
    assert [m["loss"] for m in got.metrics] == [m["loss"] for m in expected.metrics]
    valid = [[e["valid/loss"] for e in run.evals if "valid/loss" in e] for run in (got, expected)]
    assert valid[0] == valid[1] and len(valid[0]) == 2
    assert set(workloads.COLLATED) == {32}  # the loaders' collate_fn, on coretrain's micro-batches
    said = [r.getMessage() for r in caplog.records if "gave DataLoaders" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "not used: train batch_size 64 (micro-batches of 32 here), valid batch_size 64 (micro-batches of 32 here)"
    ), said

    ddp = {**loaders, "options": {"batch_size": 32, "collate": True, "sampler": "distributed"}}
    sharded = run_steps(tmp_path / "ddp", 20, config={"model": model, "data": ddp, "train": train})
    assert [m["loss"] for m in sharded.metrics] == [m["loss"] for m in expected.metrics]

    refused = {
        "weighted": r"a DataLoader whose sampler \(WeightedRandomSampler\) chooses samples its own way",
        "buckets": r"a DataLoader whose batch_sampler \(Buckets\) makes batches its own way, .*; return the dataset",
        "unbatched": r"a DataLoader with batch_size=None, .*; return a dataset of single samples",
    }
    for sampler, said_ in refused.items():
        options = {**loaders, "options": {"sampler": sampler}}
        with pytest.raises(UserError, match=rf"the train split is {said_}"):
            run_steps(tmp_path / sampler, 2, config={"model": model, "data": options, "train": train})
