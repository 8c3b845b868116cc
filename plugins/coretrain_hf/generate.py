"""Answers to texts for ``coretrain predict --data texts.jsonl``: a causal LM's ``generate``, a
sequence classifier's class (as transformers' ``text-classification`` pipeline gives it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coretrain_tokenizer import load_tokenizer, megatron_type, run_tokenizer

from coretrain import Run, UserError
from coretrain_hf.model import wrapped_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
NEEDED_BY = "coretrain predict"


def prompt_tokenizer(run: Run, model_path: str | None) -> Any:
    """The run's ``[tokenizer]``; else the model directory's own (a downloaded model carries
    one); else the data's."""
    trusted = run.config.tokenizer.trust_remote_code
    if run.config.tokenizer.path is not None or megatron_type(run.plugins.get("tokenizer")) is not None:
        return run_tokenizer(run, None, "tokenizer.path", NEEDED_BY)[0]
    if model_path is not None and any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES):
        return load_tokenizer(model_path, "model.options.path", NEEDED_BY, trusted)
    data_tokenizer = dict(run.config.data.options).get("tokenizer")
    if not isinstance(data_tokenizer, str):
        raise UserError(
            "predict --data: no tokenizer for the prompts: no [tokenizer] path, model.options.path has "
            "none, and data.options.tokenizer is not set"
        )
    return load_tokenizer(data_tokenizer, "data.options.tokenizer", NEEDED_BY, trusted)


def padding_tokenizer(run: Run, model_path: str | None) -> Any:
    """:func:`prompt_tokenizer`, with a pad token (its EOS, else its UNK) when it has none:
    texts of different lengths go through the model together."""
    tokenizer = prompt_tokenizer(run, model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def generate(run: Run, model_path: str | None, prompts: list[str], options: dict[str, Any]) -> list[dict[str, Any]]:
    """Greedy (or sampled, with ``do_sample``) continuations, left-padded as decoders need."""
    tokenizer = padding_tokenizer(run, model_path)
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(run.device)
    settings: dict[str, Any] = {
        "max_new_tokens": options.get("max_new_tokens") or 32,
        "do_sample": bool(options.get("do_sample")),
        "pad_token_id": tokenizer.pad_token_id,
    }
    settings.update({name: options[name] for name in ("temperature", "top_p") if options.get(name) is not None})
    hf = wrapped_model(run.unwrapped_model)
    produced = hf.generate(**encoded, **settings)
    completions = tokenizer.batch_decode(produced[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    return [{"prompt": prompt, "completion": text} for prompt, text in zip(prompts, completions)]


def classify(run: Run, model_path: str | None, texts: list[str]) -> list[dict[str, Any]]:
    """Each text's class: its id (``prediction``), its name in the config's ``id2label``
    (``label``), its probability (``score``) and the logits (``output``). Tokenized as the
    training data was by ``tokenizer(text)``: special tokens added, padded on the right."""
    import torch

    tokenizer = padding_tokenizer(run, model_path)
    encoded = tokenizer(texts, return_tensors="pt", padding=True, truncation=True).to(run.device)
    hf = wrapped_model(run.unwrapped_model)
    with torch.no_grad():
        logits = hf(**encoded).logits.float()
    probabilities, classes = logits.softmax(-1).max(-1)
    names = getattr(hf.config, "id2label", None) or {}
    records = []
    for text, chosen, probability, output in zip(texts, classes.tolist(), probabilities.tolist(), logits.tolist()):
        label = names.get(chosen, str(chosen))
        records.append({"prompt": text, "prediction": chosen, "label": label, "score": probability, "output": output})
    return records
