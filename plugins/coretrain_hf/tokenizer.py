"""The tokenizer both text providers read: a local directory, or one clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coretrain import UserError, require


def load_tokenizer(path: str, needed_by: str) -> Any:
    """``AutoTokenizer`` from a local directory, nothing downloaded."""
    transformers = require("transformers", needed_by=needed_by, extra="hf")
    directory = Path(path)
    if not directory.is_dir():
        raise UserError(f"data.options.tokenizer: {directory} is not a directory (a saved tokenizer)")
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"data.options.tokenizer: cannot load a tokenizer from {directory}: {exc}") from None
