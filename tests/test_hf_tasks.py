"""Hugging Face workloads beyond a causal LM and a text classifier.

A tagger (token classification: named entities, parts of speech) through the ``hf`` provider's
``task = "token-classification"``: labels aligned with the tokens and never shifted, every
labelled token weighing the same however the batch is cut, texts tagged token by token as
transformers' pipeline tags them, and an export transformers loads. An encoder-decoder (T5:
translation, summaries) from a provider of the user's: texts answered by ``generate``, a split's
records holding each sample's own decoder positions."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import forked_steps, metrics_rows

from coretrain.testing import run_steps, tiny_config, write_config

transformers = pytest.importorskip("transformers")
from test_hf import llama_table, review_data  # noqa: E402  (its reviews, a label per token)

WORDS = "alpha beta gamma delta eps zeta eta theta".split()
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


def word_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer as T5's: pad 0, ``</s>`` 1 closing each text, one id per word."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)
    return directory


def save_t5(directory: Path) -> None:
    """A tiny T5 for :func:`word_tokenizer`'s ids (its decoder starts from the pad id, 0), without dropout."""
    config = transformers.T5Config(
        vocab_size=3 + len(WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    config.dropout_rate = 0.0  # (its draws would differ between layouts)
    transformers.T5ForConditionalGeneration(config).save_pretrained(directory)


def seq2seq(path: str) -> Any:
    """A model provider of a user's own: an encoder-decoder as ``from_pretrained`` gives it."""
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(path, local_files_only=True)


def rewritten(context: Any, tokenizer: str) -> Any:
    """Texts of 2 to 5 words and their rewrites, as a user tokenizes them for a seq2seq model
    (``labels`` the rewrite's ids): a rewrite is reversed and one word shorter or longer, so a
    record's decoder positions differ from its encoder's while a batch of both pads to one length."""
    import random

    import datasets

    draw = random.Random(0)
    sources = [draw.choices(WORDS, k=draw.randint(2, 5)) for _ in range(200)]
    rewrites = [words[::-1][: len(words) - 1] if len(words) % 2 else [*words[::-1], words[0]] for words in sources]
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    texts = {"source": [" ".join(w) for w in sources], "rewrite": [" ".join(w) for w in rewrites]}
    pairs = datasets.Dataset.from_dict(texts).map(
        lambda b: {**tok(b["source"]), "labels": tok(b["rewrite"])["input_ids"]},
        batched=True,
        remove_columns=["source", "rewrite"],
    )
    return pairs.select(range(160)), pairs.select(range(160, 200))


@pytest.mark.parametrize("provider", ["yours", "hf"])
def test_an_encoder_decoder_answers_texts_with_generate_and_its_records_keep_their_decoder_positions(
    tmp_path: Path, cli: Any, provider: str
) -> None:
    """A T5 from a provider of the user's, or the ``hf`` provider's ``task = "seq2seq-lm"``:
    ``predict --data`` answers each text with what ``generate`` gives for the exported model (it
    was "You must specify exactly one of input_ids or inputs_embeds": the sampler fed the text
    to the decoder); ``predict --split`` writes each record's own decoder positions, its labels
    without the -100 padding (not as many positions as its source's tokens: the attention mask
    is the encoder's)."""
    from coretrain.testing import BEHAVIOUR

    tokenizer = word_tokenizer(tmp_path / "tok")
    save_t5(tmp_path / "t5")
    model = {"provider": "test_hf_tasks:seq2seq", "options": {"path": str(tmp_path / "t5")}}
    if provider == "hf":
        model = {"provider": "hf", "options": {"path": str(tmp_path / "t5"), "task": "seq2seq-lm"}}
    sections = {
        "model": model,
        "data": {"provider": "test_hf_tasks:rewritten", "options": {"tokenizer": str(tokenizer)}},
        "tokenizer": {"path": str(tokenizer)},
        "optimizer": {"lr": 3e-2},
        "train": {"micro_batch_size": 8, "eval_iters": 0},
    }
    result = run_steps(tmp_path, steps=40, config=sections, autoload=(*BEHAVIOUR, "transformers-models"))
    run_config = write_config(tmp_path / "c.toml", tiny_config(result.output_dir, **sections))
    texts = ["alpha beta gamma", "zeta eta", "theta eps delta beta alpha"]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    done = cli("predict", str(run_config), "--data", "texts.jsonl", "--out", "p.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line)["completion"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    done = cli("checkpoint", "export", str(result.output_dir), "--format", "hf", "--to", "exported", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "exported")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    produced = model.generate(**tok(texts, return_tensors="pt", padding=True), max_new_tokens=32, do_sample=False)
    assert answers == tok.batch_decode(produced, skip_special_tokens=True) and any(answers)
    done = cli("predict", str(run_config), "--split", "valid", "--out", "v.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    _, valid = rewritten(None, str(tokenizer))
    assert [record["target"] for record in records] == valid["labels"]
    assert all(len(record["prediction"]) == len(record["target"]) for record in records)


def causal_lm(path: str) -> Any:
    """A model provider of a user's own: a causal LM as ``from_pretrained`` gives it."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def reviews_to_continue(context: Any, tokenizer: str) -> Any:
    """The reviews as a causal LM's data: each token its own label (the model shifts them)."""
    train, valid = review_data(context, tokenizer)
    return tuple(split.map(lambda r: {"label": r["input_ids"]}) for split in (train, valid))


def users_model_run(tmp_path: Path, kind: str, tokenizer: Path) -> dict[str, Any]:
    """Sections of a run whose provider (the user's, or the ``hf`` provider's ``seq2seq-lm``)
    gives a transformers model of ``kind``."""
    if kind in ("seq2seq", "hf-seq2seq-lm"):
        tokenizer = word_tokenizer(tmp_path / "words")
        save_t5(tmp_path / "model")
        data = "test_hf_tasks:rewritten"
    elif kind == "causal-lm":
        llama = transformers.LlamaConfig(**llama_table(vocab_size=300, pad_token_id=2))
        transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "model")
        data = "test_hf_tasks:reviews_to_continue"
    elif kind == "gpt2":  # no loss_type: counted as the Trainer counts it, unshifted, and handed to its loss
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300, pad_token_id=2, **no_dropout)
        transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "model")
        data = "test_hf_tasks:reviews_to_continue"
    else:
        names = {0: "bad", 1: "good"}
        table = llama_table(vocab_size=300, pad_token_id=2, num_labels=2, id2label=names, classifier_dropout=0.0)
        llama = transformers.LlamaConfig(**table)
        transformers.LlamaForTokenClassification(llama).save_pretrained(tmp_path / "model")
        data = "test_hf:review_data"
    providers = {"seq2seq": "seq2seq", "causal-lm": "causal_lm", "gpt2": "causal_lm", "tagger": "token_classifier"}
    model = {"provider": f"test_hf_tasks:{providers.get(kind)}", "options": {"path": str(tmp_path / "model")}}
    if kind == "hf-seq2seq-lm":
        model = {"provider": "hf", "options": {"path": str(tmp_path / "model"), "task": "seq2seq-lm"}}
    return {
        "model": model,
        "data": {
            "provider": data,
            "options": {"tokenizer": str(tokenizer), **({"token_labels": True} if kind == "tagger" else {})},
        },
        "tokenizer": {"path": str(tokenizer)},
        "optimizer": {"lr": 1e-2},
        "train": {"eval_iters": 0, "log_interval": 1},
    }


def token_classifier(path: str) -> Any:
    """A model provider of a user's own: a tagger as ``from_pretrained`` gives it."""
    return transformers.AutoModelForTokenClassification.from_pretrained(path, local_files_only=True)


@pytest.mark.parametrize("kind", ["causal-lm", "gpt2", "tagger", "seq2seq", "hf-seq2seq-lm"])
def test_a_users_transformers_model_weighs_every_labelled_token_alike_however_the_batch_is_cut(
    tmp_path: Path, padding_tokenizer_dir: Path, kind: str
) -> None:
    """A transformers model from a provider of the user's (and the ``hf`` provider's seq2seq
    model), on padded batches of uneven texts:
    4 micro-batches of 4 train the losses of one micro-batch of 16, as the ``Trainer`` does since
    transformers 4.46 (``num_items_in_batch``). Each micro-batch's own mean, averaged, weighs a
    short text's tokens more: the losses were 0.1-4% apart."""
    from coretrain.testing import BEHAVIOUR

    sections = users_model_run(tmp_path, kind, padding_tokenizer_dir)
    autoload = (*BEHAVIOUR, "transformers-models")
    whole = {**sections, "train": {**sections["train"], "micro_batch_size": 16}}
    cut = {**sections, "train": {**sections["train"], "micro_batch_size": 4, "global_batch_size": 16}}
    reference = [row["loss"] for row in run_steps(tmp_path / "whole", steps=3, config=whole, autoload=autoload).metrics]
    losses = [row["loss"] for row in run_steps(tmp_path / "cut", steps=3, config=cut, autoload=autoload).metrics]
    assert losses == pytest.approx(reference, rel=1e-5) and len(losses) == 3


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


def test_the_seq2seq_loss_is_the_models_own_and_a_window_batch_is_one_error(tmp_path: Path) -> None:
    """``task = "seq2seq-lm"``'s loss over the target's labelled tokens is what T5 computes from
    the same labels; coretrain's (input_ids, targets) windows, a causal LM's, are one error."""
    from coretrain_hf.model import Seq2SeqLM

    from coretrain import UserError

    save_t5(tmp_path / "t5")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5")
    source = torch.randint(3, 11, (2, 5))
    labels = torch.tensor([[4, 5, 6, 1], [7, 1, -100, -100]])
    with torch.no_grad():
        ours = Seq2SeqLM(hf)(input_ids=source, attention_mask=torch.ones_like(source), labels=labels)
        torch.testing.assert_close(ours["loss"], hf(input_ids=source, labels=labels).loss)
    assert ours["num_tokens"] == 6 and ours["logits"].shape[:2] == labels.shape
    with pytest.raises(UserError, match='task = "seq2seq-lm" takes dict batches .* this batch has a tuple'):
        Seq2SeqLM(hf)(source, labels)


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
    (tmp_path / "texts.jsonl").write_text(json.dumps({"prompt": "great lovely film"}) + "\n")
    done = cli("predict", str(config), "--data", "texts.jsonl", "--out", "p.jsonl", cwd=tmp_path)
    record = json.loads((tmp_path / "p.jsonl").read_text())
    assert done.returncode == 0 and record["score"] == pytest.approx(torch.tensor(record["output"][0]).sigmoid().item())
