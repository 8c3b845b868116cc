"""The predictor: a plugin registered for the predict run, plus the built-in answers of the
``predict_step`` and ``write_predictions`` hooks (``trylast``: a plugin of yours answers first)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from attrs import define, field

from coretrain import Run, SplitBatches, UserError, hookimpl, inputs_and_target, is_stream, model_outputs
from coretrain_predict.hookspecs import PredictSpecs
from coretrain_predict.sampling import Prompt, complete

log = logging.getLogger("coretrain")

MAX_VALUES = 4096
"""A per-sample output with more values than this (an LM's logits) is not written whole: as its
argmax over the last dimension, or not at all when that argmax is already the ``prediction``;
smaller ones (a classifier's logits, a regression) are written as they are."""
IGNORE_INDEX = -100
"""A label no loss counts (torch's ``cross_entropy`` default): the padding of per-position labels."""


@define(kw_only=True)
class Predictor:
    """Predicts ``split`` (or the prompts in ``data``) on every rank; rank 0 writes ``out``."""

    split: str
    data: Path | None
    out: Path
    batch_size: int | None
    options: dict[str, Any]
    written: str = field(default="", init=False)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        """The model has its weights (the run restored them): predict now; the run then ends."""
        samples = self._samples(run)
        rank, world = run.dist.dp_rank, run.dist.dp_size
        size = self.batch_size or run.config.train.eval_micro_batch_size or run.config.train.micro_batch_size
        chunks, fillers = this_ranks_chunks(len(samples), rank, world, size)
        records: list[dict[str, Any]] = []
        hooks = cast(PredictSpecs, run.plugins.calls.hook)
        model = run.model
        model.eval()
        with torch.no_grad():
            for number, (chunk, batch) in enumerate(
                zip(chunks + fillers, self._batches(run, samples, chunks + fillers))
            ):
                answer = hooks.predict_step(run=run, batch=batch, options=self.options)
                if answer is None or len(answer) != len(chunk):
                    got = "no answer" if answer is None else f"{len(answer)} records"
                    raise UserError(f"predict: predict_step gave {got} for a batch of {len(chunk)} samples")
                if number < len(chunks):
                    records += [{"index": index, **record} for index, record in zip(chunk, answer)]
        gathered = gather(run, records)
        if run.dist.is_main:
            gathered.sort(key=lambda record: record["index"])
            written = hooks.write_predictions(run=run, records=gathered, path=self.out)
            if written is None:
                raise UserError(
                    f"--out {self.out}: no plugin writes {self.out.suffix or 'such'} files; use .jsonl or .parquet"
                )
            self.written = written

    def _samples(self, run: Run) -> Any:
        if self.data is not None:
            return read_prompts(self.data)
        known = {"train": run.datasets.train}
        known.update(named for split in ("valid", "test") for named in run.datasets.sets(split))
        dataset = known.get(self.split)
        if dataset is None:
            raise UserError(f"--split {self.split}: the data provider has no such split; it has {', '.join(known)}")
        if is_stream(dataset):
            raise UserError(
                f"--split {self.split}: a stream has no sample indices to predict by; give a map-style split or --data"
            )
        return dataset

    def _batches(self, run: Run, samples: Any, chunks: list[list[int]]) -> Iterator[Any]:
        """Each chunk's batch on the device: prompts as they are, a split's samples read as an
        evaluation reads them (DataLoader workers included)."""
        if self.data is not None:
            return ({"prompt": [samples[i] for i in chunk], "index": chunk} for chunk in chunks)
        return (batch for _, batch in SplitBatches(run, samples, [torch.tensor(chunk) for chunk in chunks]))

    @hookimpl(trylast=True)
    def predict_step(self, run: Run, batch: Any, options: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The model's outputs, one record per sample: ``prediction`` (the argmax) for logits of a
        model trained with ``model.loss = "cross_entropy"``, the outputs themselves, the target."""
        if isinstance(batch, dict) and "prompt" in batch:  # text in: a causal LM's continuations
            return complete(run, batch["prompt"], batch["index"], options)
        hooks = cast(PredictSpecs, run.plugins.calls.hook)
        own = hooks.predict_outputs(run=run, batch=batch) if run.plugins.implemented("predict_outputs") else None
        output, target = own or model_outputs(run, batch)
        size = len(target) if target is not None else batch_size(batch)
        if not run.reports_loss:  # a part of the model without outputs: placeholders, not written
            return [{} for _ in range(size)]
        own_loss = own is None and run.loss_fn is None  # the model was given its target and returned its loss
        if own_loss and not has_per_sample(output, size):  # called without the target, a model (an LM) gives
            with contextlib.suppress(TypeError, ValueError):  # its outputs; if it cannot be, per_sample says so
                output, target = model_outputs(run, batch, hold_target=True)
        values = per_sample(output, size)
        if own_loss and target is None:  # the target it was given
            target = inputs_and_target(batch)[1]
        if "output" in values and (run.config.model.loss == "cross_entropy" or scores(values, target)):
            values = {"prediction": values["output"].argmax(-1), **values}  # class ids (per position for an LM)
        values = {
            name: value.argmax(-1) if value[0].numel() > MAX_VALUES else value
            for name, value in values.items()
            if not (name == "output" and "prediction" in values and value[0].numel() > MAX_VALUES)
        }
        if isinstance(target, torch.Tensor) and len(target) == size:
            values["target"] = target
        kept = padding_kept_out(batch, values, run.unwrapped_model)
        return [{name: plain(own_positions(value, i, kept)) for name, value in values.items()} for i in range(size)]

    @hookimpl(trylast=True)
    def write_predictions(self, records: list[dict[str, Any]], path: Path) -> str | None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".jsonl":
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(record) + "\n" for record in records)
            tmp.replace(path)
        elif path.suffix == ".parquet":
            try:
                import pyarrow as pa
                import pyarrow.parquet as pq
            except ImportError:
                raise UserError("--out *.parquet needs pyarrow (pip install pyarrow); or write .jsonl") from None
            pq.write_table(pa.Table.from_pylist(records), path)
        else:
            return None
        return f"{len(records)} records -> {path}"


def this_ranks_chunks(count: int, rank: int, world: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """This rank's share of ``count`` samples (every ``world``-th) in batches of ``size``, and the
    filler batches it runs after them so that every rank runs as many as the first (which has
    the most): a forward that is a collective over the data-parallel ranks (expert parallelism's
    all-to-alls) needs them all. A filler's records are dropped."""
    mine = list(range(rank, count, world))
    chunks = [mine[start : start + size] for start in range(0, len(mine), size)]
    most = -(-len(range(0, count, world)) // size)
    return chunks, [[0]] * (most - len(chunks)) if count else []


def read_prompts(path: Path) -> list[Prompt]:
    """Every record's ``prompt`` text, or its ``messages`` (a chat: ``[{"role", "content"}, ...]``),
    from a .jsonl or .parquet file; a record with neither is one error, the same on every rank."""
    if not path.is_file():
        raise UserError(f"--data {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows: list[Any] = pq.read_table(path).to_pylist()
    else:
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise UserError(f"--data {path}:{number}: not JSON: {exc}") from None
    prompts = []
    for number, row in enumerate(rows, start=1):
        prompt = prompt_of(row)
        if prompt is None:
            raise UserError(
                f"--data {path}: record {number} has neither a 'prompt' text nor a 'messages' chat "
                '([{"role": ..., "content": ...}, ...])'
            )
        prompts.append(prompt)
    return prompts


def prompt_of(record: Any) -> Prompt | None:
    """A record's text to continue, or its chat to answer; None for neither (or an empty one)."""
    if not isinstance(record, dict):
        return None
    text, chat = record.get("prompt"), record.get("messages")
    if isinstance(text, str) and text:
        return text
    if isinstance(chat, list) and chat and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in chat):
        return chat
    return None


def batch_size(batch: Any) -> int:
    if isinstance(batch, (tuple, list)):
        return len(batch[0])
    return len(next(iter(batch.values())) if isinstance(batch, Mapping) else batch)


def per_sample(output: Any, size: int) -> dict[str, torch.Tensor]:
    """The output's tensors whose first dimension is the batch, by name ("output" for a bare one,
    and for a tuple's first: nanoGPT's ``(logits, loss)``; the others ``output_1``, ...)."""
    if isinstance(output, torch.Tensor):
        items = {"output": output}
    elif isinstance(output, (tuple, list)):  # (logits, loss) or (loss, logits): the first with a batch is "output"
        tensors = [item for item in output if isinstance(item, torch.Tensor) and item.dim() > 0]
        items = {("output" if i == 0 else f"output_{i}"): item for i, item in enumerate(tensors)}
    else:
        items = dict(output) if isinstance(output, dict) else vars(output)
    values = {
        ("output" if name == "logits" else name): value.detach().float().cpu()
        for name, value in items.items()
        if name != "loss" and isinstance(value, torch.Tensor) and value.dim() > 0 and len(value) == size
    }
    if not values:
        raise UserError(
            "predict: the model's outputs hold no per-sample values (only a loss?); set model.loss so "
            "the model returns its outputs, or implement the predict_step hook"
        )
    return values


def padding_kept_out(batch: Any, values: dict[str, torch.Tensor], model: Any) -> torch.Tensor | None:
    """The positions each record keeps, when a padded dict batch's values are per position, as
    booleans (B, T), so a record holds its own tokens' values and not the padding's, left or
    right (as transformers' token-classification pipeline answers): the batch's
    ``attention_mask``; for an encoder-decoder (T5, BART: ``config.is_encoder_decoder``), whose
    values are per position of its decoder, the labels that are not -100 (the padding
    ``DataCollatorForSeq2Seq`` gives them). None for values per sample (a classifier's) or a
    batch without a mask."""
    per_position = [name for name in ("prediction", "target") if name in values]
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        target = values.get("target")
        mask = target.ne(IGNORE_INDEX) if isinstance(target, torch.Tensor) else None
    else:
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    if not per_position or values[per_position[0]].shape != mask.shape:
        return None
    return mask.bool().cpu()


def own_positions(value: torch.Tensor, i: int, kept: torch.Tensor | None) -> torch.Tensor:
    """Record ``i``'s values; per position, only those ``kept`` marks for it (not its padding)."""
    if kept is None or value.shape[:2] != kept.shape:
        return value[i]
    return value[i][kept[i]]


def has_per_sample(output: Any, size: int) -> bool:
    try:
        return bool(per_sample(output, size))
    except UserError:
        return False


def scores(values: dict[str, torch.Tensor], target: Any) -> bool:
    """Whether the outputs are class scores for an integer target: one more dimension than it,
    the same before it (a classifier's logits, or an LM's per position)."""
    output = values["output"]
    return isinstance(target, torch.Tensor) and not target.is_floating_point() and output.shape[:-1] == target.shape


def plain(value: torch.Tensor) -> Any:
    return value.item() if value.dim() == 0 else value.tolist()


def gather(run: Run, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's records on rank 0 (one object gather; the ranks of a tensor-parallel group
    predicted the same samples: their first rank's copy is kept; a pipeline's last stage's)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return records
    everyone: list[Any] = [None] * run.dist.world_size
    torch.distributed.all_gather_object(everyone, (run.dist.dp_rank, records if run.reports_loss else None))
    by_replica = dict(part for part in everyone[::-1] if part[1] is not None)  # each replica's first that has them
    return [record for _, mine in sorted(by_replica.items()) for record in mine]
