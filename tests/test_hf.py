"""Hugging Face in and out: the ``hf`` provider on tiny local models, labels shifted once,
export back to a ``from_pretrained`` directory with the same logits. Nothing is downloaded:
models are built from a config and saved with ``save_pretrained`` in the test."""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import CORPUS, HF_MOE, STDLIB, forked_steps, hf_moe_table, in_one_job, metrics_rows, predict_texts
from coretrain_checkpoint_command.export import export

import coretrain
from coretrain import UserError, hookimpl
from coretrain.testing import BEHAVIOUR, run_steps, tiny_config, write_config

transformers = pytest.importorskip("transformers")
from coretrain_hf.model import CausalLM  # noqa: E402

VOCAB = 256


def tiny_llama(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama as a user's downloaded model: a save_pretrained directory."""
    directory = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_llama().save_pretrained(directory)
    return directory


def llama_table(**fields: Any) -> dict[str, Any]:
    """A tiny Llama's config table, for a randomly initialised model."""
    base = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    return {**base, "num_attention_heads": 2, "num_key_value_heads": 2, **fields}


def text_run(model_dir: Path, **train: Any) -> dict[str, Any]:
    """Sections of a run of the hf provider on byte-level text (token ids < 256)."""
    return {
        "model": {"provider": "hf", "options": {"path": str(model_dir)}},
        "data": {
            "provider": "text-bytes",
            "options": {"globs": [f"{STDLIB}/a*.py"], "seq_length": 32, "max_bytes": 60000},
        },
        "optimizer": {"lr": 3e-3},
        "train": {"micro_batch_size": 4, "log_interval": 5, **train},
    }


# --------------------------------------------------------------------------- labels shifted once


def test_each_batch_convention_is_shifted_exactly_once() -> None:
    hf = tiny_llama().eval()
    model = CausalLM(hf)
    ids = torch.randint(0, VOCAB, (2, 12))
    logits = hf(input_ids=ids).logits
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    # HF's convention: labels aligned with input_ids, the shift happens inside
    assert torch.allclose(model(input_ids=ids)["loss"], by_hand, atol=1e-6)
    assert torch.allclose(model(input_ids=ids, labels=ids)["loss"], by_hand, atol=1e-6)
    # coretrain's text batches: targets already shifted; the same tokens predict the same targets
    pre_shifted = model(ids[:, :-1], ids[:, 1:])
    assert torch.allclose(pre_shifted, by_hand, atol=1e-6)
    # the obvious hand-written wrapper shifts twice and learns a different objective
    twice = hf(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
    assert not torch.allclose(twice, by_hand, atol=1e-3)


def test_masked_labels_and_padding_take_no_loss() -> None:
    hf = tiny_llama().eval()
    model = CausalLM(hf)
    ids = torch.randint(0, VOCAB, (1, 10))
    labels = ids.clone()
    labels[:, :6] = -100  # a prompt: no loss on it
    logits = hf(input_ids=ids).logits
    by_hand = F.cross_entropy(logits[0, 5:-1], ids[0, 6:])
    assert torch.allclose(model(input_ids=ids, labels=labels)["loss"], by_hand, atol=1e-6)
    assert model(input_ids=ids, labels=labels)["num_tokens"] == 4
    mask = torch.ones_like(ids)
    mask[:, 8:] = 0  # right padding: never a target
    logits = hf(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(
        model(input_ids=ids, attention_mask=mask)["loss"], F.cross_entropy(logits[0, :7], ids[0, 1:8]), atol=1e-6
    )


# --------------------------------------------------------------------------- in and out


def test_train_export_from_pretrained_gives_the_same_logits(tmp_path: Path, llama_dir: Path) -> None:
    result = run_steps(tmp_path, steps=10, config=text_run(llama_dir), tables={"timers": {}})
    assert result.exit_code == 0
    losses = [m["loss"] for m in result.metrics]
    assert losses[-1] < losses[0]
    # FLOPs per token known from the config (6N + 12·L·H·T): TFLOP/s and MFU are reported
    assert result.run.flops_per_sample == result.run.model.flops_per_token() * 32
    assert result.metrics[-1]["tflops_per_device"] > 0
    trained = result.run.model.hf.eval()
    written = export(result.output_dir, None, tmp_path / "exported", "hf", {"merge_lora": False})
    assert "LlamaForCausalLM" in written
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True).eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trained(ids).logits)
        untrained = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True)
        assert not torch.allclose(untrained(ids).logits, trained(ids).logits)


@pytest.mark.parametrize("bias", [False, True])
def test_the_first_party_gpt_exports_as_a_transformers_gpt2_with_the_same_logits(tmp_path: Path, bias: bool) -> None:
    """The quickstart's model, ``--format hf``: transformers' GPT2LMHeadModel loads it and computes
    its logits (q, k, v fused into c_attn, Conv1D's transposed weights, zero biases without
    ``bias``, the exact GELU), generates as it does, and a mixture of experts is one error."""
    sections = {
        "model": {"provider": "gpt", "options": {"n_layer": 2, "n_head": 2, "n_embd": 32, "bias": bias}},
        "data": text_run(Path("unused"))["data"],
        "train": {"micro_batch_size": 4, "log_interval": 5},
    }
    result = run_steps(tmp_path, steps=10, config=sections)
    trained = result.run.model.eval()
    assert "GPT-2 of 2 blocks, 32 wide, 256 tokens" in export(result.output_dir, None, tmp_path / "gpt2", "hf", {})
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", local_files_only=True).eval()
    ids = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, trained(ids), atol=1e-6, rtol=0)  # (GPT-2's tanh GELU: 9e-6)
        made = loaded.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)[0, 8:]
        context = ids[:1, :8]
        for token in made:  # greedy with transformers' generate = the argmax of coretrain's model
            assert int(trained(context)[0, -1].argmax()) == int(token)
            context = torch.cat([context, token.view(1, 1)], dim=1)

    experts = {**sections, "model": {"provider": "gpt", "options": {**sections["model"]["options"], "n_experts": 2}}}
    moe = run_steps(tmp_path / "moe", steps=2, config=experts)
    with pytest.raises(UserError, match="mixture of experts has no transformers GPT-2 counterpart"):
        export(moe.output_dir, None, tmp_path / "moe-gpt2", "hf", {})


def test_a_config_table_builds_a_fresh_model_sized_by_the_data(tmp_path: Path) -> None:
    sections = text_run(Path("unused"))
    sections["model"]["options"] = {"config": llama_table()}
    result = run_steps(tmp_path, steps=4, config=sections)
    config = result.run.model.hf.config
    assert config.vocab_size == 256 and config.max_position_embeddings == 32  # from text-bytes
    assert (result.output_dir / "hf-config" / "config.json").is_file()


def test_sequence_classification_learns_and_logs_accuracy(tmp_path: Path) -> None:
    sections = {
        "model": {
            "provider": "hf",
            "options": {
                "task": "sequence-classification",
                "num_labels": 2,
                "config": {
                    "model_type": "llama",
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 2,
                    "vocab_size": 16,
                    "pad_token_id": 0,
                },
            },
        },  # fmt: skip
        "data": {"provider": "test_hf:parity_data"},
        "optimizer": {"lr": 1e-2},
        "train": {"micro_batch_size": 16, "log_interval": 10, "eval_iters": 2},
    }
    result = run_steps(tmp_path, steps=60, config=sections)
    assert result.evals[-1]["valid/accuracy"] > 0.9
    assert result.metrics[-1]["train/accuracy"] > result.metrics[0]["train/accuracy"]


def test_a_classifier_for_other_classes_starts_its_head_afresh_with_ignore_mismatched_sizes(tmp_path: Path) -> None:
    """A saved 2-class classifier fine-tuned for 3 (``num_labels``): transformers' size mismatch of
    its head was a plugin failure ("RuntimeError: You set `ignore_mismatched_sizes` to `False`");
    it is one error naming the option, and with it the body is the saved one and the head new."""
    config = transformers.LlamaConfig(**llama_table(vocab_size=16, pad_token_id=0), num_labels=2)
    saved = transformers.LlamaForSequenceClassification(config)
    saved.save_pretrained(tmp_path / "base")
    options = {"task": "sequence-classification", "path": str(tmp_path / "base"), "num_labels": 3}
    sections: dict[str, Any] = {
        "model": {"provider": "hf", "options": options},
        "data": {"provider": "test_hf:parity_data"},
        "optimizer": {"lr": 0.0},  # the weights stay as they were loaded
        "train": {"micro_batch_size": 16, "eval_iters": 0},
    }
    with pytest.raises(UserError, match=r"do not fit the model .* set model.options.ignore_mismatched_sizes = true"):
        run_steps(tmp_path / "refused", steps=1, config=sections)
    options["ignore_mismatched_sizes"] = True
    tuned = run_steps(tmp_path / "tuned", steps=1, config=sections).run.model.hf
    assert tuned.score.weight.shape == (3, 32)
    assert torch.equal(tuned.model.embed_tokens.weight, saved.model.embed_tokens.weight)
    assert torch.equal(tuned.model.layers[0].mlp.up_proj.weight, saved.model.layers[0].mlp.up_proj.weight)


def test_pretrained_naming_a_saved_model_directory_says_to_load_it_through_path(
    tmp_path: Path, llama_dir: Path
) -> None:
    """``checkpoint.pretrained`` naming a save_pretrained directory read it as a coretrain
    checkpoint: "model.pt: checkpoint file missing; the checkpoint is incomplete"."""
    sections = {**text_run(llama_dir), "checkpoint": {"pretrained": str(llama_dir)}}
    with pytest.raises(UserError, match=r"is a Hugging Face model's save .*: remove checkpoint.pretrained"):
        run_steps(tmp_path / "both", steps=1, config=sections)
    sections["checkpoint"] = {"pretrained": str(llama_dir / "model.safetensors")}  # its weights, named without hf.
    with pytest.raises(UserError, match=r"model.safetensors is a Hugging Face model's save .*: remove checkpoint"):
        run_steps(tmp_path / "weights", steps=1, config=sections)
    sections["model"] = {"provider": "hf", "options": {"config": llama_table()}}
    with pytest.raises(UserError, match=rf"not a coretrain checkpoint; .*\[model.options\] path = \"{llama_dir}\""):
        run_steps(tmp_path / "random", steps=1, config=sections)
    # this provider's own export (names with hf.) beside a config.json is a checkpoint: it loads
    trained = run_steps(tmp_path / "trained", steps=1, config=text_run(llama_dir)).run.model
    from safetensors.torch import save_file

    export = tmp_path / "copy" / "exported.safetensors"
    shutil.copytree(llama_dir, export.parent)
    save_file({name: value.contiguous() for name, value in trained.state_dict().items()}, export)
    loaded = run_steps(
        tmp_path / "loaded",
        steps=1,
        config={**text_run(export.parent), "optimizer": {"lr": 0.0}, "checkpoint": {"pretrained": str(export)}},
        tables={"safetensors": {}},  # (on by default) reads it: torch.load reads safetensors only from torch 2.12
    ).run.model
    assert all(torch.equal(value, trained.state_dict()[name]) for name, value in loaded.state_dict().items())


def parity_data(context: Any) -> Any:
    """Label: whether the sequence starts with token 1 (a classifier's first, easy task)."""
    from coretrain import Datasets

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 16, (512, 8), generator=g)
    labels = torch.randint(0, 2, (512,), generator=g)
    ids[:, 0] = labels  # token 0 or 1 first
    ids[:, 0] += 1
    pairs = list(zip(ids, labels))
    return Datasets(train=pairs[:448], valid=pairs[448:])


