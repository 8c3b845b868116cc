"""Hugging Face workloads beyond a causal LM and a text classifier, through the ``hf`` provider
and a provider of the user's.

A tagger (token classification: named entities, parts of speech) through ``task =
"token-classification"``: labels aligned with the tokens and never shifted, every labelled token
weighing the same however the batch is cut, texts tagged token by token as transformers'
pipeline tags them, and an export transformers loads. A sequence classifier of several labels
or of a score, on transformers' own loss. An image classifier on the image-classification
guide's transformed split, exported for the pipeline."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import forked_steps, metrics_rows, predict_texts

from coretrain.testing import run_steps, tiny_config, write_config

transformers = pytest.importorskip("transformers")
from test_hf import llama_table, review_data  # noqa: E402  (its reviews, a label per token)

sys.modules.setdefault("test_hf_tasks", sys.modules[__name__])  # its providers, by this name


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
    done, records = predict_texts(config, texts, tmp_path, "--batch-size", "2")
    assert done.returncode == 0, done.stderr
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


def streamed_reviews(context: Any, tokenizer: str) -> Any:
    """The tagger's reviews, the train split as a stream (``to_iterable_dataset()``: read row by row)."""
    train, valid = review_data(context, tokenizer, token_labels=True)
    return train.to_iterable_dataset(), valid


def test_a_stream_of_uneven_token_rows_is_padded_as_its_map_style_split(
    tmp_path: Path, padding_tokenizer_dir: Path
) -> None:
    """The same reviews as a Hugging Face stream: its rows are padded per micro-batch with the
    run's tokenizer, labels with -100, as the map-style split's batches are (it was "the samples
    of a micro-batch hold tensors of different lengths, which the default collate cannot
    stack"); the first step's loss is the tagger's on the first 8 reviews padded so."""
    from coretrain_hf.columns import Columns
    from coretrain_hf.model import TokenClassifier

    sections = tagger_run(tmp_path, padding_tokenizer_dir, micro_batch_size=8)
    sections["data"] = {
        "provider": "test_hf_tasks:streamed_reviews",
        "options": {"tokenizer": str(padding_tokenizer_dir)},
    }
    losses = [row["loss"] for row in run_steps(tmp_path, steps=2, config=sections).metrics]
    tok = transformers.AutoTokenizer.from_pretrained(padding_tokenizer_dir)
    train, _ = review_data(type("Context", (), {"tokenizer": tok}), str(padding_tokenizer_dir), token_labels=True)
    first = Columns(train, "train", tok).get_batch(torch.arange(8))
    hf = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "tagger")
    with torch.no_grad():
        assert losses[0] == pytest.approx(TokenClassifier(hf)(**first)["loss"].item(), rel=1e-5)


def image_classifier(path: str) -> Any:
    """A model provider of a user's own: an image classifier as ``from_pretrained`` gives it."""
    return transformers.AutoModelForImageClassification.from_pretrained(path, local_files_only=True)


def squares(context: Any, processor: str) -> Any:
    """Images as the Hugging Face image-classification guide prepares them: a ``datasets`` Image
    column turned into ``pixel_values`` by a transform (``with_transform``) that gives a list of
    tensors, the class in ``label`` a list of ints. Class 1 has a white square."""
    import datasets
    import numpy as np
    from PIL import Image

    draw = np.random.default_rng(0)
    pixels = draw.integers(0, 80, (120, 32, 32, 3), dtype=np.uint8)
    pixels[1::2, 8:24, 8:24] = 255
    table = {"image": [Image.fromarray(image) for image in pixels], "label": [i % 2 for i in range(120)]}
    images = datasets.Dataset.from_dict(table).cast_column("image", datasets.Image())
    prepare = transformers.AutoImageProcessor.from_pretrained(processor)

    def transform(examples: dict[str, Any]) -> dict[str, Any]:
        examples["pixel_values"] = [
            prepare(image.convert("RGB"), return_tensors="pt")["pixel_values"][0] for image in examples["image"]
        ]
        del examples["image"]
        return examples

    images = images.with_transform(transform)
    return images.select(range(96)), images.select(range(96, 120))


