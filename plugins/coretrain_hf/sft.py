"""``hf-sft``: instruction tuning — loss on the response tokens only.

    [data]
    provider = "hf-sft"
    [data.options]
    tokenizer = "models/tiny-llama"
    data_path = ["data/instructions.jsonl"]      # records with prompt / response, or messages
    seq_length = 512                              # longer examples are cut at this length
    packing = false                               # padded per batch; true: packed windows

A record is ``{"prompt": ..., "response": ...}`` (the tokens of prompt, then response, then
EOS), or ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the tokenizer's
chat template, where everything but the last message is the prompt. Each sample is a dict of
``input_ids`` and ``labels`` aligned with them, -100 on the prompt, as Hugging Face models
take; the ``hf`` provider shifts them once and reports its token count, so the loss is the
mean over every response token of a step, across micro-batches and ranks.

Padded (default): a batch is padded to its longest example (``labels`` -100 and
``attention_mask`` 0 on the padding). Packed: examples are laid end to end and cut into
windows of ``seq_length`` tokens, and kept apart: ``position_ids`` restart at 0 with each
example, its first token is no target of the one before, and the model's own packed-sequence
support masks attention per example (transformers builds a block-diagonal causal mask from
restarting position ids, and flash-attention takes them as sequence boundaries; Megatron's
packed SFT with its reset masks). An example a window cuts goes on in the next with its
positions continued. Split: the records, in file order, by ``split``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from attrs import define, field
from coretrain_tokenizer import chat_ids, run_tokenizer

from coretrain import (
    DatasetContext,
    Datasets,
    FieldValueError,
    Run,
    UserError,
    hookimpl,
    non_negative,
    positive,
    require,
)
from coretrain_hf.splits import bounds, check_shares, listed

IGNORE_INDEX = -100
READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
NEEDED_BY = 'data.provider = "hf-sft"'


@define(kw_only=True)
class HFSFT:
    """Prompt/response (or chat) records for instruction tuning: loss on response tokens only."""

    data_path: Any = field(converter=listed)
    """A jsonl / json / parquet file of records, or a list of them, read in order."""
    seq_length: int = field(default=1024, validator=positive)
    """Longest example (padded) or window length (packed)."""
    packing: bool = False
    """Pack examples end to end into seq_length windows instead of padding each batch."""
    prompt_field: str = "prompt"
    """The record's key holding the prompt (no loss on its tokens)."""
    response_field: str = "response"
    """The record's key holding the response (the tokens the loss is on)."""
    messages_field: str = "messages"
    """A record with this field is a chat, rendered with the tokenizer's chat template."""
    split: list[float] = field(factory=lambda: [0.95, 0.05, 0.0], validator=non_negative)
    """Shares of the records for train, valid, test."""
    tokenizer: str | None = None
    """A local tokenizer directory; unset: the run's ``[tokenizer] path``."""

    def __attrs_post_init__(self) -> None:
        if not self.data_path or not isinstance(self.data_path, list):
            raise FieldValueError(
                "data_path", f'needs a file or a list of files, e.g. "data/sft.jsonl"; got {self.data_path!r}'
            )
        for name in self.data_path:
            if not isinstance(name, str) or Path(name).suffix not in READERS:
                raise FieldValueError("data_path", f"{name}: expected a {', '.join(READERS)} file")
        check_shares(self.split)

    @hookimpl
    def provide_datasets(self, run: Run, context: DatasetContext) -> Datasets:
        datasets = require("datasets", needed_by=NEEDED_BY, extra="hf")
        datasets.disable_progress_bars()
        tokenizer, _ = run_tokenizer(run, self.tokenizer, "data.options.tokenizer", NEEDED_BY)
        examples = [self.encode(record, tokenizer) for record in self.records(datasets)]
        examples = [e for e in examples if (e[1] != IGNORE_INDEX).any()]
        if not examples:
            raise UserError("data.options.data_path: no record has a response token within seq_length")
        parts = [examples[start:end] for start, end in bounds(len(examples), self.split)]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        splits: list[Packed | Examples | None]
        if self.packing:
            splits = [Packed(part, self.seq_length) if part else None for part in parts]
            collate = None
        else:
            splits = [Examples(part) if part else None for part in parts]
            collate = PadToLongest(pad if pad is not None else 0)
        train, valid, test = (s if s is not None and len(s) else None for s in splits)
        if train is None:
            raise UserError("data.options: no training examples (check split and the files)")
        return Datasets(
            train=train,
            valid=valid,
            test=test,
            seq_length=self.seq_length if self.packing else None,
            vocab_size=len(tokenizer),
            tokenizer=tokenizer,
            collate_fn=collate,
        )

    def records(self, datasets: Any) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for name in self.data_path:
            path = Path(name)
            if not path.is_file():
                raise UserError(f"data.options.data_path: {name}: no such file")
            try:
                table = datasets.load_dataset(READERS[path.suffix], data_files=str(path), split="train")
            except Exception as exc:  # the library's errors for malformed files vary by format
                raise UserError(f"data.options.data_path: cannot read {path}: {type(exc).__name__}: {exc}") from None
            rows.extend(table)
        return rows

    def encode(self, record: dict[str, Any], tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of one record, labels -100 on the prompt, cut at seq_length."""
        messages = record.get(self.messages_field)
        if messages:
            if not getattr(tokenizer, "chat_template", None):
                raise UserError(
                    f"data.options: records have '{self.messages_field}' but the tokenizer has no chat template; "
                    f"give '{self.prompt_field}' and '{self.response_field}' instead"
                )
            prompt = chat_ids(tokenizer, messages[:-1], generation_prompt=True)
            full = chat_ids(tokenizer, messages, generation_prompt=False)
        else:
            if self.prompt_field not in record or self.response_field not in record:
                raise UserError(
                    f"data.options: a record has neither '{self.messages_field}' nor '{self.prompt_field}' and "
                    f"'{self.response_field}'; its fields: {', '.join(record)}"
                )
            prompt = tokenizer(record[self.prompt_field], add_special_tokens=False)["input_ids"]
            response = tokenizer(record[self.response_field], add_special_tokens=False)["input_ids"]
            full = prompt + response + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        ids = torch.tensor(full[: self.seq_length], dtype=torch.long)
        labels = ids.clone()
        labels[: min(len(prompt), len(labels))] = IGNORE_INDEX
        return ids, labels


class Examples:
    """One tokenized example per index: {"input_ids", "labels"} of its own length."""

    def __init__(self, examples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.examples[index]
        return {"input_ids": ids, "labels": labels}


class PadToLongest:
    """Collate examples into a batch padded to its longest: labels -100 and attention 0 on padding."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), length), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = sample["input_ids"], sample["labels"], 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class Packed:
    """Examples end to end, cut into windows of seq_length (the last partial window dropped),
    with positions restarting per example and no target across an example boundary."""

    def __init__(self, examples: list[tuple[torch.Tensor, torch.Tensor]], seq_length: int) -> None:
        self.ids = torch.cat([ids for ids, _ in examples])
        self.labels = torch.cat([_first_ignored(labels) for _, labels in examples])
        self.positions = torch.cat([torch.arange(len(ids)) for ids, _ in examples])
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.ids) // self.seq_length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        window = slice(index * self.seq_length, (index + 1) * self.seq_length)
        return {"input_ids": self.ids[window], "labels": self.labels[window], "position_ids": self.positions[window]}


def _first_ignored(labels: torch.Tensor) -> torch.Tensor:
    """An example's labels with its first token no target: the token before it is another example's."""
    labels = labels.clone()
    labels[0] = IGNORE_INDEX
    return labels