sys.modules.setdefault("test_hf", sys.modules[__name__])


def review_data(
    context: Any,
    tokenizer: str,
    token_labels: bool = False,
    unlabelled: bool = False,
    spans: bool = False,
    keep_text: bool = False,
) -> Any:
    """Reviews as a Hugging Face user prepares them: tokenized without padding (each as long as
    its words), the class in a column named ``label``; 1 when the review is good."""
    import random

    import datasets

    words = random.Random(0)
    good, bad, filler = "good great lovely fine".split(), "bad awful poor dull".split(), "the a film plot".split()
    labels = [i % 2 for i in range(240)]
    texts = [
        " ".join(words.choices(good if label else bad, k=words.randint(1, 6)) + words.choices(filler, k=2))
        for label in labels
    ]
    tok = context.tokenizer or transformers.AutoTokenizer.from_pretrained(tokenizer)
    reviews = datasets.Dataset.from_dict({"text": texts, "label": labels})
    reviews = reviews.map(lambda b: tok(b["text"]), batched=True, remove_columns=[] if keep_text else ["text"])
    if token_labels:  # one label per token, as a tagger's or a causal LM's
        reviews = reviews.map(lambda r: {"label": [r["label"]] * len(r["input_ids"])})
    if spans:  # a column of the reviews' lengths, neither the model's input nor labels
        reviews = reviews.map(lambda r: {"spans": [1] * len(r["input_ids"])})
    reviews = reviews.remove_columns("label") if unlabelled else reviews
    return reviews.select(range(200)), reviews.select(range(200, 240))


def collated_reviews(context: Any, tokenizer: str) -> Any:
    """The reviews batched by transformers' DataCollatorWithPadding, as its Trainer batches them:
    each batch a BatchEncoding (a mapping, not a dict), ``label`` renamed ``labels``."""
    from coretrain import Datasets

    train, valid = review_data(context, tokenizer)
    collator = transformers.DataCollatorWithPadding(transformers.AutoTokenizer.from_pretrained(tokenizer))
    return Datasets(train=train, valid=valid, collate_fn=collator)


def reviews_given_a_pad_token(context: Any, tokenizer: str) -> Any:
    """The HF idiom for a decoder's tokenizer: ``tokenizer.pad_token = tokenizer.eos_token``, on
    the run's tokenizer as the provider gets it, nothing saved."""
    context.tokenizer.pad_token = context.tokenizer.eos_token
    return review_data(context, tokenizer)


def review_run(tokenizer: Path, shared: bool, **options: Any) -> dict[str, Any]:
    classifier = llama_table(vocab_size=300, pad_token_id=2)  # </s>, the tokenizer's EOS and pad
    return {
        "model": {
            "provider": "hf",
            "options": {"task": "sequence-classification", "num_labels": 2, "config": classifier},
        },
        "data": {"provider": "test_hf:review_data", "options": {"tokenizer": str(tokenizer), **options}},
        "optimizer": {"lr": 1e-2},
        "train": {"micro_batch_size": 16, "log_interval": 10, "eval_iters": 3},
        **({"tokenizer": {"path": str(tokenizer)}} if shared else {}),
    }


@pytest.mark.slow  # 2 forked gloo ranks
def test_a_classifier_classifies_texts_alike_on_one_rank_with_fsdp_and_with_tensor_parallelism(
    tmp_path: Path, padding_tokenizer_dir: Path
) -> None:
    """``predict --data`` of texts through the run's model, as an evaluation calls it: under FSDP
    its root gathers the embeddings, under tensor parallelism the texts' positions are padded to
    the group's multiple; the classes and scores are one rank's."""
    from conftest import run_here

    result = run_steps(tmp_path, steps=10, config=review_run(padding_tokenizer_dir, shared=True))
    config = write_config(
        tmp_path / "c.toml", tiny_config(result.output_dir, **review_run(padding_tokenizer_dir, True))
    )
    texts = ["great lovely good the film", "awful poor bad a plot", "fine great plot", "dull awful the film", "ok"]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    predict = ["predict", str(config), "--data", str(tmp_path / "texts.jsonl"), "--batch-size", "2"]
    tests = {"PYTHONPATH": str(Path(__file__).parent)}  # test_hf:review_data, the provider
    assert run_here(*predict, "--out", str(tmp_path / "one.jsonl"), cwd=tmp_path, env=tests).returncode == 0
    layouts = {"fsdp": 'distributed.strategy="fsdp"', "tp": "distributed.tp_size=2"}
    jobs = [[*predict, "--set", value, "--out", str(tmp_path / f"{name}.jsonl")] for name, value in layouts.items()]
    in_one_job(tmp_path, 2, jobs, "classify", env=tests)
    one = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    for name in layouts:
        got = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["prediction"] for r in got] == [r["prediction"] for r in one], name
        assert [r["score"] for r in got] == pytest.approx([r["score"] for r in one], abs=1e-5), name


