"""Tokenize documents into Megatron's ``.bin/.idx`` pairs (one per key), with worker processes
and a progress view.

Each document becomes one sequence (and one document) of token ids, EOS appended with
``--append-eod``; the dtype is Megatron's choice (uint16 below 65,500 ids, else int32). The
pairs are written into a directory of their own and committed at once
(:mod:`coretrain_data_prepare.pairs`): killed at any moment, the previous pair still reads.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from attrs import define
from coretrain_tokenizer import REMOTE_CODE, remote_code_refused

from coretrain import UserError
from coretrain_data_prepare import pairs
from coretrain_data_prepare.progress import Progress
from coretrain_data_prepare.sources import Document, check_inputs, documents

log = logging.getLogger("coretrain")

CHUNK = 256
"""Documents per piece of work a worker tokenizes."""


@define(kw_only=True)
class Request:
    """What ``coretrain data prepare`` was asked to do (its command-line options)."""

    inputs: list[str]
    tokenizer: str
    output_prefix: str
    json_keys: list[str]
    append_eod: bool = False
    include_special_tokens: bool = True
    """Each document with the special tokens the tokenizer adds (a BOS), as Megatron's
    HuggingFaceTokenizer encodes it by default; off: its tokens alone."""
    workers: int = 1
    input_format: str = "auto"
    sample_by: str = "line"
    log_interval: int = 10000
    trust_remote_code: bool = False
    """Run code a custom tokenizer ships (``--config``'s ``[tokenizer] trust_remote_code``)."""
    tokenizer_key: str = "--tokenizer"
    """Where the tokenizer was named, for messages (``tokenizer.path`` with ``--config``)."""
    megatron: dict[str, Any] | None = None
    """``--config``'s ``[tokenizer]`` when it names one of Megatron's types (``tokenizer_type``)."""


def load_tokenizer(
    path: str, trust_remote_code: bool = False, key: str = "--tokenizer", megatron: dict[str, Any] | None = None
) -> Any:
    """A local Hugging Face tokenizer (a directory ``save_pretrained`` wrote; never the hub), or
    one of Megatron's types as ``[tokenizer]`` describes it (``megatron``)."""
    if megatron is not None:
        from coretrain_tokenizer.megatron import Settings, build

        return build(Settings(**megatron), "coretrain data prepare")
    if not Path(path).is_dir():
        raise UserError(f"{key} {path}: not a directory; give a local tokenizer saved with save_pretrained")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"{key} needs transformers (pip install 'coretrain-plugins[hf]')") from None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a broken config fails in many ways: JSON, a missing key, a wrong type
        if REMOTE_CODE in str(exc) and not trust_remote_code:
            raise UserError(remote_code_refused(key, Path(path), "tokenizer")) from None
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{key} {path}: not a Hugging Face tokenizer ({detail})") from None


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """Megatron's ``DType.optimal_dtype``."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


_worker: dict[str, Any] = {}
"""The tokenizer and EOS of this worker process (set once by :func:`_start_worker`)."""


def _start_worker(
    tokenizer_path: str,
    eod: int | None,
    trust: bool = False,
    special: bool = True,
    megatron: dict[str, Any] | None = None,
) -> None:
    _worker["tokenizer"], _worker["eod"] = load_tokenizer(tokenizer_path, trust, megatron=megatron), eod
    _worker["special"] = special


def _encode(chunk: list[Document]) -> tuple[dict[str, list[list[int]]], int]:
    """Token ids of a chunk of documents by key, and the input bytes they came from."""
    tokenizer, eod = _worker["tokenizer"], _worker["eod"]
    encoded: dict[str, list[list[int]]] = {}
    for key in chunk[0][0]:
        ids = tokenizer([fields[key] for fields, _ in chunk], add_special_tokens=_worker["special"])["input_ids"]
        encoded[key] = [list(doc) + [eod] for doc in ids] if eod is not None else [list(doc) for doc in ids]
    return encoded, sum(size for _, size in chunk)


def _chunks(items: Iterable[Document]) -> Iterator[list[Document]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, CHUNK)):
        yield chunk


class PairWriter:
    """One ``PREFIX.bin/.idx`` pair, written as documents arrive into a version of its own,
    committed at once by :meth:`close` (:mod:`coretrain_data_prepare.pairs`)."""

    def __init__(self, prefix: str, dtype: np.dtype[Any], tokenizer: str) -> None:
        self.prefix, self.dtype, self.tokenizer = prefix, dtype, tokenizer
        self.highest = int(np.iinfo(dtype).max)
        self.version = pairs.new_version(Path(prefix))
        self.data = open(self.version / "bin", "wb")  # noqa: SIM115 - held until close or discard
        self.lengths: list[int] = []
        self.empty = 0

    def add(self, document: list[int]) -> None:
        if not document:  # no tokens: nothing a window could read
            self.empty += 1
            return
        ids = np.asarray(document, dtype=np.int64)
        if int(ids.min()) < 0 or int(ids.max()) > self.highest:
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise UserError(
                f"--tokenizer {self.tokenizer}: token id {bad} does not fit {self.dtype.name} (0..{self.highest}), "
                "chosen by its vocabulary size; its ids must lie below len(tokenizer)"
            )
        self.data.write(ids.astype(self.dtype).tobytes())
        self.lengths.append(len(document))

    def close(self) -> None:
        from coretrain_indexed.format import write_index

        self.data.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        write_index(str(self.version / "idx"), self.dtype, lengths, np.arange(len(lengths) + 1, dtype=np.int64))
        pairs.commit(Path(self.prefix), self.version)

    def discard(self) -> None:
        """Remove this version's files, unless a commit already made them the pair."""
        self.data.close()
        if pairs.current(Path(self.prefix)) != self.version:
            shutil.rmtree(self.version, ignore_errors=True)


