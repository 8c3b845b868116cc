"""Read checkpoint files without ever running code from them.

Every file of a checkpoint goes through one of three readers here:

- ``.pt`` files: ``torch.load(weights_only=True)``, torch's allowlist unpickler;
- DCP's ``.metadata``: :mod:`coretrain.checkpoint.dcpmetadata`, an unpickler that names only the classes
  DCP metadata is made of and changes nothing but the objects it makes (DCP's own reader calls
  plain ``pickle.load``, so a crafted ``.metadata`` would run code);
- non-tensor items inside DCP shards (optimizer param groups): ``weights_only=True`` too
  (DCP's planner loads them with ``weights_only=False``).

A file that fails is a :class:`CheckpointUnreadable` naming it: ``unsafe`` when it holds
something that is not plain data (a crafted or foreign file: the run stops), otherwise
corrupt (truncated, garbage, missing: an automatic resume may fall back to an older one).
What plugins hand over to be saved is checked to be loadable the same way (:func:`check_plain`).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import IO, Any, cast

import torch

from coretrain.checkpoint import dcpmetadata
from coretrain.errors import CheckpointUnreadable


def _reason(exc: BaseException) -> tuple[str, bool]:
    """(one-line reason, unsafe?) for an exception raised while reading a checkpoint file."""
    text = str(exc)
    if isinstance(exc, dcpmetadata.Refused):
        return f"{text}, which a checkpoint never holds (a crafted or foreign file?); nothing was run", True
    if isinstance(exc, pickle.UnpicklingError) and ("Weights only load failed" in text or "not allowed" in text):
        found = re.search(r"GLOBAL [\w.]+", text)
        what = found.group(0) if found else "an object that is not plain data"
        return f"it names {what}, which a checkpoint never holds (a crafted or foreign file?); nothing was run", True
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    first = first.split(". ")[0][:200]  # torch's messages go on for sentences
    return f"{type(exc).__name__}{': ' + first if first else ''}", False


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What a DCP call may raise: DCP's CheckpointException derives from BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def first_failure(exc: BaseException) -> BaseException:
    """The underlying error of DCP's CheckpointException (which maps rank -> (error, stack))."""
    for failure in (getattr(exc, "failures", None) or {}).values():
        return cast(BaseException, failure[0] if isinstance(failure, tuple) else failure)
    return exc


def dcp_unreadable(directory: Path, exc: BaseException) -> CheckpointUnreadable:
    """What a failed DCP load becomes: our own error if a restricted reader refused, else 'corrupt'."""
    cause = first_failure(exc)
    return cause if isinstance(cause, CheckpointUnreadable) else unreadable(directory, cause)


def unreadable(path: Path, exc: BaseException) -> CheckpointUnreadable:
    reason, unsafe = _reason(exc)
    return CheckpointUnreadable(path, f"cannot load checkpoint file: {reason}", unsafe=unsafe)


def load_file(path: Path) -> Any:
    """A ``.pt`` file of a checkpoint, through torch's allowlist unpickler."""
    if not path.is_file():
        raise CheckpointUnreadable(path, "checkpoint file missing; the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, crafted pickle, garbage: name the file
        raise unreadable(path, exc) from None


def load_metadata(stream: IO[bytes], path: Path) -> Any:
    """DCP ``Metadata`` from ``stream``, or a :class:`CheckpointUnreadable` naming ``path``."""
    try:
        return dcpmetadata.load(stream)
    except Exception as exc:
        raise unreadable(path, exc) from None


def check_metadata(directory: Path, path: Path | None = None) -> Any:
    """Read a DCP directory's ``.metadata`` (or the metadata file ``path``) through the restricted
    unpickler before DCP touches it (DCP logs a traceback and retries with other files when its
    reader fails); it, checked."""
    path = path or directory / ".metadata"
    if not path.is_file():
        raise CheckpointUnreadable(path, "missing; the sharded checkpoint is incomplete")
    with open(path, "rb") as stream:
        return load_metadata(stream, path)


def dcp_reader(directory: Path, checked: Any = None) -> Any:
    """A torch.distributed.checkpoint FileSystemReader whose ``.metadata`` read is restricted;
    ``checked``: the directory's ``.metadata`` as :func:`check_metadata` read it (not read again:
    the restricted unpickler takes 1.4 s for 28,800 chunks)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            """torch's own ``read_metadata`` (storage_meta and its load_id set alike), with
            ``pickle.load`` replaced by the restricted reader."""
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            metadata = checked if checked and path == directory / ".metadata" else check_metadata(directory, path)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(directory))


def _safe_bytes(planner: Any, read_item: Any, value: io.BytesIO, where: Path) -> io.BytesIO:
    """Load a non-tensor DCP item with weights_only; re-serialize the checked value for the planner."""
    try:
        obj = torch.load(value, weights_only=True)
    except Exception as exc:
        raise unreadable(where, exc) from None
    checked = io.BytesIO()
    torch.save(obj, checked)
    checked.seek(0)
    return checked


def dcp_planner(directory: Path, *, empty: bool = False) -> Any:
    """DCP's load planner (or the one that builds the state dict from metadata, for export),
    with non-tensor items loaded through the allowlist unpickler."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    base: Any = _EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner

    class SafeLoadPlanner(base):  # type: ignore[misc]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            super().load_bytes(read_item, _safe_bytes(self, read_item, value, directory))

    return SafeLoadPlanner()


PLAIN_TYPES = (bool, int, float, str, type(None))


MAX_STATE_DEPTH = 64
"""Nesting a plugin's saved state may have: deeper is a mistake (or a structure that refers
to itself), and Python's own limit would end the save with an unnamed RecursionError."""


def check_plain(obj: Any, where: str, depth: int = 0, open_: frozenset[int] = frozenset()) -> None:
    """Raise TypeError naming the first value a ``weights_only`` load would refuse, a list or
    dict that contains itself, or nesting deeper than :data:`MAX_STATE_DEPTH`."""
    if isinstance(obj, PLAIN_TYPES) or type(obj) in (torch.Tensor, torch.nn.Parameter):
        return
    if type(obj) not in (list, tuple, dict):
        raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}")
    if id(obj) in open_:
        raise TypeError(f"{where} contains itself (a {type(obj).__name__} that refers back to an enclosing one)")
    if depth >= MAX_STATE_DEPTH:
        raise TypeError(f"{where} is nested more than {MAX_STATE_DEPTH} levels deep")
    inner = open_ | {id(obj)}
    if type(obj) is dict:
        for key, item in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}: {key!r}")
            check_plain(item, f"{where}[{key!r}]", depth + 1, inner)
        return
    for i, item in enumerate(obj):
        check_plain(item, f"{where}[{i}]", depth + 1, inner)
