"""``hf-text``: local text, jsonl or parquet files, tokenized once, packed, blended.

    [data]
    provider = "hf-text"
    [data.options]
    tokenizer = "models/tiny-llama"                 # a local tokenizer directory (or [tokenizer] path)
    data_path = [0.3, "data/code.jsonl", 0.7, "data/prose.txt"]   # Megatron's weights and paths
    seq_length = 1024
    split = [0.98, 0.01, 0.01]                      # train / valid / test

Each file is read with the ``datasets`` library (``.txt``: one document per line; ``.jsonl``
/``.json``/``.parquet``: the ``text_field`` column), tokenized with the tokenizer without its
special tokens, each document followed by EOS, and the whole stream stored once as a
memory-mapped token file in the cache (``cache_dir``, default ``~/.cache/coretrain/tokens``),
keyed by a hash of the file's bytes (not its size and mtime, which ``rsync -a``, ``cp -p`` and
``tar`` keep through an edit) and of the tokenizer's files. The first process to need it
builds it under a file lock; every other rank, and every later run, reads it. An entry whose
files do not fit each other (torn, truncated, edited) is rebuilt, with a warning.

The stream is cut into consecutive windows of ``seq_length + 1`` tokens (input and shifted
target, as the other text providers), documents packed back to back. The split rule: each
source's windows are divided in order — the first ``split[0]`` share train, the next
``split[1]`` valid, the rest test (Megatron's ``split = "969,30,1"``, by windows). With several
sources, each split is blended by weight (Megatron's greedy rule: the next sample comes from
the source furthest below its share), sized to the samples the run will use.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from attrs import define, field
from coretrain_tokenizer import run_tokenizer
from coretrain_windows import TokenWindows

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

log = logging.getLogger("coretrain")

READERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
CACHE_FORMAT = 2  # 2: keyed by content
NEEDED_BY = 'data.provider = "hf-text"'


@define(kw_only=True)
class HFText:
    """Local text / jsonl / parquet files, tokenized once (cached, memory-mapped), packed, blended."""

    data_path: Any = field(converter=listed)
    """A file, files, or Megatron's blend: [weight, path, weight, path, ...]."""
    seq_length: int = field(default=1024, validator=positive)
    """Tokens per sample."""
    text_field: str = "text"
    """The column holding the text in jsonl / parquet files."""
    split: list[float] = field(factory=lambda: [0.98, 0.01, 0.01], validator=non_negative)
    """Shares of each source's windows for train, valid, test (in that order)."""
    append_eos: bool = True
    """End each document with the tokenizer's EOS token."""
    cache_dir: str | None = None
    """Where tokenized files are kept; unset = $CORETRAIN_CACHE or ~/.cache/coretrain/tokens."""
    tokenizer: str | None = None
    """A local tokenizer directory (tokenizer.json / tokenizer_config.json, as save_pretrained
    writes); unset: the run's ``[tokenizer] path``."""

    def __attrs_post_init__(self) -> None:
        blend(self.data_path)  # raises FieldValueError naming data_path
        check_shares(self.split)

    @hookimpl
    def provide_datasets(self, run: Run, context: DatasetContext) -> Datasets:
        require("datasets", needed_by=NEEDED_BY, extra="hf")
        tokenizer, directory = run_tokenizer(run, self.tokenizer, "data.options.tokenizer", NEEDED_BY)
        if self.append_eos and tokenizer.eos_token_id is None:
            raise UserError(f"{directory}: the tokenizer has no EOS token; set data.options.append_eos = false")
        cache = Path(self.cache_dir or os.environ.get("CORETRAIN_CACHE") or Path.home() / ".cache/coretrain/tokens")
        splits: list[list[TokenWindows | None]] = [[], [], []]
        weights = []
        for weight, path in blend(self.data_path):
            tokens = cached_tokens(path, tokenizer, directory, self, cache)
            for index, windows in enumerate(split_windows(tokens, self.seq_length, self.split)):
                splits[index].append(windows)
            weights.append(weight)
        needed = (context.train_samples, context.valid_samples, context.test_samples)
        train, valid, test = (blended(parts, weights, size) for parts, size in zip(splits, needed))
        if train is None:
            raise UserError(
                f"data.options: the files hold fewer than seq_length + 1 ({self.seq_length + 1}) tokens for training"
            )
        return Datasets(
            train=train,
            valid=valid,
            test=test,
            seq_length=self.seq_length,
            vocab_size=len(tokenizer),
            tokenizer=tokenizer,
        )


