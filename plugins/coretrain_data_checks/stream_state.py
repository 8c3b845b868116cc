"""Whether a train stream's own ``state_dict()`` puts it back where it stands.

A checkpoint keeps a stream's position through the stream's ``state_dict()`` (the ``streams``
plugin, torchdata's loader in each worker), and a resumed run starts where ``load_state_dict()``
puts it. A stream that counts an item only once its ``yield`` has returned (``yield item`` then
``self.position += 1``) hands over a state one item behind: the resumed run reads that item
again, and nothing says so. So, once before training, the stream is read a few items in, its
state taken, the next item read; then the state is loaded and the stream read again: the same
item must come. The stream is put back where it stood before the check.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

READ_BEFORE = 3
"""Items read before the state is taken."""


def stream_state_problem(stream: Any) -> str | None:
    """What a resume from ``stream``'s state would read instead of the next item, or None: it
    resumes there, it has no state of its own (the loader replays it), or it could not be read
    here (a short stream, a failing read: training says so in its own words)."""
    if not (callable(getattr(stream, "state_dict", None)) and callable(getattr(stream, "load_state_dict", None))):
        return None
    try:
        initial = copy.deepcopy(stream.state_dict())
    except Exception:  # a state that exists only once reading began: checkpoints take it then
        return None
    try:
        items = iter(stream)
        read = [next(items) for _ in range(READ_BEFORE)]
        state = copy.deepcopy(stream.state_dict())
        expected = next(items)
        stream.load_state_dict(state)
        resumed = next(iter(stream))
    except Exception:
        return None
    finally:
        stream.load_state_dict(initial)  # the run reads the stream from where it stood
    if same(resumed, expected):
        return None
    if same(resumed, read[-1]):
        return (
            f"after {READ_BEFORE} items, a stream loaded with it yields item {READ_BEFORE} again instead of item "
            f"{READ_BEFORE + 1}: its position is counted after the yield; count it before (position += 1, then yield)"
        )
    return (
        f"after {READ_BEFORE} items, a stream loaded with it does not yield item {READ_BEFORE + 1} next: its state "
        "leaves out part of its position (a shuffle buffer, an iterator's own counter)"
    )


def same(a: Any, b: Any) -> bool:
    """Whether two items hold the same values: tensors and arrays, nested in tuples, lists and dicts,
    beside strings and numbers (a Hugging Face stream's text fields), which torch.testing.assert_close refuses."""
    if isinstance(a, torch.Tensor) or hasattr(a, "__array__"):
        try:
            return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
        except (TypeError, ValueError, RuntimeError):
            return False
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # a type whose == is not a truth value: not known to be the same
        return False
