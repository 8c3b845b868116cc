"""Several validation sets by name, the shapes a data provider may return its splits in, and metrics of
a whole split (``compute_metrics``)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import metrics_rows

from coretrain import UserError
from coretrain.testing import run_steps


def digits_run(tmp_path: Path, provider: str, steps: int = 6, **more: Any) -> Any:
    config = {
        "model": {"provider": "workloads:cnn_with_accuracy"},
        "data": {"provider": f"workloads:{provider}", "options": more.pop("options", {})},
        "train": {"eval_interval": 3, "eval_iters": 2},
        **more.pop("config", {}),
    }
    return run_steps(tmp_path, steps, config=config, **more)


def test_two_named_validation_sets_are_evaluated_and_logged_apart(tmp_path: Path) -> None:
    """Each set reports its own loss and named values, equal to what it reports alone; the
    metrics file has them, and early stopping and keep-best can watch any of them."""
    named = digits_run(
        tmp_path / "named",
        "digits_named_valid",
        autoload=True,
        tables={"early-stopping": {"metric": "valid/noisy/accuracy", "mode": "max", "patience": 10}},
        config={"plugins": {"keep-best": {"metric": "valid/clean/loss"}}},
    )
    alone = digits_run(tmp_path / "alone", "digits_clean_valid")
    assert [e["step"] for e in named.evals] == [3, 6]
    for both, one in zip(named.evals, alone.evals):
        assert set(both) == {
            "step",
            "valid/clean/loss",
            "valid/clean/accuracy",
            "valid/noisy/loss",
            "valid/noisy/accuracy",
        }
        assert both["valid/clean/loss"] == pytest.approx(one["valid/loss"], rel=1e-6)
        assert both["valid/clean/accuracy"] == one["valid/accuracy"]
        assert both["valid/noisy/loss"] != both["valid/clean/loss"]
    rows = [r for r in metrics_rows(named.output_dir) if "valid/noisy/loss" in r]
    assert [r["step"] for r in rows] == [3, 6]
    assert (named.output_dir / "checkpoints" / "best").is_symlink()


@pytest.mark.parametrize(
    ("names", "message"),
    [((), "Datasets.valid is an empty dict"), (("a/b",), "the set name 'a/b' is not a simple name")],
)
def test_a_bad_set_of_validation_sets_is_one_clear_error(tmp_path: Path, names: tuple[str, ...], message: str) -> None:
    with pytest.raises(UserError, match=message):
        digits_run(tmp_path, "digits_named_valid", options={"names": list(names)})


def test_an_eval_interval_over_data_without_a_validation_split_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config that validates every 3 steps and a provider that makes no valid split (an
    ``indexed`` split whose valid share rounds to no document did this silently): one warning
    naming the key and the provider; with a valid split, none."""
    caplog.set_level(logging.WARNING, logger="coretrain")
    result = digits_run(tmp_path / "none", "digits_train_only")
    said = [r.getMessage() for r in caplog.records if "gave no validation split" in r.getMessage()]
    assert said == [
        "train.eval_interval = 3, but data.provider 'workloads:digits_train_only' gave no validation split: "
        "nothing is evaluated during training (give the data a valid split, or unset train.eval_interval)"
    ]
    assert result.evals == []
    caplog.clear()
    assert digits_run(tmp_path / "valid", "digits_clean_valid").evals
    assert not [r for r in caplog.records if "gave no validation split" in r.getMessage()]
    # datasets' train_test_split: {"train", "test"}, its held-out part evaluated only at the end
    digits_run(tmp_path / "split", "digits_by_split_name", options={"names": ["train", "test"]})
    said = [r.getMessage() for r in caplog.records if "gave no validation split" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "(its test split is evaluated once, at the end; to evaluate it during training, return it as the "
        "validation split: {'train': splits['train'], 'validation': splits['test']})"
    ), said


def test_random_splits_list_is_train_and_valid(tmp_path: Path) -> None:
    """random_split returns a list; it is read as (train, valid), not as a dataset of 2 samples."""
    result = digits_run(tmp_path, "digits_random_split")
    assert result.run.datasets.valid is not None and len(result.run.datasets.train) == 1200
    assert "valid/accuracy" in result.evals[0]


def test_a_dataset_dict_is_the_splits_by_their_names(tmp_path: Path) -> None:
    """load_dataset's DatasetDict (train, validation, test) is the run's three splits; a dict
    with a name that is not a split is one error listing its names."""
    result = digits_run(tmp_path, "digits_by_split_name")
    lengths = [len(result.run.datasets.sets(split)[0][1]) for split in ("train", "valid", "test")]
    assert lengths == [600, 400, 200] and "valid/accuracy" in result.evals[0] and "test/accuracy" in result.evals[-1]
    with pytest.raises(UserError, match=r"the train split is a dict \(\['train', 'unsupervised'\]\); return one of"):
        digits_run(tmp_path / "imdb", "digits_by_split_name", options={"names": ["train", "unsupervised"]})