def blend(data_path: list[Any]) -> list[tuple[float, Path]]:
    """(weight, path) pairs from [path, ...] or [weight, path, weight, path, ...]; weights sum to 1."""
    if not data_path or not isinstance(data_path, list):
        raise FieldValueError(
            "data_path", f'needs a file or a list of files, e.g. ["data/train.jsonl"]; got {data_path!r}'
        )
    if all(isinstance(item, str) for item in data_path):
        pairs: list[tuple[float, Any]] = [(1.0, item) for item in data_path]
    elif len(data_path) % 2 == 0 and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and isinstance(p, str)
        for w, p in zip(data_path[::2], data_path[1::2])
    ):
        pairs = [(float(w), p) for w, p in zip(data_path[::2], data_path[1::2])]
    else:
        raise FieldValueError(
            "data_path", f"expected [path, ...] or [weight, path, weight, path, ...], got {data_path}"
        )
    total = sum(w for w, _ in pairs)
    if total <= 0 or any(w < 0 for w, _ in pairs):
        raise FieldValueError("data_path", "weights must be non-negative with a positive sum")
    result = []
    for weight, name in pairs:
        path = Path(name)
        if path.suffix not in READERS:
            raise FieldValueError("data_path", f"{name}: expected a {', '.join(READERS)} file")
        if not path.is_file():
            raise FieldValueError("data_path", f"{name}: no such file")
        result.append((weight / total, path))
    return result


def content_digest(path: Path) -> str:
    """A fast hash of the file's bytes (xxh3, several GB/s; blake2b without xxhash)."""
    try:
        import xxhash

        digest: Any = xxhash.xxh3_128()
    except ImportError:
        digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
    return str(digest.hexdigest())


def cache_key(path: Path, tokenizer_dir: Path, options: HFText) -> str:
    """Changes when the file's content, the tokenizer or how the text is read changes."""
    tokenizer_files = sorted(
        p for p in tokenizer_dir.iterdir() if p.is_file() and p.suffix in (".json", ".model", ".txt")
    )
    digest = hashlib.sha256()
    for item in tokenizer_files:
        digest.update(item.name.encode() + item.read_bytes())
    recipe = [CACHE_FORMAT, path.suffix, content_digest(path), digest.hexdigest()]
    recipe += [options.text_field, options.append_eos]
    return f"{path.stem}-{hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]}"


def cached_tokens(path: Path, tokenizer: Any, tokenizer_dir: Path, options: HFText, cache: Path) -> torch.Tensor:
    """The file's token stream, memory-mapped; built once (under a lock) if not cached yet."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(
            f"data.options.cache_dir: {cache} (or a folder on its path) is a file; name a directory"
        ) from None
    except OSError as exc:
        raise UserError(
            f"data.options.cache_dir: cannot make {cache}: {exc.strerror}; name a directory you can write"
        ) from None
    key = cache_key(path, tokenizer_dir, options)
    data, meta = cache / f"{key}.bin", cache / f"{key}.json"
    info = entry_info(data, meta)
    if info is None:
        with open(cache / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then read its result
            info = entry_info(data, meta)
            if info is None:
                if meta.exists():
                    log.warning("hf-text: the cache entry %s is damaged; tokenizing %s again", meta, path)
                build(path, tokenizer, options, data, meta, cache)
                info = entry_info(data, meta)
    if info is None:
        raise UserError(f"data.options.cache_dir: {meta} was written but cannot be read back; remove it")
    if not info["tokens"]:
        raise UserError(f"data.options.data_path: {path} holds no text")
    # mapped, not read: pages load as batches touch them (private: never written back)
    return torch.from_file(str(data), shared=False, size=info["tokens"], dtype=getattr(torch, info["dtype"]))


def entry_info(data: Path, meta: Path) -> dict[str, Any] | None:
    """A committed cache entry's summary, or None when it is missing or its files do not fit."""
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
        tokens, dtype = info["tokens"], np.dtype(info["dtype"])
        size = data.stat().st_size
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if type(tokens) is not int or dtype.name not in ("uint16", "uint32") or size != tokens * dtype.itemsize:
        return None
    return dict(info)


