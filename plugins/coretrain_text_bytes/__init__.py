"""``text-bytes``: byte-level language-modelling data from text files matched by globs.

Needs no download and no tokenizer: every byte is a token (vocab 256). By default it reads
the running Python's standard library source, which ships with every Python. Files are
split into train and valid by a hash of their path, so the split never depends on the
order files are found in or on how many there are.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from pathlib import Path
from typing import Any, Literal

from attrs import define, field

from coretrain import Run, fraction, hookimpl, positive


def default_globs() -> list[str]:
    return [str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")]


def is_valid_file(path: str, valid_fraction: float) -> bool:
    digest = hashlib.sha256(Path(path).name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < valid_fraction


class ByteTokenizer:
    """Text to the ids this data holds and back: each UTF-8 byte is one token."""

    def __len__(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")  # a sampled byte may end mid-character


@define(kw_only=True)
class TextBytes:
    """Byte-level LM dataset over text files (default: the Python standard library source)."""

    globs: list[str] = field(factory=list)
    """Glob patterns ('**' recurses); empty = the standard library's top-level *.py files."""
    seq_length: int = field(default=256, validator=positive)
    """Tokens (bytes) per sample."""
    valid_fraction: float = field(default=0.05, validator=fraction)
    """Share of files held out for validation (chosen by a hash of the file name)."""
    max_bytes: int | None = field(default=None, validator=positive)
    """Read at most this many bytes of training text (files in sorted order)."""
    sampling: Literal["windows", "random"] = "windows"
    """Training samples: non-overlapping windows, or windows at seeded random offsets
    (nanoGPT's get_batch), a fresh one for every sample of the run; validation stays fixed."""

    def files(self) -> list[str]:
        patterns = self.globs or default_globs()
        found = sorted({p for pattern in patterns for p in glob.glob(pattern, recursive=True) if Path(p).is_file()})
        return found

    @hookimpl
    def provide_datasets(self, run: Run, context: Any) -> Any:
        import torch
        from coretrain_windows import TokenWindows, windows

        from coretrain import Datasets, UserError

        files = self.files()
        if len(files) < 2:
            import os

            raise UserError(
                f"data.options.globs: {self.globs or default_globs()} matched {len(files)} file(s) "
                f"(relative patterns are resolved against {os.getcwd()}); need at least 2 (one for "
                "training, one for validation)"
            )
        valid_files = [f for f in files if is_valid_file(f, self.valid_fraction)] or files[-1:]
        train_files = [f for f in files if f not in valid_files]

        def read(paths: list[str], limit: int | None) -> torch.Tensor:
            chunks, total = [], 0
            for path in paths:
                data = Path(path).read_bytes() + b"\n"
                chunks.append(data)
                total += len(data)
                if limit is not None and total >= limit:
                    break
            blob = b"".join(chunks)[:limit]
            return torch.frombuffer(bytearray(blob), dtype=torch.uint8)

        train = windows(
            read(train_files, self.max_bytes), self.seq_length, self.sampling, context.train_samples, context.seed
        )
        valid = TokenWindows(read(valid_files, None), self.seq_length)
        if len(train) == 0 or len(valid) == 0:
            raise UserError(f"data.options.seq_length ({self.seq_length}) is longer than the text read; lower it")
        return Datasets(train=train, valid=valid, seq_length=self.seq_length, vocab_size=256, tokenizer=ByteTokenizer())