def test_a_list_of_datasets_is_splits_and_a_list_of_samples_is_one_dataset() -> None:
    import numpy as np
    import torch

    from coretrain.build import splits_list

    class Sized:  # a Hugging Face dataset, or any indexable object of a library's own
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> int:
            return index

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(3))

    assert splits_list([Sized(), Sized()]) and splits_list([Stream(), Stream(), Stream()])
    assert splits_list(list(torch.utils.data.random_split(range(10), [0.8, 0.2])))
    for samples in ([torch.ones(2), torch.zeros(2)], [np.ones(2), np.ones(2)], [(1, 2), (3, 4)], [{"x": 1}, {"x": 2}]):
        assert not splits_list(samples)
    assert not splits_list([Sized()]) and not splits_list([Sized()] * 4)


def test_report_shows_every_evaluated_metric_and_small_rates(tmp_path: Path, cli: Any) -> None:
    """The summary lists valid/accuracy, each named set and the model's train/ values, gives a
    tiny model's TFLOP/s in significant digits, and the loss plot draws each set."""
    result = digits_run(
        tmp_path,
        "digits_named_valid",
        autoload=True,
        config={"train": {"log_interval": 3, "eval_interval": 3, "eval_iters": 2}},
    )
    shown = cli("report", str(result.output_dir), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    last = [e for e in result.evals if e["step"] == 6][0]
    for name in ("valid/clean/loss", "valid/clean/accuracy", "valid/noisy/loss", "valid/noisy/accuracy"):
        value = f"{last[name]:.4f}" if name.endswith("loss") else f"{last[name]:.4g}"
        assert f"{name}" in shown.stdout and f"last {value} at step 6" in shown.stdout
    assert "train/accuracy" in shown.stdout
    tflops = [line for line in shown.stdout.splitlines() if "TFLOP/s per device" in line][0]
    assert float(tflops.split("│")[-2]) > 0  # "0.00" before
    assert "2 validation" in shown.stdout


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_every_rank_runs_as_many_forwards_in_a_full_evaluation(micro: int) -> None:
    """A sharded or expert-parallel forward is a collective: a rank with one micro-batch more than
    another waited forever (seen: 361 samples, 2 expert-parallel ranks, micro-batch 1). The
    shorter shares end on sample 0 again, run and not counted; every sample counts once."""
    from types import SimpleNamespace

    from coretrain_evaluation import UNCOUNTED, index_chunks

    shares = []
    for rank in range(2):
        train = SimpleNamespace(eval_full=True, eval_micro_batch_size=None, micro_batch_size=micro)
        run = SimpleNamespace(config=SimpleNamespace(train=train), dist=SimpleNamespace(dp_rank=rank, dp_size=2))
        shares.append(index_chunks(run, 361))  # type: ignore[arg-type]
    assert len(shares[0]) == len(shares[1])
    counted = [chunk for share in shares for chunk in share if chunk is not UNCOUNTED]
    assert sorted(torch.cat(counted).tolist()) == list(range(361))
    assert sum(chunk is UNCOUNTED for chunk in shares[1]) == 1  # 181 samples against 180


@pytest.mark.parametrize(
    "model", [{"provider": "workloads:cnn", "loss": "cross_entropy"}, {"provider": "workloads:tuple_cnn"}]
)
def test_compute_metrics_sees_every_sample_of_the_split_once_in_order(tmp_path: Path, model: dict[str, str]) -> None:
    """As the HF Trainer's compute_metrics: the model's logits and the labels of the whole split
    (359 valid samples in micro-batches of 64, 201 test), logged as valid/NAME; its accuracy is the
    per-batch mean's, its macro F1 the one of the model's logits over the split by hand."""
    from workloads import Digits, corpus_metrics

    result = run_steps(
        tmp_path,
        6,
        config={
            "model": model,
            "data": {"provider": "workloads:digits"},
            "train": {"eval_full": True, "eval_micro_batch_size": 64, "eval_interval": 3},
        },
        tables={"evaluation": {"compute_metrics": "workloads:corpus_metrics"}},
    )
    valid, test = Digits(359, 2), Digits(201, 3)
    evals = [e for e in result.evals if "valid/loss" in e]
    assert [e["step"] for e in evals] == [3, 6]
    for split, data in (("valid", valid), ("test", test)):
        logged = [e for e in result.evals if f"{split}/loss" in e][-1]
        assert logged[f"{split}/samples"] == len(data)
        assert logged[f"{split}/order"] == float((data.labels * torch.arange(len(data))).sum())
    model_now = result.run.model.eval()
    with torch.no_grad():
        outputs = model_now(valid.images)
    logits = outputs[0] if isinstance(outputs, tuple) else outputs
    by_hand = corpus_metrics(logits, valid.labels)
    logged = evals[-1]
    assert logged["valid/macro_f1"] == pytest.approx(by_hand["macro_f1"], rel=1e-6)
    assert logged["valid/acc"] == pytest.approx(float(by_hand["acc"]), rel=1e-6)
    if "valid/accuracy" in logged:  # model.loss = cross_entropy: its per-batch mean over samples
        assert logged["valid/acc"] == pytest.approx(logged["valid/accuracy"], rel=1e-6)


@pytest.mark.parametrize("transformers_imported", [False, True])
def test_a_compute_metrics_written_for_the_trainer_gets_an_eval_prediction_of_numpy_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transformers_imported: bool
) -> None:
    """The Hugging Face course's ``compute_metrics(eval_pred)``: ``logits, labels = eval_pred``,
    numpy's argmax, ``eval_pred.label_ids``; transformers' own ``EvalPrediction`` when it is imported."""
    import sys

    import numpy as np
    import workloads

    if transformers_imported:
        import transformers
    else:
        monkeypatch.delitem(sys.modules, "transformers", raising=False)
    workloads.HANDED.clear()
    result = run_steps(
        tmp_path,
        6,
        config={
            "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
            "data": {"provider": "workloads:digits"},
            "train": {"eval_full": True, "eval_interval": 6},
        },
        tables={"evaluation": {"compute_metrics": "workloads:trainer_metrics"}},
    )
    logged = [e for e in result.evals if "valid/loss" in e][-1]
    assert logged["valid/labels_seen"] == 359
    assert logged["valid/trainer_accuracy"] == pytest.approx(logged["valid/accuracy"], rel=1e-6)
    handed = workloads.HANDED[0]
    assert isinstance(handed.predictions, np.ndarray) and handed.predictions.shape == (359, 10)
    assert isinstance(handed.label_ids, np.ndarray) and handed.label_ids.dtype == np.int64
    if transformers_imported:
        assert isinstance(handed, transformers.EvalPrediction)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("workloads:no_such_metrics", "plugins.evaluation.compute_metrics: cannot import 'workloads:no_such_metrics'"),
        ("workloads", "'workloads' is not an import path; expected 'package.module:function'"),
        ("workloads:CLASSES", "plugins.evaluation.compute_metrics: 'workloads:CLASSES' is not callable"),
        ("workloads:one_number", "plugins.evaluation.compute_metrics: returned a float; return a dict of metrics by"),
        ("workloads:words_for_metrics", "plugins.evaluation.compute_metrics: 'f1' is a str, not a number"),
    ],
)
def test_a_compute_metrics_that_does_not_import_or_answer_is_one_error(tmp_path: Path, path: str, words: str) -> None:
    config = {
        "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
        "data": {"provider": "workloads:digits"},
        "train": {"eval_iters": 1},
    }
    with pytest.raises(UserError, match=re.escape(words)):
        run_steps(tmp_path, 2, config=config, tables={"evaluation": {"compute_metrics": path}})