def test_uneven_token_columns_are_padded_with_the_runs_tokenizer_and_label_is_the_class(
    tmp_path: Path, padding_tokenizer_dir: Path, cli: Any
) -> None:
    """As transformers' Trainer with DataCollatorWithPadding: a batch's reviews padded to its
    longest, the padding masked out (each review's logits as it gets alone), ``label`` taken as
    the class; the classifier learns, and ``coretrain predict`` writes each review's class, and
    the class of new texts (``--data``, as transformers' text-classification pipeline)."""
    metrics = {"evaluation": {"compute_metrics": "workloads:corpus_metrics"}}  # the logits and `label` of each
    result = run_steps(tmp_path, steps=40, config=review_run(padding_tokenizer_dir, shared=True), tables=metrics)
    assert result.exit_code == 0 and result.evals[-1]["valid/accuracy"] > 0.9, result.evals
    assert result.evals[-1]["valid/acc"] == pytest.approx(result.evals[-1]["valid/accuracy"], rel=1e-6)
    assert result.evals[-1]["valid/samples"] == 3 * 16  # eval_iters global batches
    config = write_config(
        tmp_path / "c.toml", tiny_config(result.output_dir, **review_run(padding_tokenizer_dir, True))
    )
    done = cli("predict", str(config), "--split", "valid", "--out", str(tmp_path / "p.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    predicted = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(predicted) == 40 and set(predicted[0]) == {"index", "prediction", "output", "target"}
    assert [r["target"] for r in predicted] == [i % 2 for i in range(200, 240)]
    assert sum(r["prediction"] == r["target"] for r in predicted) >= 36
    texts = ["great lovely good the film", "awful poor bad a plot", "fine great plot", "dull awful the film"]
    done, classified = predict_texts(config, texts, tmp_path)
    assert done.returncode == 0, done.stderr
    assert [r["prompt"] for r in classified] == texts and [r["prediction"] for r in classified] == [1, 0, 1, 0]
    assert [r["label"] for r in classified] == ["LABEL_1", "LABEL_0", "LABEL_1", "LABEL_0"]  # the config's id2label
    assert all(0.5 < r["score"] <= 1 and len(r["output"]) == 2 for r in classified)
    columns = result.run.datasets.valid
    batch = columns.get_batch(torch.arange(8))
    lengths = batch["attention_mask"].sum(dim=1)
    assert len(set(lengths.tolist())) > 1 and batch["input_ids"].shape == (8, int(lengths.max()))
    model = result.run.model.hf.eval()
    with torch.no_grad():
        together = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        for i, length in enumerate(lengths.tolist()):
            alone = model(input_ids=columns.get_batch(torch.tensor([i]))["input_ids"]).logits
            assert batch["input_ids"][i, length:].eq(2).all()  # right-padded with the pad token
            torch.testing.assert_close(together[i], alone[0], rtol=1e-4, atol=1e-5)


def own_classifier(path: str) -> Any:
    """A user's own provider: transformers' model as it comes, its loss its own."""
    return transformers.AutoModelForSequenceClassification.from_pretrained(path)


def test_a_users_own_hf_model_learns_from_a_label_column_as_under_the_trainer(
    tmp_path: Path, padding_tokenizer_dir: Path
) -> None:
    """load_dataset names the class column ``label``; transformers' collators hand it to the model
    as ``labels``, from which the model computes its loss: so does hf-datasets (before, the model
    got ``label``, ignored it and returned no loss)."""
    config = transformers.LlamaConfig(**llama_table(vocab_size=300, pad_token_id=2, num_labels=2))
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "model")
    sections = review_run(padding_tokenizer_dir, shared=True)
    sections["model"] = {"provider": "test_hf:own_classifier", "options": {"path": str(tmp_path / "model")}}
    result = run_steps(tmp_path / "run", steps=40, config=sections)
    assert result.exit_code == 0 and result.evals[-1]["valid/loss"] < 0.3, result.evals
    assert result.run.datasets.train.get_batch(torch.arange(4))["labels"].tolist() == [0, 1, 0, 1]


class LabelTaker(torch.nn.Module):
    """A model of the user's own whose forward names the class ``label``, as its dataset does."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = torch.nn.Embedding(300, 8), torch.nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        pooled = (self.embedding(input_ids) * attention_mask.unsqueeze(-1)).sum(1)
        return torch.nn.functional.cross_entropy(self.head(pooled), label)


def label_taker() -> torch.nn.Module:
    return LabelTaker()


def test_a_forward_that_takes_label_is_told_the_column_arrives_as_labels(
    tmp_path: Path, padding_tokenizer_dir: Path
) -> None:
    from coretrain.errors import RunFailure

    sections = review_run(padding_tokenizer_dir, shared=True)
    sections["model"] = {"provider": "test_hf:label_taker"}
    with pytest.raises(RunFailure, match="LabelTaker.forward\\(\\) takes 'label', but the batches hold 'labels'"):
        run_steps(tmp_path, steps=2, config=sections, autoload=[*BEHAVIOUR, "data-checks"])


def test_a_collate_fn_that_returns_a_batch_encoding_feeds_the_model_its_keys(
    tmp_path: Path, padding_tokenizer_dir: Path
) -> None:
    """DataCollatorWithPadding as data.collate_fn: its BatchEncoding is called as model(**batch)."""
    config = review_run(padding_tokenizer_dir, shared=True)
    config["data"]["provider"] = "test_hf:collated_reviews"
    result = run_steps(tmp_path, steps=40, config=config)
    assert type(result.run.datasets.train).__name__ == "Dataset"  # read by samples, collated by the collator
    assert result.exit_code == 0 and result.evals[-1]["valid/accuracy"] > 0.9, result.evals


def test_a_pad_token_the_provider_gives_the_runs_tokenizer_is_the_one_padding_uses(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """hf-datasets pads with the tokenizer the provider was handed, not a second copy of it."""
    config = review_run(tokenizer_dir, shared=True)  # a tokenizer saved without a pad token
    config["data"]["provider"] = "test_hf:reviews_given_a_pad_token"
    result = run_steps(tmp_path, steps=2, config=config, tables={"tokenizer": {}})
    assert result.exit_code == 0 and result.run.datasets.train.padding.tokenizer.pad_token == "</s>"


def test_uneven_per_token_labels_are_padded_with_the_index_losses_ignore(padding_tokenizer_dir: Path) -> None:
    """A tagger's or a causal LM's labels, one per token, padded as the tokens are, with -100;
    the text the ids came from, left beside them, passes through as it is."""
    from coretrain_hf.columns import Columns

    tok = transformers.AutoTokenizer.from_pretrained(padding_tokenizer_dir)
    context = types.SimpleNamespace(tokenizer=tok)
    train, _ = review_data(context, str(padding_tokenizer_dir), token_labels=True, keep_text=True)
    batch = Columns(train, "train", tok).get_batch(torch.arange(8))
    assert batch["text"] == train[:8]["text"] and all(isinstance(text, str) for text in batch["text"])
    labels = batch["labels"]  # the `label` column, renamed as transformers' collators rename it
    assert "label" not in batch and labels.shape == batch["input_ids"].shape
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1
    assert torch.equal(labels == -100, batch["attention_mask"] == 0)
    assert torch.equal(labels[:, 0], torch.tensor([i % 2 for i in range(8)]))


@pytest.mark.parametrize(
    ("shared", "options", "words"),
    [
        (
            False,
            {},
            "column 'input_ids' holds sequences of different lengths (|); set [tokenizer] path = \"DIR\" to pad",
        ),
        (True, {"spans": True}, "columns ['spans'] hold sequences of different lengths, which the tokenizer does"),
        ("no pad", {}, "and the run's tokenizer has no pad token: give it one (tokenizer.pad_token"),
        (True, {"unlabelled": True}, "a dict without a loss (a Hugging Face model computes one only when the batch"),
    ],
)
def test_uneven_token_columns_the_run_cannot_pad_are_one_error_saying_how(
    tmp_path: Path, tokenizer_dir: Path, padding_tokenizer_dir: Path, shared: Any, options: Any, words: str
) -> None:
    """Said by data-checks (on by default) as it reads the first batch, before training."""
    tokenizer = tokenizer_dir if shared == "no pad" else padding_tokenizer_dir
    config = review_run(tokenizer, shared=bool(shared), **options)
    with pytest.raises(UserError) as caught:
        run_steps(tmp_path, steps=2, config=config, tables={"data-checks": {}})
    message = str(caught.value)
    assert all(part in message for part in words.split("|")) and "UserError" not in message, message


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"path": "/nonexistent/model"}, "has no config.json"),
        ({"config": {"hidden_size": 8}}, "needs model_type"),
        ({}, "set path (a save_pretrained directory) or config"),
        ({"config": {"model_type": "no-such-architecture"}}, "model.options.config"),
    ],
)
def test_bad_model_options_are_one_clear_error(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    sections = text_run(Path("unused"))
    sections["model"]["options"] = options
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_steps(tmp_path, steps=2, config=sections)


def test_a_vocabulary_larger_than_the_models_is_refused(tmp_path: Path) -> None:
    sections = text_run(Path("unused"))
    sections["model"]["options"] = {"config": llama_table(vocab_size=100)}
    with pytest.raises(UserError, match=r"the data's vocab_size \(256\) exceeds the model's \(100\)"):
        run_steps(tmp_path, steps=2, config=sections)


@pytest.mark.slow
def test_two_ranks_train_and_export_from_pretrained(tmp_path: Path, llama_dir: Path) -> None:
    """On DDP and FSDP ranks (one job, as two jobs would run them), then exported."""
    from conftest import in_one_job

    runs = []
    for strategy in ("ddp", "fsdp"):
        sections = text_run(llama_dir, global_batch_size=8, eval_iters=0, train_iters=6)
        sections["distributed"] = {"strategy": strategy, "backend": "gloo"}
        runs.append(
            ["run", str(write_config(tmp_path / f"{strategy}.toml", tiny_config(tmp_path / strategy, **sections)))]
        )
    in_one_job(tmp_path, 2, runs, "hf", env={"OMP_NUM_THREADS": "1"})
    for strategy, layout in (("ddp", "replicated"), ("fsdp", "sharded")):
        out = tmp_path / strategy
        assert f'"layout": "{layout}"' in (out / "checkpoints/step_00000006/checkpoint.json").read_text()
        export(out, None, tmp_path / f"exported-{strategy}", "hf", {"merge_lora": False})
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / f"exported-{strategy}", local_files_only=True
        )
        assert type(loaded).__name__ == "LlamaForCausalLM"


def token_classifier(path: str) -> Any:
    """A model provider of a user's own: a transformers token classifier as ``from_pretrained`` gives it."""
    return transformers.AutoModelForTokenClassification.from_pretrained(path, local_files_only=True)


def tagger_run(tmp_path: Path, tokenizer: Path) -> dict[str, Any]:
    """Sections of a run of a user's own provider returning a transformers token classifier
    (saved to ``tmp_path / "tagger"``) on reviews padded per micro-batch, a label per token."""
    tagger = transformers.LlamaConfig(**llama_table(vocab_size=300, pad_token_id=2, num_labels=2))
    transformers.LlamaForTokenClassification(tagger).save_pretrained(tmp_path / "tagger")
    return {
        "model": {"provider": "test_hf:token_classifier", "options": {"path": str(tmp_path / "tagger")}},
        "data": {"provider": "test_hf:review_data", "options": {"tokenizer": str(tokenizer), "token_labels": True}},
        "tokenizer": {"path": str(tokenizer)},
        "train": {"micro_batch_size": 8, "eval_iters": 0},
    }


def test_transformers_models_answers_for_a_transformers_model_only() -> None:
    """The plan's paths name the model's own modules; a model of another kind gets no answer
    (its provider's, or the user's plan, is asked for); a PeftModel is one error."""
    import peft
    from coretrain_hf.transformers_models import TransformersModels
    from coretrain_tensor_parallel import unmatched

    tagger = transformers.LlamaForTokenClassification(transformers.LlamaConfig(**llama_table(num_labels=2)))
    run: Any = types.SimpleNamespace(dist=types.SimpleNamespace(tp_size=2))
    plan = TransformersModels().tensor_parallel_plan(run=run, model=tagger)
    assert plan and "model.layers.*.self_attn.q_proj" in plan and not unmatched(tagger, plan)
    assert TransformersModels().tensor_parallel_plan(run=run, model=torch.nn.Linear(2, 2)) is None
    adapted = peft.get_peft_model(tagger, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(UserError, match="LoRA adapters .* are not split over tensor-parallel ranks"):
        TransformersModels().tensor_parallel_plan(run=run, model=adapted)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_transformers_model_of_a_users_provider_exports_as_transformers_loads_it(
    tmp_path: Path, padding_tokenizer_dir: Path, strategy: str
) -> None:
    """``checkpoint export --format hf`` of a run whose provider is the user's own: the class and
    config the run recorded (FSDP2's class is the transformers one underneath), the trained
    weights, the tokenizer; ``from_pretrained`` gives the trained logits. A class the run
    directory names that transformers has not is one error (its code is not the directory's to name)."""
    sections = {**tagger_run(tmp_path, padding_tokenizer_dir), "distributed": {"strategy": strategy, "backend": "gloo"}}
    result = run_steps(tmp_path, steps=3, config=sections, autoload=(*BEHAVIOUR, "transformers-models"))
    written = export(result.output_dir, None, tmp_path / "exported", "hf", {})
    assert "LlamaForTokenClassification, tokenizer copied from" in written
    loaded = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "exported")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "exported").pad_token_id == 2
    original = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "tagger")
    ids = torch.randint(3, 300, (2, 7))
    with torch.no_grad():
        trained = result.run.unwrapped_model.eval()(input_ids=ids).logits
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, trained.full_tensor() if hasattr(trained, "full_tensor") else trained
        )
        assert not torch.allclose(original(input_ids=ids).logits, trained, atol=1e-4)  # it trained
    recorded = tmp_path / "out" / "hf-config" / "config.json"
    recorded.write_text(recorded.read_text().replace("LlamaForTokenClassification", "Popen"))
    with pytest.raises(UserError, match=r"the run's model class 'Popen' .* is not one of transformers'"):
        export(result.output_dir, None, tmp_path / "crafted", "hf", {})


@pytest.mark.parametrize("save_frozen", [True, False])
def test_lora_on_a_users_transformers_model_exports_its_adapters_and_merged_weights(
    tmp_path: Path, padding_tokenizer_dir: Path, save_frozen: bool
) -> None:
    """LoRA on a tagger of the user's own provider: the adapters (and the new head) export as a
    PEFT directory that ``PeftModel.from_pretrained`` puts on the user's base with the trained
    logits, also from an adapter-only checkpoint; merged, from a checkpoint that holds the base
    (without it, where the user's provider loaded it from is not the run's to say: one error)."""
    import peft

    sections = {**tagger_run(tmp_path, padding_tokenizer_dir), "checkpoint": {"save_frozen": save_frozen}}
    autoload = (*BEHAVIOUR, "transformers-models")
    result = run_steps(tmp_path, steps=3, config=sections, tables={"lora": LORA}, autoload=autoload)
    ids = torch.randint(3, 300, (2, 7))
    with torch.no_grad():
        trained = result.run.unwrapped_model.eval()(input_ids=ids).logits
    export(result.output_dir, None, tmp_path / "adapters", "hf", {})
    base = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "tagger")
    with torch.no_grad():
        reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()(input_ids=ids).logits
    torch.testing.assert_close(reloaded, trained)
    if not save_frozen:
        with pytest.raises(UserError, match="--merge-lora: the checkpoint holds only the adapters"):
            export(result.output_dir, None, tmp_path / "merged", "hf", {"merge_lora": True})
        return
    export(result.output_dir, None, tmp_path / "merged", "hf", {"merge_lora": True})
    merged = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)


