"""A crafted ``sharded/.metadata`` changes nothing in the process and is one error naming it.

Real DCP metadata (written by ``torch.distributed.checkpoint.save``) is the seed; crafted
payloads and thousands of mutations of it go through the reader a resume and an export use.
Whatever comes out is a good ``Metadata`` or a ``CheckpointUnreadable`` naming the file, and
no class the reader may name has been changed.
"""

from __future__ import annotations

import copy
import enum
import io
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from test_trust import finished, make_sharded, one_error_line, step_dir

from coretrain.checkpoint import dcpmetadata, safeload
from coretrain.errors import CheckpointUnreadable


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The ``.metadata`` DCP writes for a small model and its AdamW state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    weights, moments = get_state_dict(model, optimizer)
    directory = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": weights, "optimizer": moments}, checkpoint_id=str(directory), no_dist=True)
    return (directory / ".metadata").read_bytes()


def allowed_classes() -> list[type]:
    """The classes a metadata pickle may name (the reader's allowlist, as objects)."""
    import importlib

    named = [getattr(importlib.import_module(m), n) for m, names in dcpmetadata._ALLOWED.items() for n in sorted(names)]
    return [value for value in named if isinstance(value, type)]


def snapshot() -> dict[str, Any]:
    """Every attribute of every class the reader may name, and of the enum members it may make."""
    state: dict[str, Any] = {}
    for cls in allowed_classes():
        for klass in cls.__mro__[:-1]:  # `object` itself cannot be changed from Python
            state[f"{klass.__module__}.{klass.__qualname__}"] = dict(vars(klass))
        if issubclass(cls, enum.Enum):
            for member in cls:
                state[f"{cls.__qualname__}.{member.name}"] = dict(vars(member))
    return state


def read(data: bytes) -> Any:
    """The reader every resume and export uses: a Metadata, or CheckpointUnreadable naming the file."""
    return safeload.load_metadata(io.BytesIO(data), Path("ckpt/sharded/.metadata"))


def refused(data: bytes) -> CheckpointUnreadable:
    with pytest.raises(CheckpointUnreadable) as caught:
        read(data)
    assert caught.value.unsafe, caught.value.reason
    assert str(caught.value.path) == "ckpt/sharded/.metadata"
    return caught.value


def relocated(real: bytes, path: str) -> bytes:
    metadata = pickle.loads(real)
    for info in metadata.storage_data.values():
        info.relative_path = path
    return pickle.dumps(metadata)


def test_real_metadata_loads_equal_to_what_pickle_reads(real_metadata: bytes) -> None:
    assert read(real_metadata) == pickle.loads(real_metadata)


__all__ = ["finished"]  # the module-scoped run test_trust makes, shared here