def build(path: Path, tokenizer: Any, options: HFText, data: Path, meta: Path, cache: Path) -> None:
    datasets = require("datasets", needed_by=NEEDED_BY, extra="hf")
    datasets.disable_progress_bars()
    log.info("hf-text: tokenizing %s into %s (once; later runs and other ranks read it)", path, data)
    # a private datasets cache, gone afterwards: its own is keyed by path and mtime, and would
    # hand back the rows of a file since edited in place (the tokens are what is kept)
    with tempfile.TemporaryDirectory(dir=cache, prefix="datasets-") as scratch:
        try:
            rows = datasets.load_dataset(READERS[path.suffix], data_files=str(path), split="train", cache_dir=scratch)
        except Exception as exc:  # the library's errors for malformed files vary by format
            raise UserError(f"data.options.data_path: cannot read {path}: {type(exc).__name__}: {exc}") from None
        write_tokens(rows, path, tokenizer, options, data, meta)


def write_tokens(rows: Any, path: Path, tokenizer: Any, options: HFText, data: Path, meta: Path) -> None:
    column = "text" if path.suffix == ".txt" else options.text_field
    if column not in rows.column_names:
        raise UserError(
            f"data.options.text_field: {path} has no column '{column}'; its columns: {', '.join(rows.column_names)}"
        )
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    eos = [tokenizer.eos_token_id] if options.append_eos else []
    count, documents = 0, 0
    tmp = data.with_suffix(".bin.tmp")
    with open(tmp, "wb") as out:
        for start in range(0, len(rows), 1000):
            texts = [t for t in rows[start : start + 1000][column] if t]
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
                chunk = np.asarray(ids + eos, dtype=dtype)
                out.write(chunk.tobytes())
                count += len(chunk)
                documents += 1
    os.replace(tmp, data)
    summary = {"tokens": count, "documents": documents, "dtype": np.dtype(dtype).name, "source": str(path)}
    meta.with_suffix(".json.tmp").write_text(json.dumps(summary))
    os.replace(meta.with_suffix(".json.tmp"), meta)  # written last: the cache entry's commit


def split_windows(tokens: torch.Tensor, seq_length: int, shares: list[float]) -> list[TokenWindows | None]:
    """Consecutive windows of one source divided in order into train, valid, test."""
    windows = max((tokens.numel() - 1) // seq_length, 0)
    return [
        TokenWindows(tokens[start * seq_length : end * seq_length + 1], seq_length) if end > start else None
        for start, end in bounds(windows, shares)
    ]


def blended(parts: list[TokenWindows | None], weights: list[float], size: int) -> Any:
    """One source: itself; several: a weighted blend of ``size`` samples (or all of them)."""
    present = [(p, w) for p, w in zip(parts, weights) if p is not None and len(p) > 0]
    if not present:
        return None
    if len(present) == 1:
        return present[0][0]
    return Blend([p for p, _ in present], [w for _, w in present], size or sum(len(p) for p, _ in present))


class Blend:
    """Samples drawn from several window datasets by weight, in a fixed order (Megatron's rule)."""

    def __init__(self, sources: list[TokenWindows], weights: list[float], size: int) -> None:
        self.sources = sources
        total = sum(weights)
        shares = np.asarray([w / total for w in weights])
        counts = np.zeros(len(sources), dtype=np.int64)
        source_of = np.empty(size, dtype=np.int64)
        sample_of = np.empty(size, dtype=np.int64)
        lengths = np.asarray([len(s) for s in sources])
        for i in range(size):  # the source furthest below its share gives the next sample
            chosen = int(np.argmax(shares * (i + 1) - counts))
            source_of[i], sample_of[i] = chosen, counts[chosen] % lengths[chosen]
            counts[chosen] += 1
        self.source_of, self.sample_of = torch.from_numpy(source_of), torch.from_numpy(sample_of)

    def __len__(self) -> int:
        return len(self.source_of)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sources[int(self.source_of[index])][int(self.sample_of[index])]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.empty(len(indices), self.sources[0].seq_length, dtype=torch.long)
        targets = torch.empty_like(inputs)
        which, samples = self.source_of[indices], self.sample_of[indices]
        for number, source in enumerate(self.sources):
            rows = (which == number).nonzero().flatten()
            if len(rows):
                inputs[rows], targets[rows] = source.get_batch(samples[rows])
        return inputs, targets