def test_an_image_classifier_reads_its_transformed_images_and_exports_what_the_pipeline_loads(
    tmp_path: Path, cli: Any
) -> None:
    """A ViT from a provider of the user's on a split with the guide's transform: its lists of
    pixel tensors and of class ints reach the model stacked, as ``default_data_collator`` makes
    them (it was "'list' object has no attribute 'dtype'" in the model's loss); the export carries
    the image processor, so transformers' ``image-classification`` pipeline loads the directory
    and classifies the images as ``coretrain predict`` did."""
    from coretrain.testing import BEHAVIOUR

    names = {0: "plain", 1: "square"}
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
        id2label=names,
    )
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "vit")
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "vit")
    sections = {
        "model": {"provider": "test_hf_tasks:image_classifier", "options": {"path": str(tmp_path / "vit")}},
        "data": {"provider": "test_hf_tasks:squares", "options": {"processor": str(tmp_path / "vit")}},
        "optimizer": {"lr": 1e-2},
        "train": {"micro_batch_size": 16, "eval_iters": 0},
    }
    result = run_steps(tmp_path, steps=24, config=sections, autoload=(*BEHAVIOUR, "transformers-models"))
    run_config = write_config(tmp_path / "c.toml", tiny_config(result.output_dir, **sections))
    done = cli("predict", str(run_config), "--split", "valid", "--out", "p.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [record["target"] for record in records] == [i % 2 for i in range(96, 120)]
    assert [record["prediction"] for record in records] == [record["target"] for record in records]  # it learnt
    done = cli("checkpoint", "export", str(result.output_dir), "--format", "hf", "--to", "exported", cwd=tmp_path)
    assert done.returncode == 0 and "preprocessor_config.json copied from" in done.stdout, done.stderr
    classify = transformers.pipeline("image-classification", model=str(tmp_path / "exported"))
    _, valid = squares(None, str(tmp_path / "vit"))
    images = valid.with_format(None)["image"]
    assert [classify(image)[0]["label"] for image in images] == [names[r["prediction"]] for r in records]


def scored_reviews(context: Any, tokenizer: str) -> Any:
    """The reviews with a score instead of a class (2.0 for a good one, 0.0 for a bad one), as
    for a regression (STS-B's similarity)."""
    train, valid = review_data(context, tokenizer)
    return tuple(split.map(lambda r: {"label": 2.0 * r["label"]}) for split in (train, valid))


PROBLEMS = {  # num_labels, labels of 4 samples
    "single_label_classification": (3, [0, 2, 1, 1]),
    "multi_label_classification": (3, [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
    "regression": (1, [0.3, 1.7, 2.2, 0.9]),
}


@pytest.mark.parametrize("problem", PROBLEMS)
def test_a_sequence_classifier_takes_transformers_own_loss_for_its_kind_of_labels(problem: str) -> None:
    """``task = "sequence-classification"`` with one class, several at once (float multi-hot
    labels) or a score (``num_labels = 1``, float labels): the loss is the one the model computes
    from the same labels (a score's was "Target 1 is out of bounds", or 0 for scores below 1:
    cross-entropy over one class); the accuracy only for one class of several."""
    from coretrain_hf.model import SequenceClassifier

    num_labels, labels = PROBLEMS[problem]
    config = transformers.LlamaConfig(**llama_table(vocab_size=50, pad_token_id=0, num_labels=num_labels))
    model = transformers.LlamaForSequenceClassification(config)
    ids = torch.randint(1, 50, (4, 6))
    with torch.no_grad():
        ours = SequenceClassifier(model)(input_ids=ids, labels=torch.tensor(labels))
        model.config.problem_type = None  # guessed again, as a fresh model guesses it
        torch.testing.assert_close(ours["loss"], model(input_ids=ids, labels=torch.tensor(labels)).loss)
    assert model.config.problem_type == problem and ("accuracy" in ours) == (problem == "single_label_classification")


def test_a_score_is_learnt_and_texts_get_the_pipelines_sigmoid_score(
    tmp_path: Path, padding_tokenizer_dir: Path, cli: Any
) -> None:
    """A regression through the ``hf`` provider (``num_labels = 1``, a float ``label`` column)
    learns its scores, and ``predict --data`` scores texts as transformers' text-classification
    pipeline does for one label: the sigmoid of the logit (a softmax over one value is always 1)."""
    model = {"task": "sequence-classification", "num_labels": 1, "config": llama_table(vocab_size=300, pad_token_id=2)}
    sections = {
        "model": {"provider": "hf", "options": model},
        "data": {"provider": "test_hf_tasks:scored_reviews", "options": {"tokenizer": str(padding_tokenizer_dir)}},
        "tokenizer": {"path": str(padding_tokenizer_dir)},
        "optimizer": {"lr": 1e-2},
        "train": {"micro_batch_size": 16, "log_interval": 10, "eval_iters": 2},
    }
    result = run_steps(tmp_path, steps=40, config=sections)
    losses = [row["loss"] for row in result.metrics]
    assert losses[-1] < losses[0] / 4, losses  # the scores are learnt (it failed: "Target 1 is out of bounds")
    config = write_config(tmp_path / "c.toml", tiny_config(result.output_dir, **sections))
    done, records = predict_texts(config, ["great lovely film"], tmp_path)
    record = records[0] if records else {}
    assert done.returncode == 0 and record["score"] == pytest.approx(torch.tensor(record["output"][0]).sigmoid().item())


def bert_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer as BERT's: ``[CLS] text [SEP]``, a ``[MASK]`` token, one id per word."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = "alice bob carol went to the market park with and saw a dog cat".split()
    vocab = {word: i for i, word in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    template = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.post_processor = template
    special = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, mask_token="[MASK]", **special).save_pretrained(
        directory
    )
    return directory


def masked_texts(context: Any, tokenizer: str) -> Any:
    """Texts of 4 to 12 words for BERT's pretraining, masked by transformers' collator, as the
    Trainer's masked-LM recipe has them."""
    import random

    import datasets

    from coretrain import Datasets

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    draw = random.Random(0)
    words = "alice bob carol went to the market park with and saw a dog cat".split()
    texts = [" ".join(draw.choices(words, k=draw.randint(4, 12))) for _ in range(200)]
    encoded = datasets.Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"]), remove_columns=["text"])
    collate = transformers.DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
    return Datasets(train=encoded.select(range(160)), valid=encoded.select(range(160, 200)), collate_fn=collate)


def masked_lm(path: str) -> Any:
    """A model provider of a user's own: a masked LM as ``from_pretrained`` gives it."""
    return transformers.AutoModelForMaskedLM.from_pretrained(path, local_files_only=True)


@pytest.mark.parametrize("provider", ["hf", "yours"])
def test_a_masked_lm_trains_and_fills_masks_as_the_fill_mask_pipeline_does(
    tmp_path: Path, cli: Any, provider: str
) -> None:
    """``task = "masked-lm"`` (or a masked LM a provider of the user's returns): BERT's
    pretraining on texts the data's collator masks (labels -100 but at the masked tokens, never
    shifted, each counted alike); ``predict --data`` fills each text's masks with the token
    transformers' ``fill-mask`` pipeline puts first, with its probability, from the exported
    directory; a text without a mask is one error."""
    from coretrain.testing import BEHAVIOUR

    tokenizer = bert_tokenizer(tmp_path / "tok")
    config = transformers.BertConfig(
        vocab_size=19, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    model = {"provider": "hf", "options": {"path": str(tmp_path / "bert"), "task": "masked-lm"}}
    if provider == "yours":
        model = {"provider": "test_hf_tasks:masked_lm", "options": {"path": str(tmp_path / "bert")}}
    sections = {
        "model": model,
        "data": {"provider": "test_hf_tasks:masked_texts", "options": {"tokenizer": str(tokenizer)}},
        "tokenizer": {"path": str(tokenizer)},
        "optimizer": {"lr": 1e-2},
        "train": {"micro_batch_size": 16, "eval_iters": 1},
    }
    result = run_steps(tmp_path, steps=6, config=sections, autoload=(*BEHAVIOUR, "transformers-models"))
    assert result.exit_code == 0 and all(row["loss"] > 0 for row in result.metrics)
    run_config = write_config(tmp_path / "c.toml", tiny_config(result.output_dir, **sections))
    texts = ["alice went to the [MASK]", "bob saw a [MASK] with [MASK]"]
    done, records = predict_texts(run_config, texts, tmp_path)
    assert done.returncode == 0, done.stderr
    done = cli("checkpoint", "export", str(result.output_dir), "--format", "hf", "--to", "exported", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    fill = transformers.pipeline("fill-mask", model=str(tmp_path / "exported"))
    first = fill(texts[0])[0]
    assert records[0]["tokens"] == [first["token_str"]] and records[0]["completion"] == first["sequence"]
    assert records[0]["score"] == pytest.approx([first["score"]], rel=1e-4)
    assert [answers[0]["token_str"] for answers in fill(texts[1])] == records[1]["tokens"]  # one list per mask
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "alice went to the park"}) + "\n")
    done = cli("predict", str(run_config), "--data", "plain.jsonl", "--out", "q.jsonl", cwd=tmp_path)
    assert done.returncode == 2 and "holds no mask token ([MASK]) to fill" in done.stderr
