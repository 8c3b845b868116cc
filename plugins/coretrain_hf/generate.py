"""Answers to texts for ``coretrain predict --data texts.jsonl``: a causal LM's ``generate``, a
sequence classifier's class (as transformers' ``text-classification`` pipeline gives it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from coretrain_predict.sampling import complete, is_transformers_tokenizer, prompt_ids, samples
from coretrain_tokenizer import load_tokenizer, megatron_type, run_tokenizer

from coretrain import Run, UserError, is_sharded
from coretrain_hf.model import adapted_model, wrapped_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
NEEDED_BY = "coretrain predict"


@contextlib.contextmanager
def root_gathered(run: Run) -> Iterator[None]:
    """FSDP shards the run's model at its root, coretrain's wrapper around the transformers model;
    ``generate`` goes around the wrapper, and so around the root's gathering of its own parameters
    (embeddings, head): they are gathered here (each block still gathers its own)."""
    unshard: Callable[[], Any] | None = getattr(run.model, "unshard", None)
    if unshard is None:  # not FSDP
        yield
        return
    unshard()
    try:
        yield
    finally:
        run.model.reshard()  # type: ignore[operator]  # FSDPModule's


def prompt_tokenizer(run: Run, model_path: str | None) -> Any | None:
    """The run's ``[tokenizer]``; else the model directory's own (a downloaded model carries
    one); else the data's when it is a transformers tokenizer (``Datasets.tokenizer``); else None."""
    trusted = run.config.tokenizer.trust_remote_code
    if run.config.tokenizer.path is not None or megatron_type(run.plugins.get("tokenizer")) is not None:
        return run_tokenizer(run, None, "tokenizer.path", NEEDED_BY)[0]
    if model_path is not None and any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES):
        return load_tokenizer(model_path, "model.options.path", NEEDED_BY, trusted)
    data_tokenizer = run.datasets.tokenizer
    return data_tokenizer if is_transformers_tokenizer(data_tokenizer) else None


def padding_tokenizer(run: Run, model_path: str | None) -> Any | None:
    """:func:`prompt_tokenizer`, with a pad token (its EOS, else its UNK) when it has none:
    texts of different lengths go through the model together."""
    tokenizer = prompt_tokenizer(run, model_path)
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def answer_texts(
    run: Run, model_path: str | None, batch: dict[str, Any], options: dict[str, Any]
) -> list[dict[str, Any]] | None:
    """Texts (``coretrain predict --data``) answered as transformers' pipeline for the model's
    kind answers them: a sequence classifier's class, a tagger's class per token, a masked LM's
    masks filled, ``generate``'s text from a model that generates (a causal LM, an
    encoder-decoder); None for another kind (coretrain-plugins' own answer then)."""
    hf = adapted_model(wrapped_model(run.unwrapped_model))
    kind, texts = type(hf).__name__, batch["prompt"]  # (FSDP2's class keeps the ending)
    if kind.endswith("ForSequenceClassification"):
        return classify(run, model_path, texts)
    if kind.endswith("ForTokenClassification"):
        return tag(run, model_path, texts)
    if kind.endswith("ForMaskedLM"):
        return fill_masks(run, model_path, texts)
    return generate(run, model_path, batch, options) if hf.can_generate() else None


def generate(
    run: Run, model_path: str | None, batch: dict[str, Any], options: dict[str, Any]
) -> list[dict[str, Any]] | None:
    """transformers' ``generate``: greedy, or sampled when ``options`` asks (a temperature or
    top-p alone samples, as ``coretrain predict --help`` says); a decoder's completion follows its
    prompt, an encoder-decoder's (T5, BART: translation, summaries) is the decoder's whole
    output. None without a transformers tokenizer (coretrain-plugins' own sampler then
    continues the prompts)."""
    import torch

    tokenizer = padding_tokenizer(run, model_path)
    if tokenizer is None:
        return None
    prompts = batch["prompt"]
    hf = wrapped_model(run.unwrapped_model)
    encoder_decoder = bool(getattr(hf.config, "is_encoder_decoder", False))
    if run.dist.tp_size > 1 and not encoder_decoder:  # generate feeds one position a step: no sequence to split
        return complete(run, prompts, batch["index"], options, tokenizer, hf.generation_config.eos_token_id)
    encoded = encoded_prompts(tokenizer, prompts, encoder_decoder).to(run.device)
    sampling = samples(options)
    settings: dict[str, Any] = {
        "max_new_tokens": options.get("max_new_tokens") or 32,
        "do_sample": sampling,
        "pad_token_id": tokenizer.pad_token_id,
        "synced_gpus": run.dist.world_size > 1 and is_sharded(run.model),  # a shard's forward waits for every rank
    }
    if sampling:  # the batch's own draws: the same on the ranks of a tensor-parallel group, and run to run
        settings.update({name: options[name] for name in ("temperature", "top_p") if options.get(name) is not None})
        torch.manual_seed(run.config.run.seed * 1_000_003 + batch["index"][0])
    with root_gathered(run):
        produced = hf.generate(**encoded, **settings)
    new = produced if encoder_decoder else produced[:, encoded["input_ids"].shape[1] :]  # (after the prompt)
    completions = tokenizer.batch_decode(new, skip_special_tokens=True)
    return [{"prompt": prompt, "completion": text} for prompt, text in zip(prompts, completions)]