def test_batches_of_other_lengths_are_joined_padded_with_minus_100() -> None:
    """As the HF Trainer joins its evaluation batches: each padded to the longest, on every dimension."""
    from coretrain_evaluation.corpus import concatenated

    a, b = torch.ones(2, 3, dtype=torch.long), torch.full((1, 5), 2)
    joined = concatenated([a, b])
    assert joined.tolist() == [[1, 1, 1, -100, -100], [1, 1, 1, -100, -100], [2, 2, 2, 2, 2]]
    logits = concatenated([torch.zeros(1, 2, 4), torch.zeros(2, 3, 4)])
    assert logits.shape == (3, 3, 4) and bool((logits[0, 2] == -100).all()) and bool((logits[1:] == 0).all())


class ForwardInParts:
    """A plugin that runs the evaluation's forward itself, as pipeline parallelism's stages do."""

    from coretrain import hookimpl

    @hookimpl
    def forward_batch(self) -> None:
        return None


def test_compute_metrics_with_outputs_split_over_ranks_is_refused_before_training(tmp_path: Path) -> None:
    """Pipeline stages (a forward_batch plugin) or context parallelism hold no sample's whole
    outputs: refused on every rank alike, before the first step, not at an evaluation."""
    config = {"model": {"provider": "workloads:cnn", "loss": "cross_entropy"}, "data": {"provider": "workloads:digits"}}
    with pytest.raises(UserError, match="compute_metrics: each sample's outputs are split over ranks") as caught:
        run_steps(
            tmp_path,
            2,
            config=config,
            plugins={"parts": ForwardInParts()},
            tables={"evaluation": {"compute_metrics": "workloads:corpus_metrics"}},
        )
    assert "evaluate without it" in str(caught.value)


def test_predictions_and_labels_that_are_not_tensors_are_put_in_sample_order_alike() -> None:
    """Samples read as 2, 0 then 1 (text labels, a list): both back in the order of the split."""
    import types

    from coretrain_evaluation.corpus import Collected

    collected = Collected(torch.nn.Identity(), lambda predictions, labels: {})
    collected.start()
    for index, label in ((2, "c"), (0, "a"), (1, "b")):
        collected.outputs = [torch.tensor([[float(index)]])]
        collected.add({"x": torch.zeros(1), "labels": [label]}, torch.tensor([index]), counted=True)
    run = types.SimpleNamespace(reports_loss=True, dist=types.SimpleNamespace(world_size=1, dp_rank=0))
    predictions, labels = collected.gathered(run)  # type: ignore[arg-type]
    assert predictions.flatten().tolist() == [0.0, 1.0, 2.0] and labels == ["a", "b", "c"]
    collected.close()
