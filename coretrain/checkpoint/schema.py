"""What each checkpoint file must look like, checked before anything of it is applied.

A file that loads safely can still be wrong: a rank file with extra or missing keys, a short
RNG state, optimizer moments of the wrong shape, a negative step. Applied, these stopped a
resume with a bare exception halfway through changing the run — or, with a step of -7, went
on to overwrite real checkpoints. Each file is checked here against its schema; a mismatch is
a :class:`CheckpointUnreadable` naming the file and the key path, which an automatic resume
falls back past like a corrupt file.

A schema is a check: a callable ``(value, where) -> None`` that raises :class:`Mismatch`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from coretrain.errors import CheckpointUnreadable, UserError

Check = Callable[[Any, str], None]
DICTS = (dict, collections.OrderedDict)  # state_dict() returns the second


class Mismatch(Exception):
    """Where in the file (a key path), what was expected there and what was found: a number or
    text quoted, anything else by its type (a tensor's values are no help)."""

    def __init__(self, where: str, expected: str, value: Any) -> None:
        found = type(value).__name__ if not isinstance(value, (int, float, str)) else repr(value)[:40]
        super().__init__(f"{where or 'the file'}: expected {expected}, found {found}")


def satisfies(test: Callable[[Any], bool], expected: str) -> Check:
    """A value for which ``test`` holds; else a :class:`Mismatch` saying ``expected``."""

    def check(value: Any, where: str) -> None:
        if not test(value):
            raise Mismatch(where, expected, value)

    return check


def integer(minimum: int = 0) -> Check:
    return satisfies(lambda value: type(value) is int and value >= minimum, f"an integer >= {minimum}")


def kind(*types: type) -> Check:
    return satisfies(lambda value: type(value) in types, " or ".join(t.__name__ for t in types))


def optional(inner: Check, empty: Any = None) -> Check:
    """``inner``, or None or ``empty`` (what a part with nothing in it is saved as: ``{}``)."""

    def check(value: Any, where: str) -> None:
        if value is not None and not (type(value) is type(empty) and value == empty):
            inner(value, where)

    return check


def one_of(*choices: Any) -> Check:
    return satisfies(lambda value: value in choices, " or ".join(map(repr, choices)))


def tensor(
    dtype: torch.dtype | None = None,
    numel: Callable[[], int] | None = None,
    dim: int | None = None,
    finite: bool = False,
) -> Check:
    """A tensor of this dtype, dimension and element count (``numel`` is asked when the file is
    checked: it depends on the model), all finite if ``finite``."""

    def check(value: Any, where: str) -> None:
        if not isinstance(value, torch.Tensor):
            raise Mismatch(where, "a tensor", value)
        if dtype is not None and value.dtype != dtype:
            raise Mismatch(where, f"a {dtype} tensor", value.dtype)
        if dim is not None and value.dim() != dim:
            raise Mismatch(where, f"a {dim}-d tensor", value.dim())
        if numel is not None and value.numel() != numel():
            raise Mismatch(where, f"{numel()} elements", value.numel())
        if finite and not bool(torch.isfinite(value).all()):
            raise Mismatch(where, "finite values", "NaN or Inf")

    return check


def number(minimum: float, strictly: bool = False) -> Check:
    """A finite int or float ``>= minimum`` (``> minimum`` when ``strictly``)."""

    def test(value: Any) -> bool:
        return (
            type(value) in (int, float) and math.isfinite(value) and (value > minimum if strictly else value >= minimum)
        )

    return satisfies(test, f"a finite number {'>' if strictly else '>='} {minimum}")


def items(*checks: Check, each: Check | None = None) -> Check:
    """A list or tuple of exactly these items, or of any number of ``each``."""

    def check(value: Any, where: str) -> None:
        if type(value) not in (list, tuple) or (each is None and len(value) != len(checks)):
            raise Mismatch(where, "a list" if each else f"a list of {len(checks)}", value)
        for i, item in enumerate(value):
            (each or checks[i])(item, f"{where}[{i}]")

    return check


def mapping(values: Check, keys: Check | None = None) -> Check:
    """A dict of ``values`` by ``keys`` (default: strings)."""
    keys = keys or kind(str)

    def check(value: Any, where: str) -> None:
        if type(value) not in DICTS:
            raise Mismatch(where, "a table", value)
        for key, item in value.items():
            keys(key, f"{where} key")
            values(item, f"{where}.{key}" if where else str(key))

    return check


def table(
    required: Mapping[str, Check], optional_keys: Mapping[str, Check] | None = None, *, strict: bool = True
) -> Check:
    """A dict with these keys (``strict``: and no others)."""
    extra = optional_keys or {}

    def check(value: Any, where: str) -> None:
        if type(value) not in DICTS:
            raise Mismatch(where, "a table", value)
        prefix = f"{where}." if where else ""
        for key, inner in required.items():
            if key not in value:
                raise Mismatch(f"{prefix}{key}", "a value (the key is missing)", None)
            inner(value[key], f"{prefix}{key}")
        for key, item in value.items():
            if key in extra:
                extra[key](item, f"{prefix}{key}")
            elif key not in required and strict:
                raise Mismatch(f"{prefix}{key}", "no such key", item)

    return check


def anything(value: Any, where: str) -> None:
    """Any value (plugin state: the plugin checks its own)."""


def validate(value: Any, schema: Check, path: Path) -> None:
    """``value``, read from ``path``, fits ``schema``; else the file is unreadable, which a resume
    falls back past, as it does a corrupt one."""
    try:
        schema(value, "")
    except Mismatch as exc:
        raise CheckpointUnreadable(path, f"not a valid checkpoint file: {exc}") from None


# --------------------------------------------------------------------------- the files


SERIES = table(
    {  # the pending interval's applied losses: never NaN (a NaN step is either skipped or stops the run)
        "losses": tensor(torch.float32, dim=1, finite=True),
        "grad_norms": tensor(torch.float32, dim=1),
    },
    {  # "samples": what 0.3.0 counted for its rates (the timers plugin's since)
        "values": mapping(tensor(torch.float32, dim=1)),
        "steps": tensor(torch.int64, dim=1),
        "skipped": integer(),
        "samples": integer(),
    },
)

RNG = table(
    {
        "python": items(integer(), items(*[integer()] * 625), optional(kind(float))),
        "torch": tensor(torch.uint8, numel=lambda: torch.get_rng_state().numel()),
        "numpy": items(kind(str), tensor(torch.int64, numel=lambda: 624), integer(), integer(), kind(float)),
    },
    {"cuda": items(each=tensor(torch.uint8))},
)

RANK_FILE = table(
    {
        "train": table({"step": integer(), "consumed_samples": integer(), "skipped_updates": integer()}),
        "scheduler": table({}, {"samples": integer()}, strict=False),  # a plugin's schedule: its own state
        "rng": optional(RNG),
    },
    {
        "grad_scaler": table(
            {"scale": number(0, strictly=True), "growth_factor": number(1, strictly=True)},
            {"backoff_factor": number(0, strictly=True), "growth_interval": integer(1), "_growth_tracker": integer()},
            strict=False,
        ),
        "plugins": mapping(anything),
        "interval_log": optional(SERIES, empty={}),
        "interval_log_mean": optional(SERIES, empty={}),
        "data": optional(mapping(anything)),
    },
)

MANIFEST = table(
    {"layout": one_of("replicated", "sharded")},
    {
        "format": integer(1),
        "coretrain": kind(str),
        "step": integer(),
        "frozen_saved": kind(bool),
        "world_size": integer(1),
        "optimizer": kind(str),
        "seq_length": optional(integer(1)),
        "evaluated": items(each=kind(str)),
        "config": mapping(anything),
    },
    strict=False,  # a newer coretrain may record more about a checkpoint; nothing reads it here
)

MODEL_FILE = mapping(tensor())

OPTIMIZER_FILE = table(
    {
        "state": mapping(mapping(anything), keys=integer()),
        "param_groups": items(each=table({"params": items(each=integer())}, strict=False)),
    }
)


def check_optimizer_fits(saved: dict[str, Any], optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The parameter groups match (else the user changed them: an error that says what to do), and
    each saved moment has its parameter's shape or is a factor of it (torch's load_state_dict
    checks only counts)."""
    counts = [len(group["params"]) for group in saved["param_groups"]]
    if counts != [len(group["params"]) for group in optimizer.param_groups]:
        raise UserError(
            f"{path}: the optimizer state does not fit this optimizer (parameters per group {counts}, now "
            f"{[len(group['params']) for group in optimizer.param_groups]}); if its parameter groups changed, "
            "set checkpoint.load_optimizer = false"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, moments in saved["state"].items():
        if index >= len(params):
            raise CheckpointUnreadable(path, f"not a valid checkpoint file: state[{index}]: no such parameter")
        for name, value in moments.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and not _factor_of(value.shape, params[index].shape):
                raise CheckpointUnreadable(
                    path,
                    f"not a valid checkpoint file: state[{index}].{name} has shape {list(value.shape)}, "
                    f"its parameter {list(params[index].shape)}",
                )


def _factor_of(shape: torch.Size, parameter: torch.Size) -> bool:
    """The parameter's shape, or 1 where a factored moment sums it (Adafactor's row and column variances)."""
    return len(shape) == len(parameter) and all(size in (1, full) for size, full in zip(shape, parameter, strict=True))


MOST_SAMPLES_PER_STEP = 2**32
"""No global batch is larger: consumed samples beyond step × this are not a run's."""