def encoded_prompts(tokenizer: Any, prompts: list[Any], encoder_decoder: bool) -> Any:
    """The prompts as the model reads them: a decoder's padded on the left, so that each
    continues from its last token, without added special tokens (:func:`prompt_ids`: a text, or
    a chat's rendering); an encoder's as its training inputs were, ``tokenizer(text)`` (special
    tokens added: T5's closing ``</s>``), padded on the right."""
    if not encoder_decoder:
        tokenizer.padding_side = "left"
        ids = {"input_ids": [prompt_ids(tokenizer, prompt) for prompt in prompts]}
        return tokenizer.pad(ids, padding=True, return_tensors="pt")
    if not all(isinstance(prompt, str) for prompt in prompts):
        raise UserError("predict --data: an encoder-decoder model takes 'prompt' texts; these records hold 'messages'")
    tokenizer.padding_side = "right"
    return tokenizer(prompts, return_tensors="pt", padding=True, truncation=True)


def classify(run: Run, model_path: str | None, texts: list[str]) -> list[dict[str, Any]]:
    """Each text's class: its id (``prediction``), its name in the config's ``id2label``
    (``label``), its probability (``score``: a softmax over the classes, or as transformers'
    text-classification pipeline has it for several labels at once or a score, a sigmoid) and
    the logits (``output``). Tokenized as the training data was by ``tokenizer(text)``: special
    tokens added, padded on the right."""
    logits = classes_of(run, model_path, texts)[2]
    config = wrapped_model(run.unwrapped_model).config
    independent = config.problem_type == "multi_label_classification" or config.num_labels == 1
    probabilities, classes = (logits.sigmoid() if independent else logits.softmax(-1)).max(-1)
    names = label_names(run)
    records = []
    for text, chosen, probability, output in zip(texts, classes.tolist(), probabilities.tolist(), logits.tolist()):
        label = names.get(chosen, str(chosen))
        records.append({"prompt": text, "prediction": chosen, "label": label, "score": probability, "output": output})
    return records


def tag(run: Run, model_path: str | None, texts: list[str]) -> list[dict[str, Any]]:
    """Each text's tokens and a class for each, as transformers' ``token-classification``
    pipeline tags them (every token; the special tokens and padding left out): the tokens
    (``tokens``), their class ids (``prediction``), names (``label``, the config's ``id2label``),
    probabilities (``score``) and logits (``output``), one list entry per token."""
    tokenizer, encoded, logits = classes_of(run, model_path, texts)
    probabilities, classes = logits.softmax(-1).max(-1)
    names = label_names(run)
    tagged = encoded["attention_mask"].bool() & ~encoded["special_tokens_mask"].bool()
    records = []
    for i, text in enumerate(texts):
        kept = tagged[i].nonzero().flatten().tolist()
        chosen = classes[i, kept].tolist()
        records.append(
            {
                "prompt": text,
                "tokens": tokenizer.convert_ids_to_tokens(encoded["input_ids"][i, kept].tolist()),
                "prediction": chosen,
                "label": [names.get(c, str(c)) for c in chosen],
                "score": probabilities[i, kept].tolist(),
                "output": logits[i, kept].tolist(),
            }
        )
    return records


def classes_of(run: Run, model_path: str | None, texts: list[str]) -> tuple[Any, Any, Any]:
    """The tokenizer, the texts it encoded (``tokenizer(texts)`` as the training data was:
    special tokens added, padded on the right; their special-tokens mask beside) and the
    classifier's float logits for them, through the run's model as an evaluation (its FSDP
    root, its sequence padding)."""
    import torch

    tokenizer = padding_tokenizer(run, model_path)
    if not all(isinstance(text, str) for text in texts):
        raise UserError("predict --data: a classifier takes 'prompt' texts; these records hold 'messages' chats")
    if tokenizer is None:
        raise UserError(
            "predict --data: no tokenizer for the texts: no [tokenizer] path, model.options.path has none, and "
            "the data provider names none"
        )
    options = {"return_tensors": "pt", "padding": True, "truncation": True, "return_special_tokens_mask": True}
    encoded = tokenizer(texts, **options).to(run.device)
    inputs = {name: value for name, value in encoded.items() if name != "special_tokens_mask"}
    with torch.no_grad():
        logits = run.model(**inputs)["logits"].float()
    return tokenizer, encoded, logits


def label_names(run: Run) -> dict[int, str]:
    """The model config's ``id2label`` (class id -> name); empty when it names none."""
    return dict(getattr(wrapped_model(run.unwrapped_model).config, "id2label", None) or {})


def fill_masks(run: Run, model_path: str | None, texts: list[str]) -> list[dict[str, Any]]:
    """Each text with its mask tokens filled by the masked LM's likeliest token, as transformers'
    ``fill-mask`` pipeline answers first: the text filled (``completion``), and for each mask its
    token (``tokens``) and probability (``score``). A text without the mask token is one error."""
    tokenizer, encoded, logits = classes_of(run, model_path, texts)
    probabilities, chosen = logits.softmax(-1).max(-1)
    records = []
    for i, text in enumerate(texts):
        ids = encoded["input_ids"][i]
        masked = (ids == tokenizer.mask_token_id).nonzero().flatten().tolist() if tokenizer.mask_token else []
        if not masked:
            raise UserError(f"predict --data: {text!r} holds no mask token ({tokenizer.mask_token}) to fill")
        kept = encoded["attention_mask"][i].bool() & ~encoded["special_tokens_mask"][i].bool()
        kept[masked] = True
        filled = ids.clone()
        filled[masked] = chosen[i, masked]
        records.append(
            {
                "prompt": text,
                "completion": tokenizer.decode(filled[kept]),
                "tokens": tokenizer.convert_ids_to_tokens(chosen[i, masked].tolist()),
                "score": probabilities[i, masked].tolist(),
            }
        )
    return records