def test_a_taggers_predictions_hold_each_records_own_tokens_not_the_padding(
    tmp_path: Path, padding_tokenizer_dir: Path, cli: Any
) -> None:
    """``coretrain predict --split valid`` of a token classifier on padded batches: each record's
    prediction, logits and labels are its own tokens' (as transformers' token-classification
    pipeline answers), not its micro-batch's longest with the padding's -100 and noise. Texts
    (``--data``) are tagged token by token (``transformers-models``); without that plugin, they
    are one error, not texts continued by sampling its two classes as tokens."""
    sections = tagger_run(tmp_path, padding_tokenizer_dir)
    result = run_steps(tmp_path, steps=2, config=sections)
    config = write_config(tmp_path / "c.toml", tiny_config(result.output_dir, **sections))
    done = cli("predict", str(config), "--split", "valid", "--out", str(tmp_path / "p.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    predicted = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    lengths = result.run.datasets.valid.get_batch(torch.arange(40))["attention_mask"].sum(dim=1).tolist()
    assert len(set(lengths)) > 1  # the micro-batches are padded
    assert [r["target"] for r in predicted] == [[i % 2] * n for i, n in zip(range(200, 240), lengths)]
    assert [(len(r["prediction"]), len(r["output"])) for r in predicted] == [(n, n) for n in lengths]
    done, records = predict_texts(config, ["great film"], tmp_path)  # a tagger continues no text
    tagged = records[0] if records else {}
    assert done.returncode == 0 and len(tagged["tokens"]) == len(tagged["label"]) > 1, done.stderr
    off = write_config(
        tmp_path / "off.toml",
        tiny_config(result.output_dir, **sections, plugins={"transformers-models": {"enabled": False}}),
    )
    done, _ = predict_texts(off, ["great film"], tmp_path)
    assert done.returncode == 2 and "gives 2 values per position for a tokenizer of 300 tokens" in done.stderr


@pytest.mark.slow  # 2 forked gloo ranks
def test_a_transformers_model_of_a_users_provider_splits_over_tensor_parallel_ranks(
    tmp_path: Path, padding_tokenizer_dir: Path
) -> None:
    """A provider of the user's returns a transformers tagger: ``transformers-models`` gives its
    architecture's plan (before: "model.provider ... gives no tensor-parallel plan"), and on
    padded batches of uneven reviews 2 tensor-parallel ranks train the one-rank losses."""
    sections = tagger_run(tmp_path, padding_tokenizer_dir)
    sections |= {"optimizer": {"lr": 1e-2}, "train": {"micro_batch_size": 8, "log_interval": 1, "eval_iters": 1}}
    one = run_steps(tmp_path / "one", steps=4, config=sections)
    split = forked_steps(tmp_path / "tp", 2, 4, {**sections, "distributed": {"tp_size": 2}})
    assert "tensor-parallel: 2 ranks per group split 7 plan entries" in split.stderr
    losses = [row["loss"] for row in metrics_rows(tmp_path / "tp" / "out") if "loss" in row]
    assert losses == pytest.approx([row["loss"] for row in one.metrics], rel=1e-5)
    assert len(losses) == 4


@pytest.mark.slow
def test_tensor_parallel_takes_the_transformers_plan_sequence_parallel_and_matches_one_rank(
    tmp_path: Path, llama_dir: Path
) -> None:
    sections = text_run(llama_dir, global_batch_size=8, eval_iters=0, log_interval=1)
    one = run_steps(tmp_path / "one", steps=8, config=sections)
    split = forked_steps(tmp_path / "tp", 2, 8, {**sections, "distributed": {"tp_size": 2}})
    # LlamaConfig.base_model_tp_plan (q, k, v, gate, up column-wise; o, down row-wise) and 6
    # entries of sequence parallelism: the layers' norms split by position, the whole sequence
    # gathered for attention and MLP, split on entering layer 0 and gathered for the final norm
    assert "tensor-parallel: 2 ranks per group split 13 plan entries" in split.stderr
    assert "replicated in each group: hf.model.embed_tokens, hf.model.norm, hf.lm_head" in split.stderr
    manifest = (tmp_path / "tp/out/checkpoints/step_00000008/checkpoint.json").read_text()
    assert '"layout": "sharded"' in manifest
    got = [row["loss"] for row in metrics_rows(tmp_path / "tp" / "out")]
    assert got == pytest.approx([row["loss"] for row in one.metrics], rel=1e-5)


def test_layers_of_another_shape_keep_the_plain_plan() -> None:
    from coretrain_hf.parallel import sequence_parallel

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.mlp = torch.nn.Identity(), torch.nn.Identity()

    base = torch.nn.Module()
    base.layers, base.norm = torch.nn.ModuleList([Layer()]), torch.nn.Identity()
    plan = {"layers.*.attn": "style"}
    assert sequence_parallel(base, plan, 2, 32) is plan


def test_a_format_no_plugin_writes_is_one_clear_error(tmp_path: Path, llama_dir: Path) -> None:
    result = run_steps(tmp_path, steps=2, config=text_run(llama_dir, eval_iters=0))
    with pytest.raises(UserError, match="--format onnx: no plugin writes that format"):
        export(result.output_dir, None, tmp_path / "x", "onnx", {})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not an empty directory"):
        export(result.output_dir, None, tmp_path / "full", "hf", {})
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------------- text data with a tokenizer


def tokenized_run(tokenizer_dir: Path, data_path: list[Any], cache: Path, **options: Any) -> dict[str, Any]:
    return {
        "model": {"provider": "hf", "options": {"config": llama_table()}},
        "data": {
            "provider": "hf-text",
            "options": {
                "tokenizer": str(tokenizer_dir),
                "data_path": [str(p) if isinstance(p, Path) else p for p in data_path],
                "seq_length": 16,
                "cache_dir": str(cache),
                **options,
            },
        },
        "optimizer": {"lr": 3e-3},
        "train": {"micro_batch_size": 4, "log_interval": 2},
    }


@pytest.mark.parametrize("provider", ["hf-text", "hf-sft"])
def test_one_file_is_named_as_megatron_names_it_or_in_a_list(tmp_path: Path, provider: str) -> None:
    """``data_path = "train.jsonl"`` (Megatron's --data-path takes one) is that file; it was the
    list of its characters ("data_path: t: expected a .txt, .jsonl, .json, .parquet file")."""
    a, b = (tmp_path / name for name in ("a.jsonl", "b.jsonl"))
    for path in (a, b):
        path.write_text('{"text": "x", "prompt": "x", "response": "y"}\n')

    def data_path(value: Any) -> Any:
        config = {"model": {"provider": "gpt"}, "data": {"provider": provider, "options": {"data_path": value}}}
        return coretrain.load_plugins(config, autoload=False).get(provider).data_path

    assert data_path(str(a)) == [str(a)]
    assert data_path([str(a), str(b)]) == [str(a), str(b)]
    with pytest.raises(UserError, match=r"data.options.data_path: needs a file or a list of files.*; got 3"):
        data_path(3)


def test_text_is_tokenized_once_with_eos_and_packed(
    tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    sections = tokenized_run(tokenizer_dir, [text_files["code"]], tmp_path / "cache")
    with caplog.at_level("INFO", logger="coretrain"):
        first = run_steps(tmp_path / "a", steps=4, config=sections)
    assert sum("tokenizing" in r.message for r in caplog.records) == 1
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    stream = [t for text in CORPUS[:3] for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [2]]
    inputs, targets = first.run.datasets.train[0]
    assert inputs.tolist() == stream[:16] and targets.tolist() == stream[1:17]  # documents packed, EOS between
    assert first.run.datasets.vocab_size == len(tokenizer)
    caplog.clear()
    with caplog.at_level("INFO", logger="coretrain"):
        second = run_steps(tmp_path / "b", steps=4, config=sections)  # another run: the cache is reused
    assert not any("tokenizing" in r.message for r in caplog.records)
    assert [m["loss"] for m in second.metrics] == [m["loss"] for m in first.metrics]
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 1


def test_prompts_to_a_model_trained_on_hf_text_are_encoded_with_the_datas_tokenizer(
    tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path], cli: Any
) -> None:
    """A model built from a config table (no directory, no tokenizer of its own) trained on
    hf-text with data.options.tokenizer: predict --data encodes the prompts with the tokenizer
    the data names (Datasets.tokenizer) and writes what transformers' generate gives."""
    sections = tokenized_run(tokenizer_dir, [text_files["code"]], tmp_path / "cache")
    result = run_steps(tmp_path, steps=4, config=sections)
    config = write_config(tmp_path / "c.toml", tiny_config(result.output_dir, **sections))
    (tmp_path / "p.jsonl").write_text('{"prompt": "def function_3(x):"}\n')
    done = cli("predict", str(config), "--data", "p.jsonl", "--max-new-tokens", "5", "--out", "g.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer("def function_3(x):", return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        made = result.run.model.hf.eval().generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=2)
    expected = tokenizer.decode(made[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert json.loads((tmp_path / "g.jsonl").read_text())["completion"] == expected


def test_an_edit_that_keeps_size_and_mtime_is_tokenized_again(
    tmp_path: Path, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox\n" * 40)
    sections = tokenized_run(tokenizer_dir, [corpus], tmp_path / "cache")
    run_steps(tmp_path / "a", steps=1, config=sections)
    stat = corpus.stat()
    corpus.write_text("the lazy dog sleeps\n" * 40)  # same size
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as rsync -a, cp -p or tar leave it
    assert corpus.stat().st_size == stat.st_size and corpus.stat().st_mtime_ns == stat.st_mtime_ns
    caplog.clear()
    with caplog.at_level("INFO", logger="coretrain"):
        edited = run_steps(tmp_path / "b", steps=1, config=sections)
    assert sum("tokenizing" in r.message for r in caplog.records) == 1
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = tokenizer("the lazy dog sleeps", add_special_tokens=False)["input_ids"]
    assert edited.run.datasets.train[0][0].tolist()[: len(expected)] == expected  # the new text, not the cached


@pytest.mark.parametrize("damage", ["truncated-tokens", "garbage-summary", "missing-tokens"])
def test_a_damaged_cache_entry_is_rebuilt_with_a_warning(
    tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path], damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    sections = tokenized_run(tokenizer_dir, [text_files["code"]], cache)
    first = run_steps(tmp_path / "a", steps=2, config=sections)
    (tokens,) = cache.glob("*.bin")
    if damage == "truncated-tokens":
        tokens.write_bytes(tokens.read_bytes()[:-3])
    elif damage == "garbage-summary":
        tokens.with_suffix(".json").write_bytes(b"\x00{not json")
    else:
        tokens.unlink()
    with caplog.at_level("INFO", logger="coretrain"):
        again = run_steps(tmp_path / "b", steps=2, config=sections)
    assert any("is damaged; tokenizing" in r.message for r in caplog.records)
    assert [m["loss"] for m in again.metrics] == [m["loss"] for m in first.metrics]


def test_sources_are_blended_by_weight_and_split_in_order(
    tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path]
) -> None:
    sections = tokenized_run(tokenizer_dir, [text_files["parquet"]], tmp_path / "cache", text_field="text")
    with pytest.raises(UserError, match="has no column 'text'; its columns: body"):
        run_steps(tmp_path / "bad", steps=2, config=sections)
    sections = tokenized_run(
        tokenizer_dir, [0.25, text_files["code"], 0.75, text_files["prose"]], tmp_path / "cache", split=[0.8, 0.2, 0]
    )
    result = run_steps(tmp_path / "run", steps=8, config=sections)
    train = result.run.datasets.train
    assert len(train) == 8 * 4  # sized to the samples the run uses
    share = train.source_of.float().mean().item()  # source 1 is the prose
    assert share == 0.75
    valid = result.run.datasets.valid
    code_windows = valid.sources[0]
    assert result.run.datasets.test is None  # a zero share makes no split
    # each source's valid windows are the ones right after its train windows, in the same stream
    train_code = train.sources[0]
    train_tokens = len(train_code) * 16
    offset = (code_windows.tokens.data_ptr() - train_code.tokens.data_ptr()) // code_windows.tokens.element_size()
    assert offset == train_tokens and len(code_windows) == round(len(train_code) / 0.8 * 0.2)


def test_text_data_resumes_exactly(tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path]) -> None:
    from coretrain.testing import stop_and_resume

    sections = tokenized_run(tokenizer_dir, [0.5, text_files["code"], 0.5, text_files["prose"]], tmp_path / "cache")
    straight = run_steps(tmp_path / "straight", steps=8, config=sections)
    first, resumed = stop_and_resume(tmp_path / "split", stop_at=4, steps=8, config=sections)
    assert [m["loss"] for m in first.metrics + resumed.metrics] == [m["loss"] for m in straight.metrics]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"data_path": []}, "data_path: needs a file or a list of files"),
        ({"data_path": ["/no/such.jsonl"]}, "no such file"),
        ({"data_path": ["notes.docx"]}, "expected a .txt, .jsonl, .json, .parquet file"),
        ({"data_path": [0.5, "a.txt", "b.txt"]}, "expected [path, ...] or [weight, path"),
        ({"tokenizer": "/no/tokenizer"}, "is not a directory (a saved tokenizer)"),
        ({"split": [1, 0]}, "split: needs three shares"),
        ({"cache_dir": "FILE"}, "data.options.cache_dir: FILE (or a folder on its path) is a file; name a directory"),
    ],
)
def test_bad_text_options_are_one_clear_error(
    tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path], options: dict[str, Any], message: str
) -> None:
    sections = tokenized_run(tokenizer_dir, [text_files["code"]], tmp_path / "cache")
    if options.get("cache_dir") == "FILE":  # a file where the cache should be
        (tmp_path / "a-file").write_text("")
        options, message = {"cache_dir": str(tmp_path / "a-file")}, message.replace("FILE", str(tmp_path / "a-file"))
    sections["data"]["options"].update(options)
    with pytest.raises(UserError) as caught:
        run_steps(tmp_path, steps=2, config=sections)
    assert message in str(caught.value)


