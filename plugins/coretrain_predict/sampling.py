"""Continuations of prompts from a causal LM no plugin generates with: the first-party GPT,
nanoGPT's own ``GPT``, a user's model — given the tokenizer its data came from
(``Datasets.tokenizer``: text-bytes' bytes, the run's ``[tokenizer]``).

Each prompt alone, one forward per new token over its last ``seq_length`` tokens (nanoGPT's
``generate``, without a KV cache: for seeing what a model learned, not for serving). Alone,
because a model may return the logits of its last position only (nanoGPT does without targets),
which a padded batch would misplace; and every rank runs as many forwards as the rank with the
most prompts (a sharded model's forward is a collective over the ranks). Sampling draws from a
generator seeded by the run's seed and the prompt's index: the same completions on any number of
ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from coretrain_losses import logits_in
from coretrain_tokenizer import chat_ids

from coretrain import Run, UserError, max_over_ranks, model_outputs

Prompt = str | list[dict[str, Any]]
"""A text to continue, or a chat (``[{"role", "content"}, ...]``) whose next turn is wanted."""


def is_transformers_tokenizer(tokenizer: Any) -> bool:
    """A transformers tokenizer (called on text, decoding without its special tokens), not a
    provider's own with ``encode`` / ``decode`` alone (text-bytes' bytes, nanoGPT's characters)."""
    return hasattr(tokenizer, "batch_decode")


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids: its text without added special tokens (as hf-sft takes a prompt), or
    a chat rendered by the tokenizer's chat template, ready for the assistant's turn."""
    if isinstance(prompt, str):
        if is_transformers_tokenizer(tokenizer):
            return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return list(tokenizer.encode(prompt))
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "--data: a record's 'messages' is a chat, and the tokenizer has no chat template to render it with; "
            "give 'prompt' texts, or a tokenizer that has one"
        )
    return chat_ids(tokenizer, prompt, generation_prompt=True)


def complete(
    run: Run,
    prompts: list[Prompt],
    indices: list[int],
    options: dict[str, Any],
    tokenizer: Any = None,
    eos: int | None = None,
) -> list[dict[str, Any]]:
    """``{"prompt", "completion"}`` for each prompt, greedy unless ``options`` asks to sample;
    through ``tokenizer`` (the data's by default), each completion cut at ``eos`` (its EOS)."""
    if run.dist.cp_size > 1 or run.plugins.implemented("forward_batch"):  # the same on every rank
        raise UserError(
            "--data: the model is split over ranks (context or pipeline parallelism), so no rank has the logits "
            "to sample from; run predict on a layout without them (a checkpoint loads on any layout)"
        )
    tokenizer = tokenizer or data_tokenizer(run)
    eos = eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
    encoded = [prompt_ids(tokenizer, prompt) for prompt in prompts]
    if any(not ids for ids in encoded):
        raise UserError("--data: a prompt is empty (it encodes to no tokens); give each record some text")
    agreed = max_over_ranks(len(prompts))[0]  # the forwards of the rank with the most prompts
    made: list[list[int]] = []
    for number in range(agreed):
        row = number if number < len(prompts) else 0  # beyond this rank's prompts: the first again, dropped
        made.append(continuation(run, encoded[row], indices[row], options, vocabulary=len(tokenizer)))
    return [{"prompt": prompt, "completion": text_of(tokenizer, until(new, eos))} for prompt, new in zip(prompts, made)]


def text_of(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids``, a transformers tokenizer's special tokens left out (as its pipelines do)."""
    if is_transformers_tokenizer(tokenizer):
        return str(tokenizer.decode(ids, skip_special_tokens=True))
    return str(tokenizer.decode(ids))


def data_tokenizer(run: Run) -> Any:
    """The tokenizer that made the training data's ids, or one error saying how to name it."""
    tokenizer = run.datasets.tokenizer
    if tokenizer is None:
        raise UserError(
            f"--data: the data provider '{run.config.data.provider}' names no tokenizer, so the prompts cannot "
            'become its token ids; set [tokenizer] path = "DIR" (the save_pretrained directory the data was '
            "tokenized with), or predict a split with --split"
        )
    return tokenizer


def continuation(run: Run, prompt: list[int], index: int, options: dict[str, Any], vocabulary: int) -> list[int]:
    """``max_new_tokens`` token ids after ``prompt`` (greedy, or sampled at ``temperature`` / ``top_p``)."""
    new_tokens = options.get("max_new_tokens") or 32
    window = run.datasets.seq_length or len(prompt) + new_tokens  # the longest context the model was trained on
    sampling = samples(options)
    generator = torch.Generator(device=run.device).manual_seed(run.config.run.seed * 1_000_003 + index)
    tokens = list(prompt)
    for _ in range(new_tokens):
        seen = tokens[-window:]
        # tensor parallelism's sequence parallelism splits the positions evenly over the group: pad
        # after the last, which leaves a causal model's logits before it as they are
        padded = seen + [0] * (-len(seen) % run.dist.tp_size)
        output, _ = model_outputs(run, torch.tensor([padded], device=run.device), hold_target=False)
        logits = last_logits(output, len(seen) - 1, vocabulary)[:vocabulary]  # a padded vocabulary's ids: no token
        if sampling:
            probabilities = nucleus(logits / (options.get("temperature") or 1.0), options.get("top_p"))
            tokens.append(int(torch.multinomial(probabilities, 1, generator=generator)))
        else:
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def samples(options: dict[str, Any]) -> bool:
    """Whether the command asks to sample: ``--do-sample``, or a temperature or top-p given
    (``--help`` says they sample), for every model alike; temperature 0 is greedy (vLLM's and
    OpenAI's reading)."""
    if options.get("temperature") == 0:
        return False
    return bool(options.get("do_sample")) or any(options.get(name) is not None for name in ("temperature", "top_p"))


def last_logits(output: Any, last: int, vocabulary: int) -> torch.Tensor:
    """The next token's logits (vocabulary,) from a model's outputs for one sequence whose last
    token is at ``last`` (a model that returns its last position's logits only: those); fewer
    values than the tokenizer's ``vocabulary`` are no language model's (a tagger's classes)."""
    logits = logits_in(output)
    if logits is None or logits.dim() != 3:
        got = type(output).__name__ if logits is None else f"logits of shape {tuple(logits.shape)}"
        raise UserError(
            f"--data: the model returned {got} for a batch of token ids; generating needs logits (batch, "
            "positions, vocabulary): return them (a tensor, a dict's or object's 'logits', or a tuple's first item)"
        )
    full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits  # tensor parallelism's shards
    if full.shape[-1] < vocabulary:
        raise UserError(
            f"--data continues prompts with a language model, and this model gives {full.shape[-1]} values per "
            f"position for a tokenizer of {vocabulary} tokens (a token classifier's classes?): predict its "
            "records per position on a split instead (--split valid)"
        )
    return full[0, last if full.shape[1] > 1 else -1].float()


def nucleus(logits: torch.Tensor, top_p: float | None) -> torch.Tensor:
    """Probabilities of the smallest set of tokens whose mass reaches ``top_p`` (all: None)."""
    probabilities = logits.softmax(-1)
    if top_p is None or top_p >= 1:
        return probabilities
    ordered, order = probabilities.sort(descending=True)
    outside = ordered.cumsum(-1) - ordered > top_p  # the first token is always kept
    ordered[outside] = 0
    return torch.zeros_like(probabilities).scatter(-1, order, ordered / ordered.sum())


def until(ids: list[int], eos: int | None) -> list[int]:
    """The ids up to the first end-of-sequence token, which stays, as in what transformers'
    ``generate`` returns (decoding leaves it out when it is a special token); all without one."""
    return ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids
