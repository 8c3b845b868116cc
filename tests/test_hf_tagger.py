"""A tagger (token classification: named entities, parts of speech) through the ``hf`` provider's
``task = "token-classification"``: labels aligned with the tokens and never shifted, every
labelled token weighing the same however the batch is cut, texts tagged token by token as
transformers' pipeline tags them, and an export transformers loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import forked_steps, metrics_rows

from coretrain.testing import run_steps, tiny_config, write_config

transformers = pytest.importorskip("transformers")
from test_hf import llama_table, review_data  # noqa: E402  (its reviews, a label per token)


def tagger_run(tmp_path: Path, tokenizer: Path, **train: Any) -> dict[str, Any]:
    """Sections of a run of the ``hf`` provider tagging reviews' tokens (each token of a good
    review is "good"), from a Llama tagger saved to ``tmp_path / "tagger"`` (once; no dropout
    before its head, whose draws would differ between layouts)."""
    if not (tmp_path / "tagger").exists():
        names = {0: "bad", 1: "good"}
        table = llama_table(vocab_size=300, pad_token_id=2, num_labels=2, id2label=names, classifier_dropout=0.0)
        transformers.LlamaForTokenClassification(transformers.LlamaConfig(**table)).save_pretrained(tmp_path / "tagger")
    return {
        "model": {"provider": "hf", "options": {"path": str(tmp_path / "tagger"), "task": "token-classification"}},
        "data": {"provider": "test_hf:review_data", "options": {"tokenizer": str(tokenizer), "token_labels": True}},
        "tokenizer": {"path": str(tokenizer)},
        "optimizer": {"lr": 1e-2},
        "train": {"eval_iters": 0, "log_interval": 1, **train},
    }


def test_every_labelled_token_weighs_the_same_however_the_batch_is_cut(
    tmp_path: Path, padding_tokenizer_dir: Path
) -> None:
    """Reviews of 3 to 10 tokens, padded per micro-batch: 4 micro-batches of 4 train the losses of
    one micro-batch of 16 (a mean of the micro-batches' means would weigh a short review's tokens
    more), and the loss is transformers' own for the labels as they are (not shifted)."""
    from coretrain_hf.columns import Columns
    from coretrain_hf.model import TokenClassifier

    whole = tagger_run(tmp_path, padding_tokenizer_dir, micro_batch_size=16)
    cut = tagger_run(tmp_path, padding_tokenizer_dir, micro_batch_size=4, global_batch_size=16)
    reference = run_steps(tmp_path / "whole", steps=3, config=whole).metrics
    losses = [row["loss"] for row in run_steps(tmp_path / "cut", steps=3, config=cut).metrics]
    assert losses == pytest.approx([row["loss"] for row in reference], rel=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(padding_tokenizer_dir)
    train, _ = review_data(type("Context", (), {"tokenizer": tok}), str(padding_tokenizer_dir), token_labels=True)
    batch = Columns(train, "train", tok).get_batch(torch.arange(8))
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1  # uneven reviews, padded
    hf = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "tagger")
    with torch.no_grad():
        ours = TokenClassifier(hf)(**dict(batch))
        assert ours["num_tokens"] == batch["attention_mask"].sum()
        torch.testing.assert_close(ours["loss"], hf(**batch).loss)


def test_texts_are_tagged_token_by_token_as_transformers_pipeline_tags_them_from_the_export(
    tmp_path: Path, padding_tokenizer_dir: Path, cli: Any
) -> None:
    """``coretrain predict --data`` gives each text's tokens (special tokens and padding left out)
    with a class, its name and probability each: what transformers' ``token-classification``
    pipeline answers with the directory ``checkpoint export --format hf`` wrote."""
    sections = tagger_run(tmp_path, padding_tokenizer_dir)
    result = run_steps(tmp_path, steps=6, config=sections)
    config = write_config(tmp_path / "c.toml", tiny_config(result.output_dir, **sections))
    texts = ["great lovely film", "awful dull plot the", "fine"]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    done = cli("predict", str(config), "--data", "texts.jsonl", "--out", "p.jsonl", "--batch-size", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    done = cli("checkpoint", "export", str(result.output_dir), "--format", "hf", "--to", "exported", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "exported")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    pipeline = transformers.pipeline("token-classification", model=model, tokenizer=tokenizer, ignore_labels=[])
    for record, text in zip(records, texts, strict=True):
        tagged = pipeline(text)
        assert record["tokens"] == [entity["word"] for entity in tagged] and len(record["tokens"]) > 1
        assert record["label"] == [entity["entity"] for entity in tagged]
        assert record["score"] == pytest.approx([float(entity["score"]) for entity in tagged], rel=1e-4)
        assert {*record["label"]} <= {"bad", "good"} and record["prediction"] == [
            {"bad": 0, "good": 1}[label] for label in record["label"]
        ]


@pytest.mark.slow  # 2 forked gloo ranks
def test_on_tensor_parallel_ranks_a_tagger_trains_the_one_rank_losses(
    tmp_path: Path, padding_tokenizer_dir: Path
) -> None:
    """Transformers' plan with sequence parallelism pads each batch's positions to the group's
    multiple; the tagger's classes for the padding are dropped, so on padded reviews of uneven
    lengths 2 tensor-parallel ranks train the one-rank losses."""
    sections = tagger_run(tmp_path, padding_tokenizer_dir, micro_batch_size=8)
    one = run_steps(tmp_path / "one", steps=4, config=sections)
    split = forked_steps(tmp_path / "tp", 2, 4, {**sections, "distributed": {"tp_size": 2}})
    assert "tensor-parallel: 2 ranks per group split 13 plan entries" in split.stderr
    losses = [row["loss"] for row in metrics_rows(tmp_path / "tp" / "out") if "loss" in row]
    assert losses == pytest.approx([row["loss"] for row in one.metrics], rel=1e-5) and len(losses) == 4