@pytest.mark.slow
def test_two_ranks_share_one_tokenization(tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path]) -> None:
    sections = tokenized_run(tokenizer_dir, [0.5, text_files["code"], 0.5, text_files["prose"]], tmp_path / "cache")
    sections["train"].update(global_batch_size=8, eval_iters=1)
    forked_steps(tmp_path, 2, 4, sections)  # two processes, as torchrun starts them
    # one entry per source, committed, whichever rank came first built it under the lock
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2 and len(list((tmp_path / "cache").glob("*.json"))) == 2
    assert not list((tmp_path / "cache").glob("*.tmp"))


# --------------------------------------------------------------------------- instruction tuning


SFT_RECORDS = [
    {"prompt": "Q: add 2 and 3\nA:", "response": " 5"},
    {"prompt": "Q: say something about the fox\nA:", "response": " The quick brown fox jumps over the lazy dog."},
]


class FirstStep:
    """Records the first step's loss and gradients, and each example's own loss (before the update)."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.grads: dict[str, torch.Tensor] = {}

    @hookimpl
    def before_update(self, run: Any, step: int, loss: torch.Tensor) -> None:
        if step == 1:
            self.loss = loss.item()
            self.grads = {n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None}


def sft_run(tokenizer_dir: Path, path: Path, micro: int, **options: Any) -> dict[str, Any]:
    return {
        "model": {"provider": "hf", "options": {"config": llama_table()}},
        "data": {
            "provider": "hf-sft",
            "options": {"tokenizer": str(tokenizer_dir), "data_path": [str(path)], "split": [1, 0, 0], **options},
        },
        "optimizer": {"lr": 1e-3},
        "train": {"micro_batch_size": micro, "global_batch_size": 2, "log_interval": 1, "eval_iters": 0},
    }


def test_a_padded_batch_and_the_same_examples_unpadded_give_the_same_loss_and_gradients(
    tmp_path: Path, tokenizer_dir: Path
) -> None:

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SFT_RECORDS))
    padded, separate = FirstStep(), FirstStep()
    run_steps(tmp_path / "padded", steps=1, config=sft_run(tokenizer_dir, path, micro=2), plugins={"r": padded})
    run_steps(tmp_path / "separate", steps=1, config=sft_run(tokenizer_dir, path, micro=1), plugins={"r": separate})
    assert padded.loss == pytest.approx(separate.loss, abs=1e-6)
    assert padded.grads.keys() == separate.grads.keys()
    for name, grad in padded.grads.items():
        assert torch.allclose(grad, separate.grads[name], atol=1e-6), name
    # and it is the mean over response tokens, not the mean of the two examples' means
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    counts = [len(tokenizer(r["response"], add_special_tokens=False)["input_ids"]) + 1 for r in SFT_RECORDS]
    assert counts[0] != counts[1]
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path / "padded/out/hf-config")
    )
    torch.manual_seed(7)  # the run's seed: the same initial weights
    model = transformers.AutoModelForCausalLM.from_config(model.config)
    means = []
    for record in SFT_RECORDS:
        prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        full = prompt + tokenizer(record["response"], add_special_tokens=False)["input_ids"] + [2]
        logits = model(input_ids=torch.tensor([full])).logits[0, len(prompt) - 1 : -1]
        means.append(F.cross_entropy(logits, torch.tensor(full[len(prompt) :])).item())
    per_token = (means[0] * counts[0] + means[1] * counts[1]) / sum(counts)
    assert padded.loss == pytest.approx(per_token, abs=1e-5)
    assert abs(padded.loss - sum(means) / 2) > 1e-3


def test_a_batch_padded_to_a_multiple_of_positions_computes_the_same_loss_and_tokens() -> None:
    """What sequence parallelism needs of a dict batch of any length: padding after the last
    position that changes nothing (ids padded, attention masked, labels -100, positions on)."""
    from coretrain_hf.model import padded_to

    hf = tiny_llama().eval()
    batch = {"input_ids": torch.randint(0, VOCAB, (2, 7)), "attention_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2])}
    plain, model = CausalLM(hf), CausalLM(hf)
    model.position_multiple = 4
    with torch.no_grad():
        a, b = plain(**dict(batch)), model(**dict(batch))
    assert torch.allclose(a["loss"], b["loss"], atol=1e-6) and int(a["num_tokens"]) == int(b["num_tokens"]) == 10
    padded = padded_to({"input_ids": batch["input_ids"], "position_ids": torch.arange(7).expand(2, 7)}, 4, 3)
    assert padded["input_ids"].shape == (2, 8) and padded["input_ids"][:, -1].tolist() == [3, 3]
    assert padded["attention_mask"][:, -1].tolist() == [0, 0] and padded["position_ids"][0, -1] == 7
    labels = {"input_ids": batch["input_ids"], "labels": torch.tensor([1, 0])}  # a classifier's, per sample
    assert padded_to(labels, 4, 0)["labels"].tolist() == [1, 0]


@pytest.mark.slow  # 2 forked gloo ranks
def test_padded_batches_under_sequence_parallelism_are_padded_to_the_groups_multiple(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """hf-sft without packing pads a batch to its longest example, any length; sequence
    parallelism splits the positions evenly over the tensor-parallel group. Padded on to a multiple
    of tp_size (labels -100, attention masked out), two ranks train one rank's losses."""
    path = tmp_path / "sft.jsonl"
    records = [{"prompt": f"def f{i}(x):", "response": " return x" + " + 1" * i} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    sections = sft_run(tokenizer_dir, path, micro=2)
    one = run_steps(tmp_path / "one", steps=6, config=sections)
    split = forked_steps(tmp_path / "tp", 2, 6, {**sections, "distributed": {"tp_size": 2}})
    assert split.returncode == 0, split.stderr[-3000:]
    got = [row["loss"] for row in metrics_rows(tmp_path / "tp" / "out")]
    assert got == pytest.approx([row["loss"] for row in one.metrics], rel=1e-5)


def test_chat_records_use_the_chat_template_and_mask_the_prompt(tokenizer_dir: Path) -> None:
    from coretrain_hf.sft import HFSFT
    from coretrain_tokenizer import chat_ids

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    sft = HFSFT(tokenizer=str(tokenizer_dir), data_path=["x.jsonl"])
    messages = [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"}]
    ids, labels = sft.encode({"messages": messages}, tokenizer)
    prompt = chat_ids(tokenizer, messages[:1], generation_prompt=True)
    assert (labels[: len(prompt)] == -100).all() and torch.equal(labels[len(prompt) :], ids[len(prompt) :])
    assert ids.tolist() == chat_ids(tokenizer, messages, generation_prompt=False)
    text = tokenizer.decode(ids[len(prompt) :])
    assert text.replace(" ", "").startswith("5</s>")  # the answer and its end: the only tokens with a loss
    with pytest.raises(UserError, match="has neither 'messages' nor 'prompt' and 'response'"):
        sft.encode({"question": "?"}, tokenizer)


def test_packed_sft_trains_on_windows(tmp_path: Path, tokenizer_dir: Path) -> None:

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SFT_RECORDS * 20))
    sections = sft_run(tokenizer_dir, path, micro=2, packing=True, seq_length=24)
    result = run_steps(tmp_path, steps=6, config=sections)
    sample = result.run.datasets.train[0]
    assert sample["input_ids"].shape == (24,) and (sample["labels"] == -100).any()
    assert result.metrics[-1]["loss"] < result.metrics[0]["loss"]


def test_packed_examples_are_kept_apart_each_scores_as_it_would_alone(tokenizer_dir: Path) -> None:
    """Positions restart per example and the model's packed-sequence support masks attention
    per example: every logit of the second example equals that example run alone, and the
    packed loss is the per-token mean of the examples' own losses."""
    from coretrain_hf.model import CausalLM
    from coretrain_hf.sft import HFSFT, Packed

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    sft = HFSFT(tokenizer=str(tokenizer_dir), data_path=["x.jsonl"], packing=True)
    examples = [sft.encode(record, tokenizer) for record in SFT_RECORDS]
    first, second = (len(ids) for ids, _ in examples)
    packed = Packed(examples, first + second)[0]
    assert packed["position_ids"].tolist() == list(range(first)) + list(range(second))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**llama_table(vocab_size=len(tokenizer)), "num_hidden_layers": 2})
    model = CausalLM(transformers.AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():
        together = model(**{name: tensor[None] for name, tensor in packed.items()})
        alone = [model(input_ids=ids[None], labels=labels[None]) for ids, labels in examples]
        count = sum(int(out["num_tokens"]) for out in alone)
        assert int(together["num_tokens"]) == count
        per_token = sum(float(out["loss"]) * int(out["num_tokens"]) for out in alone) / count
        assert float(together["loss"]) == pytest.approx(per_token, abs=1e-5)
        ids, positions = packed["input_ids"][None], packed["position_ids"][None]
        logits = model.hf(input_ids=ids, position_ids=positions, use_cache=False).logits[0, first:]
        own = model.hf(input_ids=examples[1][0][None], use_cache=False).logits[0]
        torch.testing.assert_close(logits, own, atol=1e-5, rtol=1e-5)
        crossed = model.hf(input_ids=ids, use_cache=False).logits[0, first:]  # packing without the positions
        assert not torch.allclose(crossed, own, atol=1e-3)


# --------------------------------------------------------------------------- LoRA


LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def lora_run(llama_dir: Path) -> dict[str, Any]:
    sections = text_run(llama_dir, eval_iters=0, log_interval=1)
    sections["checkpoint"] = {"save_frozen": False}
    sections["optimizer"] = {"lr": 1e-2}
    return sections


def test_lora_trains_and_saves_only_adapters_and_exports_merged_or_as_adapters(tmp_path: Path, llama_dir: Path) -> None:
    import safetensors.torch

    result = run_steps(tmp_path, steps=6, config=lora_run(llama_dir), tables={"lora": LORA})
    peft_model = result.run.model.hf
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(q_proj.base_layer.weight, base.model.layers[0].self_attn.q_proj.weight)  # base untouched
    assert q_proj.lora_B["default"].weight.abs().sum() > 0  # B starts at zero: it trained
    trained = {id(p) for group in result.run.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for n, p in peft_model.named_parameters() if "lora_" in n}
    saved = torch.load(tmp_path / "out/checkpoints/step_00000006/model.pt", weights_only=True)
    assert saved and all("lora_" in name for name in saved)  # the adapters only
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        expected = result.run.model.eval()(ids, ids)  # the trained model's loss on a batch

    export(result.output_dir, None, tmp_path / "merged", "hf", {"merge_lora": True})
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    delta = q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight * (LORA["alpha"] / LORA["rank"])
    assert torch.allclose(merged.model.layers[0].self_attn.q_proj.weight, q_proj.base_layer.weight + delta, atol=1e-6)
    assert torch.equal(merged.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)

    written = export(result.output_dir, None, tmp_path / "adapters", "hf", {"merge_lora": False})
    assert "PeftModel.from_pretrained" in written
    import peft

    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapters")
    with torch.no_grad():
        for model in (merged, reloaded):
            logits = model(input_ids=ids).logits
            assert torch.allclose(F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)), expected, atol=1e-5)
    assert safetensors.torch.load_file(tmp_path / "adapters/adapter_model.safetensors")  # adapters, not the base


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_lora_run_resumes_exactly_from_adapter_only_checkpoints(
    tmp_path: Path, llama_dir: Path, strategy: str
) -> None:
    """Whole (one ``model.pt``) and sharded (FSDP's DCP files, which a load read strictly, the
    frozen base missing from them: "Missing key(s) in state_dict") checkpoints of the adapters."""
    from coretrain.testing import stop_and_resume

    config = {**lora_run(llama_dir), "distributed": {"strategy": strategy, "backend": "gloo"}}
    straight = run_steps(tmp_path / "straight", steps=6, config=config, tables={"lora": LORA})
    first, resumed = stop_and_resume(tmp_path / "split", stop_at=3, steps=6, config=config, tables={"lora": LORA})
    layout = json.loads((tmp_path / "split/out/checkpoints/step_00000003/checkpoint.json").read_text())["layout"]
    assert layout == {"ddp": "replicated", "fsdp": "sharded"}[strategy]
    assert [m["loss"] for m in first.metrics + resumed.metrics] == [m["loss"] for m in straight.metrics]


