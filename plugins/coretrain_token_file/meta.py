"""nanoGPT's ``meta.pkl``: the character vocabulary its ``prepare.py`` writes beside
``train.bin`` (``{"vocab_size", "itos", "stoi"}``), read as data, never as code, and turned into
the tokenizer its ``sample.py`` builds from it (``encode``, ``decode``)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from coretrain import UserError

MAX_BYTES = 16 * 1024 * 1024
"""A vocabulary file is kilobytes; a larger one is not read."""


class NoCode(pickle.Unpickler):
    """Plain dicts, strings and numbers only: a pickle naming any function or class (the way a
    pickle runs code) is refused before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}; a vocabulary holds only dicts of text and ids")


class CharTokenizer:
    """Each character one id, as nanoGPT's shakespeare_char ``prepare.py`` numbers them."""

    def __init__(self, itos: dict[int, str], path: Path) -> None:
        self.itos, self.path = itos, path
        self.stoi = {char: i for i, char in itos.items()}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({char for char in text if char not in self.stoi})
        if unknown:
            raise UserError(f"{self.path}: the characters {unknown} are not in this vocabulary of {len(self)}")
        return [self.stoi[char] for char in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos.get(i, "") for i in ids)


def read_meta(path: Path) -> CharTokenizer:
    """The tokenizer of a ``meta.pkl``, or one error naming the file and what is wrong with it."""
    if path.stat().st_size > MAX_BYTES:
        raise UserError(f"{path}: {path.stat().st_size} bytes is no character vocabulary (nanoGPT's meta.pkl)")
    try:
        meta = NoCode(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise UserError(f"{path}: not read as nanoGPT's meta.pkl: {exc}") from None
    itos = meta.get("itos") if isinstance(meta, dict) else None  # its 'stoi' is the same map inverted
    if not isinstance(itos, dict):
        raise UserError(f"{path}: nanoGPT's meta.pkl holds a dict with 'itos' (id -> character); this one does not")
    if not all(isinstance(i, int) and isinstance(s, str) for i, s in itos.items()):
        raise UserError(f"{path}: 'itos' maps ids (int) to characters (str); this one holds other things")
    return CharTokenizer(itos, path)
