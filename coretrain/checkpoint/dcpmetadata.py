"""Read torch.distributed.checkpoint's ``.metadata`` pickle without letting it change anything.

DCP's own reader calls plain ``pickle.load``. An allowlist of classes (what ``find_class``
may return) is not enough on its own: pickle's BUILD opcode runs ``setattr`` on whatever object
is on its stack, and an allowed *class* can be put there — one crafted file set an attribute
on ``pathlib.PosixPath`` and made every path in the process print as another file. SETITEMS and
APPENDS likewise mutate whatever they are given.

So the metadata goes through the pure-Python unpickler with its mutating opcodes guarded:
BUILD only on instances of the DCP dataclasses (which exist only as objects this load made),
SETITEM(S) only on plain dicts, APPEND(S) only on plain lists, no sets, no persistent ids.
The result must then be a ``Metadata`` whose parts have the types DCP writes, and whose
storage entries name files inside the checkpoint directory (a ``../`` entry would make a
load read another checkpoint's tensors). Every refusal is :class:`Refused`: the file was
crafted. The pure-Python unpickler is slower than C's; metadata is read once per load.
"""

from __future__ import annotations

import collections
import pickle
from pathlib import PurePosixPath
from typing import IO, Any

import torch

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": set(
        "Metadata TensorStorageMetadata TensorProperties _MEM_FORMAT_ENCODING ChunkStorageMetadata "
        "BytesStorageMetadata MetadataIndex StorageMeta".split()
    ),
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_BUILDABLE = {  # BUILD fills in instances of DCP's own dataclasses only (not the enum, not a class)
    (module, name)
    for module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    for name in _ALLOWED[module] - {"_MEM_FORMAT_ENCODING"}
}


_DICTS = (dict, collections.OrderedDict)


class Refused(pickle.UnpicklingError):
    """The pickle asked for something DCP metadata never holds: a crafted file."""


_PurePythonUnpickler: Any = pickle._Unpickler  # its opcodes are methods in a table: they can be guarded


def _guarded(dispatch: dict[int, Any], opcode: str, kinds: tuple[type, ...], target: Any) -> tuple[int, Any]:
    """Pickle's ``opcode`` run only when what it would change (``target(unpickler)``) is one of ``kinds``."""
    code, original = getattr(pickle, opcode)[0], dispatch[getattr(pickle, opcode)[0]]

    def load(self: Any) -> None:
        if type(target(self)) not in kinds:
            raise Refused(f"{opcode} on a {type(target(self)).__qualname__} is not allowed")
        original(self)

    return code, load


class MetadataUnpickler(_PurePythonUnpickler):  # type: ignore[misc]
    """Pure-Python unpickler: allowlisted globals, and mutating opcodes only on what they may mutate."""

    dispatch = dict(_PurePythonUnpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise Refused(f"GLOBAL {module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("persistent ids are not allowed")

    def load_build(self) -> None:
        kind = type(self.stack[-2] if len(self.stack) >= 2 else None)
        if (kind.__module__, kind.__qualname__) not in _BUILDABLE:
            raise Refused(f"BUILD on a {kind.__qualname__} is not allowed")
        super().load_build()

    def load_additems(self) -> None:
        raise Refused("sets are not allowed")

    def _below_mark(self) -> Any:
        """The object under the topmost mark (what SETITEMS / APPENDS would change)."""
        return self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None

    dispatch[pickle.BUILD[0]] = load_build
    dispatch.update(  # each changes the object below its operands, or the one under the mark
        [
            _guarded(dispatch, "SETITEM", _DICTS, lambda self: self.stack[-3] if len(self.stack) >= 3 else None),
            _guarded(dispatch, "SETITEMS", _DICTS, lambda self: self._below_mark()),
            _guarded(dispatch, "APPEND", (list,), lambda self: self.stack[-2] if len(self.stack) >= 2 else None),
            _guarded(dispatch, "APPENDS", (list,), lambda self: self._below_mark()),
        ]
    )
    dispatch[pickle.ADDITEMS[0]] = load_additems


def load(stream: IO[bytes]) -> Any:
    """The ``Metadata`` in ``stream``; :class:`Refused` when it is anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = MetadataUnpickler(stream).load()
    if type(metadata) is not Metadata:
        raise Refused(f"the file holds a {type(metadata).__qualname__}, not DCP Metadata")
    check_structure(metadata)
    return metadata


def check_structure(metadata: Any) -> None:
    """The parts DCP reads have the types DCP writes; storage entries stay inside the checkpoint."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    if type(metadata.state_dict_metadata) is not dict:
        raise Refused("state_dict_metadata is not a dict")
    for key, entry in metadata.state_dict_metadata.items():
        if type(key) is not str or type(entry) not in (TensorStorageMetadata, BytesStorageMetadata):
            raise Refused(f"state_dict_metadata entry {key!r} is a {type(entry).__qualname__}")
    storage = metadata.storage_data
    if storage is None:
        return
    if type(storage) is not dict:
        raise Refused("storage_data is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise Refused(f"storage_data entry {index!r} is a {type(info).__qualname__}")
        path = info.relative_path
        if type(path) is not str or not path or PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts:
            raise Refused(f"storage entry {index.fqn!r} points outside the checkpoint: {path!r}")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise Refused(f"storage entry {index.fqn!r} has a bad offset or length")
