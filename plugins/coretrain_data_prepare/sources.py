"""The documents of the input files, in order: each a ``{key: text}`` and the input bytes it
took, so progress can be shown against the files' total size.

Bad input is one :class:`coretrain.UserError` naming the file and line (or row) and what was
expected there (the outputs written so far are then removed: see ``prepare``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from coretrain import UserError

Document = tuple[dict[str, str], int]
"""The texts of one document by key, and the input bytes it came from."""


def input_format(path: Path, chosen: str) -> str:
    if chosen != "auto":
        return chosen
    suffix = path.suffix.lower()
    return "jsonl" if suffix in (".jsonl", ".json") else "parquet" if suffix == ".parquet" else "text"


def check_inputs(inputs: list[str]) -> list[Path]:
    paths = [Path(name) for name in inputs]
    for path in paths:
        if path.is_dir():
            raise UserError(f"{path}: a directory; name its files (e.g. {path}/*.jsonl)")
        if not path.is_file():
            raise UserError(f"{path}: no such input file")
    return paths


def documents(paths: list[Path], chosen_format: str, keys: list[str], sample_by: str) -> Iterator[Document]:
    """Every document of every input, in the order given."""
    for path in paths:
        kind = input_format(path, chosen_format)
        if kind == "jsonl":
            yield from _jsonl(path, keys)
        elif kind == "parquet":
            yield from _parquet(path, keys)
        else:
            yield from _text(path, keys, sample_by)


def _fields(record: object, keys: list[str], where: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with {keys}, got {type(record).__name__}")
    missing = [key for key in keys if key not in record]
    if missing:
        raise UserError(f"{where}: no field {missing[0]!r} (fields: {sorted(record)}); choose them with --json-keys")
    texts = {key: record[key] for key in keys}
    wrong = [key for key, text in texts.items() if not isinstance(text, str)]
    if wrong:
        raise UserError(f"{where}: field {wrong[0]!r} is {type(texts[wrong[0]]).__name__}, expected a string")
    for key, text in texts.items():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON's "\ud800" escapes decode to a lone surrogate
            raise UserError(
                f"{where}: field {key!r} is not Unicode text (a lone surrogate {text[exc.start]!r} at character "
                f"{exc.start}); fix or drop that record"
            ) from None
    return texts


def _jsonl(path: Path, keys: list[str]) -> Iterator[Document]:
    with _opened(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise UserError(f"{path}:{number}: not a JSON line ({exc}); expected one object per line") from None
            except RecursionError:
                raise UserError(f"{path}:{number}: JSON nested too deeply to read; expected a flat object") from None
            yield _fields(record, keys, f"{path}:{number}"), len(line)


def _opened(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _parquet(path: Path, keys: list[str]) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading parquet needs pyarrow (pip install 'coretrain-plugins[hf]')") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several kinds for a file that is not parquet
        raise UserError(f"{path}: not a parquet file ({exc})") from None
    columns = table.schema_arrow.names
    missing = [key for key in keys if key not in columns]
    if missing:
        raise UserError(f"{path}: no column {missing[0]!r} (columns: {columns}); choose them with --json-keys")
    size, rows = path.stat().st_size, max(1, table.metadata.num_rows)
    row = 0
    for batch in table.iter_batches(columns=keys):
        for record in batch.to_pylist():
            row += 1
            yield _fields(record, keys, f"{path}: row {row}"), size // rows


def _text(path: Path, keys: list[str], sample_by: str) -> Iterator[Document]:
    if len(keys) != 1:
        raise UserError(f"{path}: a text file has one field; give one --json-keys name (the output's KEY)")
    try:
        with _opened(path) as file:
            text = file.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc})") from None
    if sample_by == "document":
        pieces = [text]
    elif sample_by == "paragraph":
        pieces = [piece.strip("\n") for piece in text.split("\n\n")]
    else:
        pieces = text.splitlines()
    for piece in pieces:
        if piece.strip():
            yield {keys[0]: piece}, len(piece.encode("utf-8")) + 1