def check_counters(rank_state: dict[str, Any], path: Path) -> None:
    """The train counters agree with each other: the schedule moved by the samples of every
    update, and a skipped update (which does not move it) is counted; no step is larger than
    any batch could be. One tampered or damaged counter (consumed_samples = 10**15) breaks this."""
    train = rank_state["train"]
    scheduled = rank_state["scheduler"].get("samples", train["consumed_samples"])
    consumed, step, skipped = train["consumed_samples"], train["step"], train["skipped_updates"]
    problem = None
    if consumed > step * MOST_SAMPLES_PER_STEP:
        problem = f"train.consumed_samples is {consumed} after {step} step(s)"
    elif scheduled > consumed or (scheduled != consumed and not skipped):
        problem = f"train.consumed_samples is {consumed}, but the schedule moved by {scheduled} samples"
    elif skipped > step:
        problem = f"train.skipped_updates is {skipped} after {step} step(s)"
    if problem:
        raise CheckpointUnreadable(path, f"not a valid checkpoint file: {problem}")


def check_plugin_states(states: Mapping[str, Any], declared: Callable[[str], Any], path: Path) -> None:
    """Each plugin's saved state against the attrs class it declares as ``coretrain_state``
    (structured as strictly as its config: types, unknown or missing keys, its validators); a
    state that does not fit is a damaged file, named with the key path."""
    from coretrain.configload import structure

    for name, state in states.items():
        cls = declared(name)
        if cls is None or not state:
            continue
        try:
            structure(state, cls, prefix=("plugins", name))
        except UserError as exc:
            detail = str(exc).removeprefix("invalid config:").strip().replace("\n  ", "; ")
            raise CheckpointUnreadable(path, f"not a valid checkpoint file: {detail}") from None
