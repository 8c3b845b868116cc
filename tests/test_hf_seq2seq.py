"""Encoder-decoders (T5: translation, summaries) and the transformers models a provider of the
user's returns: texts answered by ``generate``, a split's records holding each sample's own
decoder positions, and every labelled token of a step weighing the same however the step is
cut into micro-batches (the Trainer's ``num_items_in_batch``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import predict_texts

from coretrain.testing import run_steps, tiny_config, write_config

transformers = pytest.importorskip("transformers")
from test_hf import llama_table, review_data  # noqa: E402  (its reviews, a label per token)

WORDS = "alpha beta gamma delta eps zeta eta theta".split()
sys.modules.setdefault("test_hf_seq2seq", sys.modules[__name__])  # its providers, by this name


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
    model = {"provider": "test_hf_seq2seq:seq2seq", "options": {"path": str(tmp_path / "t5")}}
    if provider == "hf":
        model = {"provider": "hf", "options": {"path": str(tmp_path / "t5"), "task": "seq2seq-lm"}}
    sections = {
        "model": model,
        "data": {"provider": "test_hf_seq2seq:rewritten", "options": {"tokenizer": str(tokenizer)}},
        "tokenizer": {"path": str(tokenizer)},
        "optimizer": {"lr": 3e-2},
        "train": {"micro_batch_size": 8, "eval_iters": 0},
    }
    result = run_steps(tmp_path, steps=40, config=sections, autoload=(*BEHAVIOUR, "transformers-models"))
    run_config = write_config(tmp_path / "c.toml", tiny_config(result.output_dir, **sections))
    texts = ["alpha beta gamma", "zeta eta", "theta eps delta beta alpha"]
    done, records = predict_texts(run_config, texts, tmp_path)
    assert done.returncode == 0, done.stderr
    answers = [record["completion"] for record in records]
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
        data = "test_hf_seq2seq:rewritten"
    elif kind == "causal-lm":
        llama = transformers.LlamaConfig(**llama_table(vocab_size=300, pad_token_id=2))
        transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "model")
        data = "test_hf_seq2seq:reviews_to_continue"
    elif kind == "gpt2":  # no loss_type: counted as the Trainer counts it, unshifted, and handed to its loss
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300, pad_token_id=2, **no_dropout)
        transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "model")
        data = "test_hf_seq2seq:reviews_to_continue"
    else:
        names = {0: "bad", 1: "good"}
        table = llama_table(vocab_size=300, pad_token_id=2, num_labels=2, id2label=names, classifier_dropout=0.0)
        llama = transformers.LlamaConfig(**table)
        transformers.LlamaForTokenClassification(llama).save_pretrained(tmp_path / "model")
        data = "test_hf:review_data"
    providers = {"seq2seq": "seq2seq", "causal-lm": "causal_lm", "gpt2": "causal_lm", "tagger": "token_classifier"}
    model = {"provider": f"test_hf_seq2seq:{providers.get(kind)}", "options": {"path": str(tmp_path / "model")}}
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