def check_keys(keys: list[str]) -> None:
    """A key names output files (PREFIX_KEY_document): no path in it."""
    for key in keys:
        if not key or key in (".", "..") or "\0" in key or any(sep and sep in key for sep in (os.sep, os.altsep)):
            raise UserError(
                f"--json-keys {key!r}: a key names output files (PREFIX_KEY_document); no path or '/' in it"
            )


def open_writers(request: Request, prefixes: dict[str, str], dtype: np.dtype[Any]) -> dict[str, PairWriter]:
    """A writer per key, or one error saying why the output prefix cannot take the files."""
    option = f"--output-prefix {request.output_prefix}"
    if request.output_prefix.endswith(("/", os.sep)) or Path(request.output_prefix).is_dir():
        raise UserError(f"{option}: a directory; the prefix starts the file names, e.g. data/corpus")
    writers: dict[str, PairWriter] = {}
    try:
        Path(request.output_prefix).parent.mkdir(parents=True, exist_ok=True)
        for key, prefix in prefixes.items():
            writers[key] = PairWriter(prefix, dtype, request.tokenizer)
    except (FileExistsError, NotADirectoryError):
        _discard(writers)
        raise UserError(f"{option}: a folder on its path is a file; choose another prefix") from None
    except OSError as exc:
        _discard(writers)
        raise UserError(f"{option}: cannot write there ({exc.strerror or exc})") from None
    return writers


def _discard(writers: dict[str, PairWriter]) -> None:
    for writer in writers.values():
        writer.discard()


def _eod(tokenizer: Any, request: Request) -> int | None:
    if not request.append_eod:
        return None
    if tokenizer.eos_token_id is None:
        raise UserError(f"--append-eod: the tokenizer in {request.tokenizer} has no EOS token (eos_token)")
    return int(tokenizer.eos_token_id)


def prepare(request: Request) -> dict[str, Path]:
    """Write ``PREFIX_KEY_document.bin/.idx`` for each key; the prefixes written, by key."""
    if request.workers < 1:
        raise UserError(f"--workers {request.workers}: expected 1 or more")
    check_keys(request.json_keys)
    paths = check_inputs(request.inputs)
    tokenizer = load_tokenizer(request.tokenizer, request.trust_remote_code, request.tokenizer_key, request.megatron)
    eod = _eod(tokenizer, request)
    dtype = token_dtype(len(tokenizer))
    prefixes = {key: f"{request.output_prefix}_{key}_document" for key in request.json_keys}
    writers = open_writers(request, prefixes, dtype)
    progress = Progress(sum(p.stat().st_size for p in paths), request.log_interval)
    started = time.perf_counter()
    try:
        work = _chunks(documents(paths, request.input_format, request.json_keys, request.sample_by))
        for encoded, size in _encoded(work, request, eod):
            for key, docs in encoded.items():
                for document in docs:
                    writers[key].add(document)
            progress.advance(len(next(iter(encoded.values()))), size)
        if not any(writer.lengths for writer in writers.values()):
            raise UserError(f"{', '.join(request.inputs)}: no document with any text to tokenize")
        for writer in writers.values():
            writer.close()
    except BaseException:
        _discard(writers)
        raise
    finally:
        progress.close()
    _summary(writers, time.perf_counter() - started)
    return {key: Path(prefix) for key, prefix in prefixes.items()}


def _encoded(work: Iterator[list[Document]], request: Request, eod: int | None) -> Iterator[Any]:
    """The chunks tokenized in order: here, or by ``workers`` processes (each with its own tokenizer)."""
    if request.workers == 1:
        _start_worker(
            request.tokenizer, eod, request.trust_remote_code, request.include_special_tokens, request.megatron
        )
        yield from map(_encode, work)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
    context = multiprocessing.get_context("spawn")  # no fork of a process holding tokenizer threads
    with context.Pool(
        request.workers,
        initializer=_start_worker,
        initargs=(request.tokenizer, eod, request.trust_remote_code, request.include_special_tokens, request.megatron),
    ) as pool:
        yield from pool.imap(_encode, work)


def _summary(writers: dict[str, PairWriter], seconds: float) -> None:
    for writer in writers.values():
        tokens = sum(writer.lengths)
        empty = f"; {writer.empty} empty document(s) left out" if writer.empty else ""
        print(
            f"wrote {writer.prefix}.bin/.idx: {len(writer.lengths):,} documents, {tokens:,} tokens "
            f"({writer.dtype.name}) in {seconds:.1f} s{empty}"
        )
