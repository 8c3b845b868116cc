"""``token-file``: pre-tokenized data in flat binary files, memory-mapped (nanoGPT's train.bin).

The file is a bare array of uint16 or uint32 token ids (``np.array(ids, np.uint16).tofile``),
read through a memory map so only the windows a batch touches are paged in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from attrs import define, field

from coretrain import Run, hookimpl, positive

DTYPES = {"uint16": 2, "uint32": 4}
MAX_GUESSED_VOCAB = 1 << 22  # 4M ids: above every real tokenizer, below an embedding that exhausts memory


def open_tokens(path: str, dtype: str) -> Any:
    """Memory-map ``path`` as a 1-D tensor of ``dtype`` token ids."""
    import torch

    from coretrain import UserError

    if os.path.isdir(path):
        raise UserError(f"data.options: token file '{path}' is a directory; name the .bin file inside it")
    try:
        size = os.path.getsize(path)
    except OSError:
        raise UserError(f"data.options: token file '{path}' not found (relative to {os.getcwd()})") from None
    width = DTYPES[dtype]
    if size == 0:
        raise UserError(f"{path}: the token file is empty")
    if size % width:
        raise UserError(f"{path}: size {size} is not a multiple of {width} bytes; is dtype '{dtype}' right?")
    tokens = torch.from_file(path, shared=False, size=size // width, dtype=getattr(torch, dtype))
    if dtype == "uint16" and tokens.numel() >= 64 and size % 4 == 0:
        sample = tokens[:4096].to(torch.int64)
        if bool((sample[1::2] == 0).all()) and bool((sample[0::2] != 0).any()):  # little-endian uint32 ids
            raise UserError(f"{path}: every second uint16 is 0, as in a uint32 file; set data.options.dtype = 'uint32'")
    return tokens


def write_tokens(path: str, tokens: Any, dtype: str = "uint16") -> None:
    """Write token ids in the layout this plugin reads (native byte order, like numpy's tofile)."""
    import array

    with open(path, "wb") as f:
        array.array({"uint16": "H", "uint32": "I"}[dtype], (int(t) for t in tokens)).tofile(f)


def max_token(tokens: Any, chunk: int = 1 << 24) -> int:
    """Largest id, scanning in chunks (torch has no max for uint16, and widening all would copy)."""
    import torch

    return max(int(tokens[i : i + chunk].to(torch.int64).max()) for i in range(0, tokens.numel(), chunk))


@define(kw_only=True)
class TokenFile:
    """Memory-mapped flat token files (uint16/uint32), nanoGPT / Megatron style."""

    train_path: str
    """Training tokens (.bin)."""
    valid_path: str | None = None
    """Validation tokens; unset = no validation."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Width of each token id in the file."""
    seq_length: int = field(default=1024, validator=positive)
    """Tokens per sample."""
    vocab_size: int | None = field(default=None, validator=positive)
    """Vocabulary size, passed on to the model; unset = the largest id seen + 1 (scans the file)."""
    sampling: Literal["windows", "random"] = "windows"
    """Training samples: non-overlapping windows, or windows at seeded random offsets
    (nanoGPT's get_batch), a fresh one for every sample of the run; validation stays fixed."""
    meta_path: str | None = None
    """nanoGPT's ``meta.pkl`` (its character vocabulary), read as data, never run: what
    ``coretrain predict --data`` turns prompts into ids with; unset = the ``meta.pkl`` beside
    ``train_path`` if there is one, as nanoGPT's ``sample.py`` finds it (else the run's ``[tokenizer]``)."""

    @hookimpl
    def provide_datasets(self, run: Run, context: Any) -> Any:
        from coretrain_windows import TokenWindows, windows

        from coretrain import Datasets, UserError

        train_tokens = open_tokens(self.train_path, self.dtype)
        valid = TokenWindows(open_tokens(self.valid_path, self.dtype), self.seq_length) if self.valid_path else None
        vocab_size = self.vocab_size or max_token(train_tokens) + 1
        if not self.vocab_size and vocab_size > MAX_GUESSED_VOCAB:
            raise UserError(
                f"{self.train_path}: token ids go up to {vocab_size - 1}, far beyond any tokenizer's "
                f"vocabulary: is dtype '{self.dtype}' right? (or set data.options.vocab_size)"
            )
        train = windows(train_tokens, self.seq_length, self.sampling, context.train_samples, context.seed)
        return Datasets(
            train=train, valid=valid, seq_length=self.seq_length, vocab_size=vocab_size, tokenizer=self.vocabulary()
        )

    def vocabulary(self) -> Any:
        """The character tokenizer of nanoGPT's ``meta.pkl``, or None without one."""
        from coretrain import UserError
        from coretrain_token_file.meta import read_meta

        path = Path(self.meta_path) if self.meta_path else Path(self.train_path).with_name("meta.pkl")
        if not path.is_file():
            if self.meta_path:
                raise UserError(f"data.options.meta_path: {path}: no such file (relative to {os.getcwd()})")
            return None
        return read_meta(path)