CRAFTED = {
    # BUILD with slot state on an allowed class: setattr(PosixPath, "__str__", PurePosixPath)
    "setattr-on-a-class": b"\x80\x04cpathlib\nPosixPath\n(N}(X\x07\x00\x00\x00__str__cpathlib\nPurePosixPath\nutb.",
    # BUILD on a shared enum member (its value would change for every user of the enum)
    "build-on-an-enum-member": b"\x80\x04ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
    b"(K\x00tR}X\x07\x00\x00\x00_value_K\x07sb.",
    # SETITEMS / APPENDS on something that is not a dict / list made by this load
    "setitems-on-a-class": b"\x80\x04ccollections\nOrderedDict\n(X\x01\x00\x00\x00aK\x01u.",
    "appends-on-a-size": b"\x80\x04ctorch\nSize\n)R(K\x01e.",
    "a-set": b"\x80\x04\x8f(K\x01\x90.",
    "not-metadata": pickle.dumps({"state_dict_metadata": {}}),
    "a-global-outside-the-list": b"\x80\x04cos\nsystem\nX\x04\x00\x00\x00trueR.",
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_metadata_is_refused_as_crafted_and_changes_nothing(case: str) -> None:
    before = snapshot()
    refused(CRAFTED[case])
    assert snapshot() == before


@pytest.mark.parametrize("path", ["../other_step/sharded/__0_0.distcp", "/etc/passwd", "a/../../x", ""])
def test_a_storage_entry_outside_the_checkpoint_is_refused(real_metadata: bytes, path: str) -> None:
    assert "outside the checkpoint" in refused(relocated(real_metadata, path)).reason


def test_plain_pickle_would_have_changed_the_class(real_metadata: bytes) -> None:
    """The payload above is real: plain pickle (what DCP calls) runs the setattr."""
    import pathlib

    saved = pathlib.PosixPath.__dict__.get("__str__")
    try:
        pickle.loads(CRAFTED["setattr-on-a-class"])
        assert pathlib.PosixPath.__dict__.get("__str__") is pathlib.PurePosixPath
    finally:
        if saved is None:
            del pathlib.PosixPath.__str__
        else:
            pathlib.PosixPath.__str__ = saved


OPCODES = [bytes([op.code.encode("latin-1")[0]]) for op in __import__("pickletools").opcodes]


def mutate(seed_bytes: bytes, rng: random.Random) -> bytes:
    data = bytearray(seed_bytes)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(5)
        at = rng.randrange(len(data))
        if kind == 0:
            data[at] = rng.randrange(256)
        elif kind == 1:
            data[at:at] = rng.choice(OPCODES)
        elif kind == 2:
            del data[at : at + rng.randint(1, 8)]
        elif kind == 3:
            payload = rng.choice(list(CRAFTED.values()))
            data[at:at] = payload[2:-1]  # a crafted body spliced into a real pickle
        else:
            data = data[:at]
        if not data:
            break
    return bytes(data)


def fuzz(seeds: list[bytes], cases: int) -> dict[str, int]:
    rng = random.Random(0)
    before = snapshot()
    outcomes = {"loaded": 0, "refused": 0, "corrupt": 0}
    for i in range(cases):
        data = mutate(seeds[i % len(seeds)], rng)
        try:
            result = read(data)
        except CheckpointUnreadable as exc:
            outcomes["refused" if exc.unsafe else "corrupt"] += 1
        else:
            assert type(result).__name__ == "Metadata"
            outcomes["loaded"] += 1
        assert snapshot() == before, f"case {i} changed a class: {data!r}"
    return outcomes


def seeds(real: bytes) -> list[bytes]:
    metadata = pickle.loads(real)
    older = copy.deepcopy(metadata)
    older.storage_data = None
    return [real, pickle.dumps(metadata, protocol=2), pickle.dumps(older, protocol=5)]


def test_mutated_metadata_loads_or_is_refused_and_changes_nothing_quick(real_metadata: bytes) -> None:
    outcomes = fuzz(seeds(real_metadata), 300)
    assert outcomes["refused"] > 0 and outcomes["corrupt"] > 0


@pytest.mark.slow
def test_mutated_metadata_loads_or_is_refused_and_changes_nothing(real_metadata: bytes) -> None:
    outcomes = fuzz(seeds(real_metadata), 5000)
    assert sum(outcomes.values()) == 5000 and min(outcomes.values()) > 0, outcomes


# --------------------------------------------------------------------------- through the CLI


@pytest.mark.slow
@pytest.mark.parametrize("crafted", ["setattr-on-a-class", "escape"])
@pytest.mark.parametrize("command", ["resume", "export"])
def test_a_crafted_sharded_checkpoint_is_one_error_with_exit_2(
    tmp_path: Path, crafted: str, command: str, finished: Path
) -> None:
    work = tmp_path / "w"
    shutil.copytree(finished, work)
    step = step_dir(work / "out", 4)
    make_sharded(step, None)
    metadata = step / "sharded" / ".metadata"
    if crafted == "escape":
        metadata.write_bytes(relocated(metadata.read_bytes(), "../../../secret.distcp"))
    else:
        metadata.write_bytes(CRAFTED[crafted])
    config = work / "c.toml"
    config.write_text(config.read_text().replace(str(finished), str(work)))
    if command == "resume":
        result = run_cli("run", str(config), "--set", "train.train_iters=6", cwd=work)
    else:
        result = run_cli("checkpoint", "export", str(work / "out"), "--to", str(tmp_path / "m.st"), cwd=work)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert str(metadata) in line and "crafted" in line, line
    assert not (tmp_path / "m.st").exists()