def test_a_lora_classifier_trains_its_new_head_saves_it_with_the_adapters_and_exports_it(tmp_path: Path) -> None:
    """LoRA on a pretrained model made a classifier: its ``score`` head is new, so it trains in
    full beside the adapters (peft's SEQ_CLS task, as peft's own fine-tuning sets it), is saved in
    the adapter-only checkpoint, and both exports carry it: the merged model and the PEFT adapter
    directory give the trained model's logits (with the head frozen it stayed random)."""
    import peft

    classifier = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(**{**llama_table(vocab_size=16, pad_token_id=0), "num_labels": 2})
    )
    classifier.save_pretrained(tmp_path / "base")
    sections: dict[str, Any] = {
        "model": {"provider": "hf", "options": {"task": "sequence-classification", "path": str(tmp_path / "base")}},
        "data": {"provider": "test_hf:parity_data"},
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"save_frozen": False},
        "train": {"micro_batch_size": 16, "log_interval": 1, "eval_iters": 0},
    }
    result = run_steps(tmp_path, steps=6, config=sections, tables={"lora": LORA})
    model = result.run.model.hf
    head = model.base_model.model.score.modules_to_save["default"].weight
    assert any(head is p for group in result.run.optimizer.param_groups for p in group["params"])
    assert not torch.equal(head, classifier.score.weight)  # it trained
    saved = torch.load(tmp_path / "out/checkpoints/step_00000006/model.pt", weights_only=True)
    assert any("score.modules_to_save" in name for name in saved)
    ids = torch.randint(1, 16, (4, 8))
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    export(result.output_dir, None, tmp_path / "merged", "hf", {"merge_lora": True})
    export(result.output_dir, None, tmp_path / "adapters", "hf", {"merge_lora": False})
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    base = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapters")
    with torch.no_grad():
        for exported in (merged, reloaded):
            torch.testing.assert_close(exported.eval()(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    typo = {**LORA, "modules_to_save": ["scores"]}
    with pytest.raises(UserError, match=r"plugins.lora.modules_to_save: no module named \['scores'\].*: model, score"):
        run_steps(tmp_path / "typo", steps=1, config=sections, tables={"lora": typo})


@pytest.mark.slow  # 2 forked gloo ranks
def test_lora_adapters_train_on_pipeline_stages_like_one_rank_and_resume_on_one(tmp_path: Path) -> None:
    """LoRA on a Llama cut into pipeline stages (its decoder layers inside a PeftModel's
    ``base_model.model``, where a stage found no layers) trains the one-rank losses; the stages'
    adapter-only checkpoint resumes on one rank as one rank's own would; tensor parallelism,
    whose plan splits no adapter, is one error."""
    from conftest import config_file, gpt_preset

    llama = llama_table(num_attention_heads=4, num_hidden_layers=2)
    preset = {**gpt_preset(tmp_path / "one"), "model": {"provider": "hf", "options": {"config": llama}}}
    tables = {"distributed": {"backend": "gloo"}, "checkpoint": {"save_frozen": False}, "plugins": {"lora": LORA}}
    train = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 6, "log_interval": 1, "eval_iters": 1}
    config = config_file(tmp_path / "lora.toml", preset, tables, **train, eval_interval=3)

    def run(name: str, *sets: str) -> list[str]:
        return ["run", str(config), *(a for s in (f'run.output_dir="{tmp_path / name}"', *sets) for a in ("--set", s))]

    in_one_job(tmp_path, 1, [run("one")], "one")
    tensor_parallel = {"args": run("tp", "distributed.tp_size=2"), "expect": 2}
    job = in_one_job(tmp_path, 2, [run("pp", "distributed.pp_size=2", "train.exit_interval=3"), tensor_parallel], "two")
    assert "LoRA adapters (a PeftModel) are not split over tensor-parallel ranks" in job.stderr
    step_3 = tmp_path / "pp" / "checkpoints" / "step_00000003"
    in_one_job(tmp_path, 1, [run("resumed", f'checkpoint.resume="{step_3}"')], "resumed")

    def figures(name: str) -> dict[tuple[int, str], float]:
        keys = ("loss", "valid/loss")
        return {(row["step"], key): row[key] for row in metrics_rows(tmp_path / name) for key in keys if key in row}

    one, stages, resumed = figures("one"), figures("pp"), figures("resumed")
    assert len(one) == 8 and len(stages) == 4 and len(resumed) == 4  # 6 losses, 2 evaluations
    assert stages == pytest.approx({key: one[key] for key in stages}, rel=1e-5)
    assert resumed == pytest.approx({key: one[key] for key in resumed}, rel=1e-5)
    assert min(step for step, _ in resumed) == 4


def test_lora_on_a_model_of_yours_starts_from_base_weights_and_resumes_adapters_saved_alone(tmp_path: Path) -> None:
    """A base of your own, trained without adapters: ``base_weights`` (its run, or its export) is
    what the adapters start on — ``checkpoint.pretrained`` cannot name it, as peft renames the
    parameters it adapts — and it is read at every start, so adapters saved alone resume exactly."""
    from coretrain.testing import stop_and_resume

    base = run_steps(tmp_path / "base", steps=6)  # the tiny regression, trained in full
    trained = {name: value.clone() for name, value in base.run.model.state_dict().items()}
    export(base.output_dir, None, tmp_path / "base.safetensors", "safetensors", {})
    adapters_only = {"checkpoint": {"save_frozen": False}, "train": {"log_interval": 1, "eval_iters": 0}}
    lora = {"rank": 2, "alpha": 4.0, "target_modules": ["net.0"], "base_weights": str(base.output_dir)}
    straight = run_steps(tmp_path / "straight", steps=6, config=adapters_only, tables={"lora": lora})
    adapted = straight.run.model.base_model.model.net
    assert torch.equal(adapted[0].base_layer.weight, trained["net.0.weight"])  # frozen, so still the base's
    assert torch.equal(adapted[3].weight, trained["net.3.weight"])
    lora["base_weights"] = str(tmp_path / "base.safetensors")
    first, resumed = stop_and_resume(
        tmp_path / "split", stop_at=3, steps=6, config=adapters_only, tables={"lora": lora}
    )
    assert [m["loss"] for m in first.metrics + resumed.metrics] == [m["loss"] for m in straight.metrics]
    with pytest.raises(
        UserError, match=r"trained without LoRA adapters, .*: it is the base, \[plugins.lora\] base_weights"
    ):
        pretrained = {**adapters_only, "checkpoint": {"pretrained": str(base.output_dir)}}
        run_steps(tmp_path / "pretrained", steps=2, config=pretrained, tables={"lora": {"target_modules": ["net.0"]}})
    continued = {**adapters_only, "checkpoint": {"save_frozen": False, "pretrained": str(straight.output_dir)}}
    again = run_steps(
        tmp_path / "continued", steps=1, config={**continued, "optimizer": {"lr": 0.0}}, tables={"lora": lora}
    )
    adapter = "base_model.model.net.0.lora_A.default.weight"  # a LoRA run's checkpoint is what pretrained takes
    assert torch.equal(again.run.model.state_dict()[adapter], straight.run.model.state_dict()[adapter])
    with pytest.raises(UserError, match=r"plugins.lora.base_weights: .* does not fit the model .*other shapes"):
        wider = {**adapters_only, "model": {"options": {"width": 8}}}
        run_steps(tmp_path / "wider", steps=2, config=wider, tables={"lora": {**lora, "target_modules": ["net.0"]}})


def test_lora_target_modules_that_match_nothing_name_the_linear_modules(tmp_path: Path, llama_dir: Path) -> None:
    with pytest.raises(UserError, match=r"plugins.lora.target_modules: .*the model's Linear modules: .*q_proj"):
        run_steps(tmp_path, steps=2, config=lora_run(llama_dir), tables={"lora": {"target_modules": ["attn_qkv"]}})


@pytest.mark.slow
def test_the_hf_finetune_example_trains_exports_and_loads_back(tmp_path: Path) -> None:
    from conftest import REPO, metrics_rows, run_cli, run_here

    example = REPO / "examples" / "hf-finetune"
    assets = tmp_path / "assets"
    made = run_cli(str(example / "make_assets.py"), str(assets), cwd=tmp_path, command=(sys.executable,))
    assert made.returncode == 0 and not made.stderr, made.stderr  # the libraries' import-time lines kept off
    out = tmp_path / "run"
    overrides = [
        f"run.output_dir={json_str(out)}",
        f"model.options.path={json_str(assets / 'tiny-llama')}",
        f"tokenizer.path={json_str(assets / 'tokenizer')}",
        f"data.options.data_path=[{json_str(assets / 'instructions.jsonl')}]",
        # a fifth of the example's steps: enough to learn, export and load back; the suite's time
        "train.train_iters=40",
        "train.eval_interval=20",
        "train.log_interval=10",
        "run.threads=1",  # the example's 2 would stay set in this test worker, and spin on a busy machine
    ]
    # the example's own scripts run as a user runs them; the coretrain commands in this process
    sets = [a for o in overrides for a in ("--set", o)]
    untrained = [f"run.output_dir={json_str(tmp_path / 'untrained')}", "train.skip_train=true"]
    before = run_here(
        "run", str(example / "finetune.toml"), *sets, *(a for o in untrained for a in ("--set", o)), cwd=REPO
    )
    assert before.returncode == 0, before.stderr
    trained = run_here("run", str(example / "finetune.toml"), *sets, cwd=REPO)
    assert trained.returncode == 0, trained.stderr
    valid = [r["valid/loss"] for r in metrics_rows(out) if "valid/loss" in r]
    (valid_before,) = [r["valid/loss"] for r in metrics_rows(tmp_path / "untrained") if "valid/loss" in r]
    print(f"validation loss: {valid_before:.4f} before, {valid[0]:.4f} at step 20, {valid[-1]:.4f} after")
    assert valid[-1] < valid_before  # like with like: the same validation set, before and after
    exported = run_here(
        "checkpoint", "export", str(out), "--format", "hf", "--merge-lora", "--to", str(tmp_path / "hf"), cwd=tmp_path
    )
    assert exported.returncode == 0 and "with the LoRA adapters merged" in exported.stdout, exported.stderr
    answered = run_cli(str(example / "load_back.py"), str(tmp_path / "hf"), cwd=tmp_path, command=(sys.executable,))
    assert answered.returncode == 0 and answered.stdout.count("->") == 2, answered.stderr
    assert not answered.stderr, answered.stderr


def json_str(path: Path) -> str:
    return json.dumps(str(path))  # a TOML string for --set


def test_fp8_keeps_the_models_output_head_in_high_precision(tmp_path: Path, llama_dir: Path) -> None:
    result = run_steps(tmp_path, steps=4, config=text_run(llama_dir, eval_iters=0, log_interval=2), tables={"fp8": {}})
    converted = result.run.plugins.get("fp8").converted  # type: ignore[union-attr]
    assert "hf.model.layers.0.self_attn.q_proj" in converted and len(converted) == 14  # 7 Linear per block
    assert not any("lm_head" in name for name in converted)
    assert all(m["loss"] == m["loss"] for m in result.metrics)  # finite under emulated FP8


def test_the_compile_plugin_compiles_an_hf_model(tmp_path: Path, llama_dir: Path) -> None:
    """dynamo traces the transformers model and AOTAutograd its backward, through the plugin, and
    the losses are eager's (aot_eager: inductor's C++ build is test_feature_plugins.py's, on a
    small model)."""
    config = text_run(llama_dir, eval_iters=0, log_interval=2)
    eager = run_steps(tmp_path / "eager", steps=4, config=config)
    compiled = run_steps(tmp_path / "compiled", steps=4, config=config, tables={"compile": {"backend": "aot_eager"}})
    assert compiled.run.model._compiled_call_impl is not None  # compiled in place: names unchanged
    for a, b in zip(eager.metrics, compiled.metrics):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


# --------------------------------------------------------------------------- predict: generate


@pytest.mark.slow  # builds a run and generates: about 10 s
def test_predict_generates_for_prompts_as_transformers_does(tmp_path: Path, tokenizer_dir: Path, cli: Any) -> None:
    """A downloaded model directory with its tokenizer; `coretrain predict --data prompts.jsonl`
    writes each prompt's greedy continuation, the same text transformers' generate gives; a
    temperature samples, the same draws run to run; with FSDP on two ranks, where one rank's
    prompt ends at once (its first token is the model's EOS), the ranks generate in step."""
    model_dir = tmp_path / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    first = hf.generate(**tokenizer("x", return_tensors="pt", add_special_tokens=False), max_new_tokens=1)[0, -1]
    hf.generation_config.eos_token_id = hf.config.eos_token_id = int(first)  # "x" ends at once
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    hf.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = ["def add(a, b):", "The river", "x"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    sections = {k: v for k, v in text_run(model_dir).items() if k != "train"}
    config = write_config(tmp_path / "c.toml", {"run": {"output_dir": str(tmp_path / "out"), "threads": 1}, **sections})
    result = cli(
        "predict", str(config), "--checkpoint", "none", "--data", str(tmp_path / "prompts.jsonl"),
        "--max-new-tokens", "6", "--batch-size", "2", "--out", str(tmp_path / "gen.jsonl"), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in written] == prompts
    for record in written:
        ids = tokenizer(record["prompt"], return_tensors="pt", add_special_tokens=False)
        expected = hf.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert record["completion"] == tokenizer.decode(
            expected[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
        )
    assert len(written[0]["completion"]) > len(written[2]["completion"]) == len(tokenizer.decode([first]))

    predict = ["predict", str(config), "--checkpoint", "none", "--data", str(tmp_path / "prompts.jsonl")]
    hot = [*predict, "--max-new-tokens", "6", "--temperature", "1.5"]
    sampled = [cli(*hot, "--out", str(tmp_path / f"s{i}.jsonl"), cwd=tmp_path).returncode for i in (1, 2)]
    assert sampled == [0, 0] and (tmp_path / "s1.jsonl").read_text() == (tmp_path / "s2.jsonl").read_text()
    assert [json.loads(line) for line in (tmp_path / "s1.jsonl").read_text().splitlines()] != written
    chat = [{"role": "user", "content": "def add(a, b):"}]  # a record of "messages", rendered by the template
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    chat_data = [
        "--data",
        str(tmp_path / "chat.jsonl"),
        "--max-new-tokens",
        "6",
        "--out",
        str(tmp_path / "reply.jsonl"),
    ]
    answered = cli(*predict[:4], *chat_data, cwd=tmp_path)
    assert answered.returncode == 0, answered.stderr
    ids = torch.tensor([tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]])
    expected = hf.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    reply = json.loads((tmp_path / "reply.jsonl").read_text())
    assert reply["prompt"] == chat and reply["completion"] == tokenizer.decode(expected[0, ids.shape[1] :])
    fsdp = ["--set", 'distributed.strategy="fsdp"', "--batch-size", "1", "--max-new-tokens", "6"]
    tensor = ["--set", "distributed.tp_size=2", "--max-new-tokens", "6", "--out", str(tmp_path / "tp.jsonl")]
    jobs = [[*predict, *fsdp, "--out", str(tmp_path / "fsdp.jsonl")], [*predict, *tensor]]  # "x" on FSDP's rank 0
    in_one_job(tmp_path, 2, jobs, "fsdp")
    for name in ("fsdp", "tp"):
        assert [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()] == written


# --------------------------------------------------------------------------- mixtures of experts

MOE_TABLES = {
    "mixtral": {**llama_table(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)},
    "qwen2_moe": {
        **llama_table(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        "shared_expert_intermediate_size": 32,
    },
}


@pytest.mark.parametrize("kind", sorted(MOE_TABLES))
def test_a_mixture_of_experts_trains_with_its_load_balancing_loss_as_transformers_adds_it(
    tmp_path: Path, kind: str
) -> None:
    table = {**MOE_TABLES[kind], "output_router_logits": True, "router_aux_loss_coef": 0.02, "vocab_size": VOCAB}
    config = transformers.AutoConfig.for_model(**table)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, VOCAB, (2, 16))
    ours = CausalLM(hf)(input_ids=ids)
    assert torch.allclose(ours["loss"], hf(input_ids=ids, labels=ids).loss)  # CE + coef × aux, as transformers does
    assert torch.allclose(ours["loss"], ours["lm_loss"] + ours["moe_aux_loss"])
    sections = text_run(Path("unused"))
    sections["model"]["options"] = {"config": {k: v for k, v in table.items() if k != "vocab_size"}}
    result = run_steps(tmp_path, steps=4, config={**sections, "train": {**sections["train"], "log_interval": 2}})
    last = result.metrics[-1]
    assert last["loss"] == pytest.approx(last["train/lm_loss"] + last["train/moe_aux_loss"], rel=1e-6)
    assert 0 <= last["train/moe/layer0/load_min"] <= 0.25 <= last["train/moe/layer0/load_max"] <= 1


def tiny_moe(kind: str, layers: int) -> Any:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**hf_moe_table(kind, layers), vocab_size=VOCAB)
    return transformers.AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize("kind", sorted(HF_MOE))
def test_routable_experts_handed_their_routing_compute_what_transformers_does(kind: str) -> None:
    """What expert parallelism does with a Hugging Face experts module, on one rank: its forward
    hands the routing to ``dispatch``, which runs each (token, expert) pair through
    ``expert_rows`` and sums the weighted rows — the module's own output."""
    from coretrain_hf.experts import make_routable, stacked_experts

    hf = tiny_moe(kind, layers=2)
    experts = stacked_experts(hf)
    assert experts and all(e.gate_up_proj.dim() == 3 for e in experts)
    module = experts[0]
    hidden = torch.randn(10, hf.config.hidden_size)
    index = torch.stack([torch.randperm(module.num_experts)[:2] for _ in range(10)])
    weights = torch.rand(10, 2)
    expected = module(hidden, index, weights)

    def locally(experts: Any, tokens: torch.Tensor, kept: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        token_idx, expert_idx = kept.nonzero(as_tuple=True)
        rows = experts.expert_rows(tokens[token_idx], expert_idx) * weights[token_idx, expert_idx, None]
        return torch.zeros_like(tokens).index_add(0, token_idx, rows)

    make_routable(module)
    assert module.n_experts == module.num_experts and module(hidden, index, weights).equal(expected)  # unchanged
    module.dispatch = locally
    torch.testing.assert_close(module(hidden, index, weights), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_stages_of_a_mixture_of_experts_compute_its_load_balancing_loss_over_every_layer(kind: str) -> None:
    """Transformers' load-balancing loss is one formula over every layer's routers, not a sum of
    per-layer losses: stages cut at each layer hand their routing sums on, and the last stage's
    loss — and every router's gradient through it — is the whole model's."""
    from coretrain_hf.stages import pipeline_split

    hf = tiny_moe(kind, layers=3)
    hf.config._attn_implementation = "sdpa"
    model = CausalLM(hf)
    ids, targets = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    whole = model(ids, targets)
    whole["loss"].backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if "gate" in name}
    model.zero_grad()
    split = pipeline_split(model)
    stages = [split["stage"](range(i, i + 1), i == 0, i == 2) for i in range(3)]
    hidden, sums = stages[0](ids)
    hidden, sums = stages[1](hidden, sums)
    loss = split["loss"](stages[2](hidden, sums), targets)
    torch.testing.assert_close(loss, whole["loss"])
    loss.backward()
    for name, grad in expected.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, msg=name)
    values = split["values"](stages[0], 1)
    assert values["moe_aux_loss"] == pytest.approx(whole["moe_aux_loss"].item(), rel=1e-6)
    assert values["moe/layer2/load_max"] == pytest.approx(whole["moe/layer2/load_max"].item())


# --------------------------------------------------------------------------- [tokenizer]: the run's one tokenizer


def moved_to_tokenizer_section(sections: dict[str, Any]) -> dict[str, Any]:
    """The same run with its tokenizer named in ``[tokenizer]`` instead of the provider's option."""
    options = {key: value for key, value in sections["data"]["options"].items() if key != "tokenizer"}
    tokenizer = {"path": sections["data"]["options"]["tokenizer"]}
    return {**sections, "data": {**sections["data"], "options": options}, "tokenizer": tokenizer}


def test_the_tokenizer_section_is_the_text_providers_tokenizer(
    tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path]
) -> None:
    """hf-text and hf-sft read [tokenizer] path as they read their own option: the same samples,
    the same losses; naming two different tokenizers, or none, is one error."""
    sections = tokenized_run(tokenizer_dir, [text_files["code"]], tmp_path / "cache")
    own = run_steps(tmp_path / "own", steps=3, config=sections)
    shared = run_steps(tmp_path / "shared", steps=3, config=moved_to_tokenizer_section(sections))
    assert [t.tolist() for t in shared.run.datasets.train[0]] == [t.tolist() for t in own.run.datasets.train[0]]
    assert [m["loss"] for m in shared.metrics] == [m["loss"] for m in own.metrics]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SFT_RECORDS * 4))
    sft = run_steps(tmp_path / "sft", steps=2, config=moved_to_tokenizer_section(sft_run(tokenizer_dir, path, 2)))
    assert sft.exit_code == 0 and sft.run.datasets.vocab_size == len(
        transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    )
    other = tmp_path / "other-tokenizer"
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(other)
    with pytest.raises(
        UserError, match=r"data\.options\.tokenizer \(.*\) and tokenizer\.path \(.*\) name two tokenizers"
    ):
        run_steps(tmp_path / "two", steps=1, config={**sections, "tokenizer": {"path": str(other)}})
    neither = moved_to_tokenizer_section(sections)
    del neither["tokenizer"]
    with pytest.raises(UserError, match=r'data\.options\.tokenizer: no tokenizer: set \[tokenizer\] path = "DIR"'):
        run_steps(tmp_path / "none", steps=1, config=neither)


