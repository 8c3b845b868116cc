"""``token-file``: pre-tokenized data in flat binary files, memory-mapped (nanoGPT's train.bin).

The file is a bare array of uint16 or uint32 token ids (``np.array(ids, np.uint16).tofile``),
read through a memory map so only the windows a batch touches are paged in.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from attrs import define

from coretrain import hookimpl

DTYPES = {"uint16": 2, "uint32": 4}


def open_tokens(path: str, dtype: str) -> Any:
    """Memory-map ``path`` as a 1-D tensor of ``dtype`` token ids."""
    import torch

    from coretrain.errors import UserError

    try:
        size = os.path.getsize(path)
    except OSError:
        raise UserError(f"data.options: token file '{path}' not found") from None
    width = DTYPES[dtype]
    if size % width:
        raise UserError(f"{path}: size {size} is not a multiple of {width} bytes; is dtype '{dtype}' right?")
    return torch.from_file(path, shared=False, size=size // width, dtype=getattr(torch, dtype))


def write_tokens(path: str, tokens: Any, dtype: str = "uint16") -> None:
    """Write token ids in the layout this plugin reads (native byte order, like numpy's tofile)."""
    import array

    with open(path, "wb") as f:
        array.array({"uint16": "H", "uint32": "I"}[dtype], (int(t) for t in tokens)).tofile(f)


def max_token(tokens: Any, chunk: int = 1 << 24) -> int:
    """Largest id, scanning in chunks (torch has no max for uint16, and widening all would copy)."""
    import torch

    return max(int(tokens[i:i + chunk].to(torch.int64).max()) for i in range(0, tokens.numel(), chunk))


@define(kw_only=True)
class TokenFile:
    """Memory-mapped flat token files (uint16/uint32), nanoGPT / Megatron style."""

    train_path: str
    """Training tokens (.bin)."""
    valid_path: str | None = None
    """Validation tokens; unset = no validation."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Width of each token id in the file."""
    seq_length: int = 1024
    """Tokens per sample."""
    vocab_size: int | None = None
    """Vocabulary size, passed on to the model; unset = the largest id seen + 1 (scans the file)."""

    @hookimpl
    def provide_datasets(self, run: Any, context: Any) -> Any:
        from coretrain.data import TokenWindows
        from coretrain.run import Datasets

        train_tokens = open_tokens(self.train_path, self.dtype)
        valid = TokenWindows(open_tokens(self.valid_path, self.dtype), self.seq_length) if self.valid_path else None
        vocab_size = self.vocab_size or max_token(train_tokens) + 1
        return Datasets(train=TokenWindows(train_tokens, self.seq_length), valid=valid,
                        seq_length=self.seq_length, vocab_size=vocab_size)
