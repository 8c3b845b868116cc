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

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_ALLOWED = {
    _DCP_METADATA: {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
    },
    _DCP_FILESYSTEM: {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
"""The classes (and one function) DCP metadata is made of: all ``find_class`` may return, besides
torch's dtypes."""

_BUILDABLE = {(_DCP_METADATA, name) for name in _ALLOWED[_DCP_METADATA] - {"_MEM_FORMAT_ENCODING"}}
_BUILDABLE |= {(_DCP_FILESYSTEM, name) for name in _ALLOWED[_DCP_FILESYSTEM]}
"""What BUILD may fill in: instances of DCP's own dataclasses (not the enum, and never a class)."""

_DICTS = (dict, collections.OrderedDict)


class Refused(pickle.UnpicklingError):
    """The pickle asked for something DCP metadata never holds: a crafted file."""


_PurePythonUnpickler: Any = pickle._Unpickler  # its opcodes are methods in a table: they can be guarded


class MetadataUnpickler(_PurePythonUnpickler):  # type: ignore[misc]
    """Pure-Python unpickler: allowlisted globals, and mutating opcodes only on what they may mutate."""

    dispatch = dict(_PurePythonUnpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        """The allowlist's classes and torch's dtypes; any other global (a function to call) is refused."""
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise Refused(f"GLOBAL {module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("persistent ids are not allowed")

    def load_build(self) -> None:
        """BUILD sets the state of ``stack[-2]``: only on an instance of a DCP dataclass."""
        kind = type(self._on_stack(2))
        if (kind.__module__, kind.__qualname__) not in _BUILDABLE:
            raise Refused(f"BUILD on a {kind.__qualname__} is not allowed")
        super().load_build()

    def load_setitem(self) -> None:
        """SETITEM: ``stack[-3][stack[-2]] = stack[-1]``, only on a plain dict."""
        _only_on(self._on_stack(3), _DICTS, "SETITEM")
        super().load_setitem()

    def load_setitems(self) -> None:
        """SETITEMS: the pairs above the mark into the object under it, only a plain dict."""
        _only_on(self._below_mark(), _DICTS, "SETITEMS")
        super().load_setitems()

    def load_append(self) -> None:
        """APPEND: ``stack[-2].append(stack[-1])``, only on a plain list."""
        _only_on(self._on_stack(2), (list,), "APPEND")
        super().load_append()

    def load_appends(self) -> None:
        """APPENDS: the items above the mark onto the object under it, only a plain list."""
        _only_on(self._below_mark(), (list,), "APPENDS")
        super().load_appends()

    def load_additems(self) -> None:
        raise Refused("sets are not allowed")

    def _on_stack(self, depth: int) -> Any:
        """The object ``depth`` places from the top of the stack (None when there is none)."""
        return self.stack[-depth] if len(self.stack) >= depth else None

    def _below_mark(self) -> Any:
        """The object under the topmost mark (what SETITEMS / APPENDS would change)."""
        return self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.ADDITEMS[0]] = load_additems


def _only_on(target: Any, kinds: tuple[type, ...], opcode: str) -> None:
    """A mutating opcode may change only an object of ``kinds`` (made by this load)."""
    if type(target) not in kinds:
        raise Refused(f"{opcode} on a {type(target).__qualname__} is not allowed")


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