CUSTOM_TOKENIZER = '''
import os

from transformers import PreTrainedTokenizerFast


class ShoutingTokenizer(PreTrainedTokenizerFast):
    """A tokenizer with code of its own, as a hub repository may ship one."""

    def __init__(self, *args, **kwargs):
        os.environ["CORETRAIN_TEST_CUSTOM_TOKENIZER_RAN"] = "1"  # the test sees its code ran
        super().__init__(*args, **kwargs)
'''


def test_a_tokenizer_that_ships_code_runs_only_with_trust_remote_code(
    tmp_path: Path, tokenizer_dir: Path, text_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CORETRAIN_TEST_CUSTOM_TOKENIZER_RAN", raising=False)
    custom = tmp_path / "custom-tokenizer"
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(custom)
    (custom / "shouting.py").write_text(CUSTOM_TOKENIZER)
    settings = json.loads((custom / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": [None, "shouting.ShoutingTokenizer"]}
    settings["tokenizer_class"] = "ShoutingTokenizer"  # no class of transformers' own to fall back on
    (custom / "tokenizer_config.json").write_text(json.dumps(settings))
    sections = moved_to_tokenizer_section(tokenized_run(custom, [text_files["code"]], tmp_path / "cache"))
    with pytest.raises(UserError, match=r"tokenizer\.path: the tokenizer in .*custom-tokenizer ships code of its own"):
        run_steps(tmp_path / "refused", steps=1, config=sections)
    sections["tokenizer"]["trust_remote_code"] = True
    assert "CORETRAIN_TEST_CUSTOM_TOKENIZER_RAN" not in os.environ  # refused before any of its code ran
    trusted = run_steps(tmp_path / "trusted", steps=2, config=sections)
    assert trusted.exit_code == 0 and os.environ["CORETRAIN_TEST_CUSTOM_TOKENIZER_RAN"] == "1"


CUSTOM_MODEL = """
from transformers import LlamaConfig, LlamaForCausalLM


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny-custom"


class TinyCustomLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


def test_a_model_that_ships_code_runs_only_with_trust_remote_code(tmp_path: Path, llama_dir: Path) -> None:
    """The one key, [tokenizer] trust_remote_code, lets the hf provider run a custom architecture's code."""
    import shutil

    custom = tmp_path / "custom-model"
    shutil.copytree(llama_dir, custom)
    (custom / "tiny_custom.py").write_text(CUSTOM_MODEL)
    settings = json.loads((custom / "config.json").read_text())
    settings["model_type"] = "tiny-custom"
    settings["auto_map"] = {
        "AutoConfig": "tiny_custom.TinyCustomConfig",
        "AutoModelForCausalLM": "tiny_custom.TinyCustomLM",
    }
    (custom / "config.json").write_text(json.dumps(settings))
    sections = text_run(custom)
    with pytest.raises(UserError, match=r"model\.options\.path: the model in .*custom-model ships code of its own"):
        run_steps(tmp_path / "refused", steps=1, config=sections)
    trusted = run_steps(tmp_path / "trusted", steps=2, config={**sections, "tokenizer": {"trust_remote_code": True}})
    assert type(trusted.run.model.hf).__name__ == "TinyCustomLM" and trusted.exit_code == 0


def test_a_new_models_vocabulary_is_padded_as_megatron_pads_it(tmp_path: Path) -> None:
    """make_vocab_size_divisible_by: the data's 256 byte ids in an embedding of 300 rows (a
    multiple of 100 × tp_size); the data's ids are unchanged, the rest are never produced."""
    from coretrain_tokenizer import padded_vocab

    sections = text_run(tmp_path)
    sections["model"] = {"provider": "hf", "options": {"config": llama_table(), "make_vocab_size_divisible_by": 100}}
    result = run_steps(tmp_path / "run", steps=2, config=sections)
    assert result.run.model.hf.config.vocab_size == 300 and result.run.datasets.vocab_size == 256
    assert [padded_vocab(256, 128, tp) for tp in (1, 2, 4)] == [256, 256, 512]
    assert [padded_vocab(50257, 128, 1), padded_vocab(50257, None, 8)] == [50304, 50257]  # GPT-2's, Megatron's


NO_PLUGINS = types.SimpleNamespace(get=lambda name: None)
"""A run's plugins where none is enabled (the ``tokenizer`` plugin's Megatron types among them)."""


def test_predict_encodes_prompts_with_the_runs_tokenizer(tokenizer_dir: Path, llama_dir: Path) -> None:
    """A model directory without a tokenizer and a data provider without one: [tokenizer] path
    is the tokenizer the prompts are encoded with (before it, `predict --data` had none); a data
    provider's tokenizer that is no transformers one (text-bytes' bytes) is left to coretrain's
    own sampler."""
    import types

    from coretrain_hf.generate import prompt_tokenizer
    from coretrain_text_bytes import ByteTokenizer

    from coretrain.config import Config

    config = Config()
    for data_tokenizer in (None, ByteTokenizer()):
        data = types.SimpleNamespace(tokenizer=data_tokenizer)
        run = types.SimpleNamespace(config=config, plugins=NO_PLUGINS, datasets=data)
        assert prompt_tokenizer(run, str(llama_dir)) is None
    config.tokenizer.path = str(tokenizer_dir)
    tokenizer = prompt_tokenizer(types.SimpleNamespace(config=config, plugins=NO_PLUGINS), str(llama_dir))
    assert (
        tokenizer("def f(x)")["input_ids"]
        == transformers.AutoTokenizer.from_pretrained(tokenizer_dir)("def f(x)")["input_ids"]
    )


CRAFTED_CODE = """
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

Path({marker!r}).write_text("ran")  # what a crafted directory would do: anything, on import


class CraftedConfig(LlamaConfig):
    model_type = "crafted"


class CraftedLM(LlamaForCausalLM):
    config_class = CraftedConfig


class CraftedTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture(scope="module")
def exportable_run(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    """A finished hf run, copied by each test that crafts it."""
    root = tmp_path_factory.mktemp("exportable")
    settings = text_run(llama_dir, eval_iters=0, log_interval=1)
    return run_steps(root, steps=2, config=settings, tables={"metrics-file": {}}).output_dir


def crafted_run(tmp_path: Path, exportable_run: Path, tokenizer_dir: Path, planted_in: str) -> tuple[Path, Path]:
    """A copy of a finished run whose hf-config (or a tokenizer directory its manifest names)
    ships code that writes the returned marker file when imported; its manifest says trust it."""
    import shutil

    run_dir, marker = tmp_path / "run", tmp_path / "code-ran"
    shutil.copytree(exportable_run, run_dir)
    code = CRAFTED_CODE.format(marker=str(marker))
    manifest_path = next((run_dir / "checkpoints").glob("step_*")) / "checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["tokenizer"] = {"path": None, "trust_remote_code": True}  # the directory's word
    if planted_in == "hf-config":
        (run_dir / "hf-config" / "crafted.py").write_text(code)
        hf_config = json.loads((run_dir / "hf-config" / "config.json").read_text())
        hf_config["model_type"] = "crafted"
        hf_config["auto_map"] = {"AutoConfig": "crafted.CraftedConfig", "AutoModelForCausalLM": "crafted.CraftedLM"}
        (run_dir / "hf-config" / "config.json").write_text(json.dumps(hf_config))
    else:  # the manifest names a tokenizer directory that ships code
        planted = tmp_path / "planted-tokenizer"
        transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(planted)
        (planted / "crafted.py").write_text(code)
        settings = json.loads((planted / "tokenizer_config.json").read_text())
        settings["auto_map"] = {"AutoTokenizer": [None, "crafted.CraftedTokenizer"]}
        settings["tokenizer_class"] = "CraftedTokenizer"
        (planted / "tokenizer_config.json").write_text(json.dumps(settings))
        manifest["config"]["tokenizer"]["path"] = str(planted)
    manifest_path.write_text(json.dumps(manifest))
    return run_dir, marker


@pytest.mark.parametrize("planted_in", ["hf-config", "tokenizer"])
def test_export_runs_no_code_a_crafted_run_directory_ships(
    tmp_path: Path, exportable_run: Path, tokenizer_dir: Path, planted_in: str, cli: Any
) -> None:
    """A run directory someone else wrote (a shared disk, a download) names classes of its own
    (``auto_map``) and says ``trust_remote_code = true`` in its manifest: export runs none of its
    code unless the user passes ``--trust-remote-code``."""
    run_dir, marker = crafted_run(tmp_path, exportable_run, tokenizer_dir, planted_in)
    refused = cli("checkpoint", "export", str(run_dir), "--format", "hf", "--to", str(tmp_path / "out"), cwd=tmp_path)
    assert refused.returncode == 2 and not marker.exists(), refused.stderr
    assert "Traceback" not in refused.stderr
    assert "ships code of its own to run; pass --trust-remote-code" in refused.stderr
    trusted = cli(
        "checkpoint", "export", str(run_dir), "--format", "hf", "--to", str(tmp_path / "trusted"),
        "--trust-remote-code", cwd=tmp_path,
    )  # fmt: skip
    assert trusted.returncode == 0 and marker.read_text() == "ran", trusted.stderr  # the user's flag, and only it


@pytest.mark.parametrize("planted_in", ["hf-config", "tokenizer"])
def test_no_other_command_runs_code_a_crafted_run_directory_ships(
    tmp_path: Path, exportable_run: Path, tokenizer_dir: Path, llama_dir: Path, planted_in: str, cli: Any
) -> None:
    """Every command that reads a run directory's manifest or files — checkpoint list, report,
    predict from its checkpoint, a run that starts from it (checkpoint.pretrained) and one that
    resumes in it — with the user's own config: none imports what the directory names."""
    run_dir, marker = crafted_run(tmp_path, exportable_run, tokenizer_dir, planted_in)
    step = next((run_dir / "checkpoints").glob("step_*"))
    mine = write_config(tmp_path / "mine.toml", tiny_config(run_dir, **text_run(llama_dir, eval_iters=0)))
    fresh = tiny_config(tmp_path / "fresh", **text_run(llama_dir, eval_iters=0), checkpoint={"pretrained": str(step)})
    commands = [
        ("checkpoint", "list", str(run_dir)),
        ("report", str(run_dir), "--out", str(tmp_path / "report")),
        ("predict", str(mine), "--checkpoint", str(step), "--split", "train", "--out", str(tmp_path / "p.jsonl")),
        ("run", str(write_config(tmp_path / "fresh.toml", fresh)), "--set", "train.train_iters=1"),
        ("run", str(mine), "--set", "train.train_iters=3"),  # resumes in the crafted directory
    ]
    refused_resume = planted_in == "tokenizer"  # (the manifest names a tokenizer this config does not: refused)
    for command in commands:
        result = cli(*command, cwd=tmp_path)
        assert "Traceback" not in result.stderr, (command, result.stderr[-2000:])
        assert not marker.exists(), command
        expected = 2 if refused_resume and command is commands[-1] else 0
        assert result.returncode == expected, (command, result.stderr[-2000:])
