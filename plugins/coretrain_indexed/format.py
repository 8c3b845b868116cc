"""Megatron-Core's memory-mapped indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read and
written from the format itself, without Megatron.

``.idx``, little-endian: the header ``MMIDIDX\\x00\\x00``; version ``<Q`` (1); the token dtype's
code ``<B``; the sequence count ``<Q``; the document count ``<Q`` (entries of the next-to-last
array); then the sequence lengths (int32), the sequence byte offsets into ``.bin`` (int64) and
the document indices (int64: document d is sequences ``[doc[d], doc[d+1])``, starting at 0).
``.bin`` holds the tokens of every sequence, back to back.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from coretrain import UserError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, Any] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""Megatron's DType codes."""
CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}


class IndexedTokens:
    """One ``PREFIX.bin/.idx`` pair as documents of tokens: ``document(d)`` is a view of the
    memory-mapped ``.bin`` (nothing is read until a window touches it)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        index_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for path in (index_path, bin_path):
            if not path.is_file():
                raise UserError(
                    f"data.options: {path} not found (relative to {os.getcwd()}); a data path is the prefix "
                    "that .bin and .idx are appended to, e.g. 'data/my-corpus_text_document'"
                )
        self.dtype, lengths, pointers, documents = read_index(index_path)
        size = bin_path.stat().st_size
        if size % self.dtype.itemsize:
            raise UserError(
                f"{bin_path}: {size} bytes, not a whole number of {self.dtype.name} tokens ({self.dtype.itemsize} "
                f"bytes each, as {index_path} says); the file is truncated or not this index's"
            )
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if size else np.zeros(0)
        starts = pointers // self.dtype.itemsize
        if len(lengths) and (
            starts[-1] + lengths[-1] > len(self.tokens) or (starts[1:] != starts[:-1] + lengths[:-1]).any()
        ):
            raise UserError(
                f"{bin_path}: does not match {index_path} (the sequences are not back to back in its "
                f"{len(self.tokens)} tokens); were the two files written together?"
            )
        sequence_ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.document_starts = sequence_ends[documents[:-1]]
        self.document_lengths = sequence_ends[documents[1:]] - self.document_starts

    def __len__(self) -> int:
        """Documents."""
        return len(self.document_lengths)

    def document(self, index: int) -> np.ndarray:
        start = int(self.document_starts[index])
        return self.tokens[start : start + int(self.document_lengths[index])]


def read_index(path: Path) -> tuple[np.dtype[Any], np.ndarray, np.ndarray, np.ndarray]:
    """(token dtype, sequence lengths, sequence byte offsets, document indices), checked."""
    raw = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    fixed = len(HEADER) + 8 + 1 + 8 + 8
    if len(raw) < fixed or bytes(raw[: len(HEADER)]) != HEADER:
        raise UserError(
            f"{path}: not a Megatron indexed dataset index (it must start with {HEADER!r}); "
            "write one with 'coretrain data prepare' or Megatron's preprocess_data.py"
        )
    version, code, sequences, documents = struct.unpack("<QBQQ", bytes(raw[len(HEADER) : fixed]))
    if version != VERSION:
        raise UserError(f"{path}: index version {version}; this reader knows version {VERSION}")
    if code not in DTYPES:
        raise UserError(f"{path}: unknown token dtype code {code}; Megatron's codes are {sorted(DTYPES)}")
    if np.dtype(DTYPES[code]).kind == "f":
        raise UserError(f"{path}: its tokens are {np.dtype(DTYPES[code]).name}; token ids are integers")
    need = fixed + sequences * 4 + sequences * 8 + documents * 8
    if len(raw) < need:
        raise UserError(f"{path}: truncated ({len(raw)} bytes; its counts need {need})")
    lengths = np.frombuffer(raw, np.int32, sequences, fixed).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, sequences, fixed + sequences * 4)
    document_indices = np.frombuffer(raw, np.int64, documents, fixed + sequences * 12)
    if (lengths < 0).any() or (pointers < 0).any():
        raise UserError(f"{path}: negative sequence lengths or offsets; the index is damaged")
    if (
        documents == 0
        or document_indices[0] != 0
        or document_indices[-1] != sequences
        or (np.diff(document_indices) < 0).any()
    ):
        raise UserError(f"{path}: the document indices do not cover the {sequences} sequences in order")
    return np.dtype(DTYPES[code]), lengths, pointers, document_indices


def write_indexed(prefix: str, documents: list[np.ndarray] | list[list[int]], dtype: Any = np.uint16) -> None:
    """Write documents (one sequence each) as ``prefix.bin/.idx``, as Megatron's builder does."""
    dtype = np.dtype(dtype)
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    with open(f"{prefix}.bin", "wb") as data:
        for document in documents:
            data.write(np.asarray(document, dtype=dtype).tobytes(order="C"))
    write_index(f"{prefix}.idx", dtype, lengths, np.arange(len(documents) + 1, dtype=np.int64))


def write_index(path: str, dtype: np.dtype[Any], lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """The ``.idx`` of sequences of ``lengths`` written back to back, grouped by ``document_indices``."""
    pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * dtype.itemsize
    with open(path, "wb") as index:
        index.write(HEADER)
        index.write(struct.pack("<QBQQ", VERSION, CODES[dtype], len(lengths), len(document_indices)))
        index.write(lengths.astype("<i4").tobytes())
        index.write(pointers.astype("<i8").tobytes())
        index.write(document_indices.astype("<i8").tobytes())
