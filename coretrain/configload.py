"""Read a TOML config: ``extends`` composition, ``--set`` overrides, strict structuring.

Order of application: the ``extends`` chain (deep merge, base first, paths relative to the
file that names them), then the file itself, then each ``--set key.path=value`` in order. A
layer that changes ``model.provider`` or ``data.provider`` drops the old provider's ``options``.
Every mistake becomes one :class:`~coretrain.errors.UserError` that names the file and line
(or the ``--set`` flag) and the key path, says what was expected and suggests a fix.
"""

from __future__ import annotations

import copy
import math
import re
import stat
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs
import tomli
import tomli_w
from cattrs.cols import list_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_unstructure_fn, override

from coretrain.config import Config
from coretrain.errors import UserError, did_you_mean
from coretrain.movedkeys import drop_lone_secondaries, move_keys
from coretrain.validators import FieldValueError

T = TypeVar("T")

Location = str  # "path/to/file.toml:12" or "--set optimizer.lr=3e-4"


@attrs.define
class LoadedConfig:
    """The structured config plus what is needed to explain it."""

    config: Config
    locations: dict[tuple[str, ...], Location]
    path: Path


# --------------------------------------------------------------------------- strict converter


def _strict(kind: type, accept: tuple[type, ...], then: Any = None) -> Any:
    """A hook that takes only ``accept``'s types and makes a ``kind`` of the value (or passes it to
    ``then``, the default hook of a list type, whose items' errors name their index)."""

    def hook(value: Any, _: type) -> Any:
        """The value as a ``kind``, or a TypeError naming what it was (:func:`_problems` words it)."""
        if isinstance(value, bool) and kind is not bool:
            raise TypeError("bool")
        if not isinstance(value, accept):
            raise TypeError(type(value).__name__)
        if kind is float and isinstance(value, (int, float)) and not math.isfinite(value):
            # nan / inf is never a setting
            raise TypeError("not finite")
        if kind is str and "\x00" in str(value):  # no name or path holds one; the OS refuses it later, worse
            raise TypeError("NUL")
        return kind(value) if then is None else then(value, _)

    return hook


SECRET = "secret"
"""A plugin's config field whose attrs metadata says ``{"secret": True}`` is a credential (an
API key): the plugin holds it, and nothing that records the config — config.toml, a checkpoint's
manifest, ``config show``, a tracker's parameters — ever sees it (:func:`withhold_secrets`)."""


def secret_fields(cls: Any) -> list[str]:
    """The names of ``cls``'s fields marked :data:`SECRET` (none for a class that is not attrs)."""
    return [f.name for f in attrs.fields(cls) if f.metadata.get(SECRET)] if attrs.has(cls) else []


def make_converter() -> cattrs.Converter:
    """A cattrs converter that refuses unknown keys and never coerces "3" into 3, 1 into "1" or
    "ab" into ["a", "b"]; a plugin's secret fields are left out when it is turned back into plain data."""
    converter = cattrs.Converter(forbid_extra_keys=True)
    for kind, accepted in ((int, (int,)), (float, (int, float)), (bool, (bool,)), (str, (str,))):
        converter.register_structure_hook(kind, _strict(kind, accepted))

    def is_list_or_tuple(cls: Any) -> bool:
        return list in (cls, typing.get_origin(cls)) or typing.get_origin(cls) is tuple

    def strict_sequence(cls: Any) -> Any:
        """cattrs' own hook for this list or tuple type (an item's error names its index), behind the
        refusal of anything but a list: a string would be the list of its characters."""
        then = converter._structure_tuple if typing.get_origin(cls) is tuple else list_structure_factory(cls, converter)
        return _strict(list, (list, tuple), then=then)

    converter.register_structure_hook_factory(is_list_or_tuple, strict_sequence)

    def without_secrets(cls: Any) -> Any:
        omitted: dict[str, Any] = {name: override(omit=True) for name in secret_fields(cls)}
        return make_dict_unstructure_fn(cls, converter, **omitted)

    converter.register_unstructure_hook_factory(lambda cls: bool(secret_fields(cls)), without_secrets)
    return converter


def withhold_secrets(config: Any, key_path: tuple[str, ...], cls: Any) -> None:
    """Take the secret fields of ``cls`` out of ``config``'s table at ``key_path`` (its plugin,
    structured from it, holds them): whatever records the config from now on cannot write them."""
    table = config.plugins.get(key_path[1]) if key_path[0] == "plugins" else getattr(config, key_path[0]).options
    for name in secret_fields(cls):
        if isinstance(table, dict):
            table.pop(name, None)


CONVERTER = make_converter()
PEER_NAMES = Path(__file__).with_name("peer_names.toml")
"""Other trainers' names for the core's keys: a config that uses one is told the key it is here."""


def structure(
    data: Mapping[str, Any],
    cls: type[T],
    *,
    prefix: tuple[str, ...] = (),
    locations: Mapping[tuple[str, ...], Location] | None = None,
    source: str = "",
) -> T:
    """Structure ``data`` into ``cls`` or raise a UserError listing every problem with its key path."""
    try:
        return CONVERTER.structure(dict(data), cls)
    except Exception as exc:  # cattrs groups every field's error; we render them all
        problems = [(prefix + path, message) for path, message in _problems(exc, (), cls, data)]
        if not problems:
            raise
        wheres = [(locations or {}).get(path) or _nearest(locations or {}, path) or source for path, _ in problems]
        lines = [f"{w + ': ' if w else ''}{'.'.join(p) or '(top level)'}: {m}" for w, (p, m) in zip(wheres, problems)]
        raise UserError("invalid config:\n  " + "\n  ".join(lines)) from None


# Each (key path, message) in a cattrs error. cattrs nests one group per class and list and says
# in notes which field or index each error is under, so the walk carries the path and the type
# expected there down to the leaves: an unknown key, a field's own check, a class's check, or a
# value of the wrong type, each in its own words (``data``: the raw config, the value as written).
# (A comment, not a docstring: the function is at the 40 lines a core function may have.)
def _problems(
    exc: BaseException, path: tuple[str, ...], cls: Any, data: Any
) -> typing.Iterator[tuple[tuple[str, ...], str]]:
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl) if f.init]  # what a config sets, not a plugin's own state
        core_table = exc.cl.__module__ == Config.__module__
        elsewhere = _core_keys_by_other_names() if core_table else {}
        for key in sorted(exc.extra_fields):
            if key in elsewhere:  # a spelling match would guess wrong (eval_steps is not eval_iters)
                hint = f" (here it is {elsewhere[key]})"
            else:
                hint = did_you_mean(key, known) or f" (known keys: {', '.join(known)})"
            yield path + (key,), f"unknown key{hint}"
    elif isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            sub_path, sub_type = path, cls
            for note in getattr(sub, "__notes__", []):
                if isinstance(note, AttributeValidationNote):
                    sub_path, sub_type = path + (note.name,), note.type
                elif isinstance(note, IterableValidationNote):
                    sub_path, sub_type = path + (str(note.index),), note.type
            yield from _problems(sub, sub_path, sub_type, data)
    elif isinstance(exc, FieldValueError):
        yield path + (exc.name,), str(exc)
    elif isinstance(exc, (ValueError, TypeError)) and attrs.has(cls) and isinstance(_lookup(data, path), Mapping):
        yield _validator_problem(exc, path, cls)
    elif isinstance(value := _lookup(data, path), str) and "\x00" in value:
        yield path, f"contains a NUL byte ({value!r}); no name or path may hold one"
    else:
        expected = describe_type(cls)
        message = f"expected {expected}, got {describe_value(value)}"
        choices = [
            str(a)
            for arm in (typing.get_args(cls) if typing.get_origin(cls) in (typing.Union, types.UnionType) else (cls,))
            if typing.get_origin(arm) is typing.Literal
            for a in typing.get_args(arm)
        ]  # Literal[...] or Literal[...] | None
        if choices and isinstance(value, str):
            message += did_you_mean(value, choices)
        yield path, message


def _core_keys_by_other_names() -> dict[str, str]:
    """A name a core key goes by where it is unknown -> that key's path: its own name, when one
    table alone has it (``train.seed`` is ``run.seed``), or another trainer's name for it
    (``peer_names.toml``, which wins)."""
    tables_of: dict[str, list[str]] = {}
    for table, kind in typing.get_type_hints(Config).items():
        if attrs.has(kind):
            for name in attrs.fields_dict(kind):
                tables_of.setdefault(name, []).append(table)
    own = {name: f"{tables[0]}.{name}" for name, tables in tables_of.items() if len(tables) == 1}
    return {**own, **tomli.loads(PEER_NAMES.read_text())}


def _validator_problem(exc: BaseException, path: tuple[str, ...], cls: Any) -> tuple[tuple[str, ...], str]:
    """A class's own check failed while it was built (an attrs validator such as ``gt(0)`` or
    ``in_``, or ``__attrs_post_init__``): name the field when the error does, else the table."""
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    names = {f.name for f in attrs.fields(cls)}
    attribute = next((a for a in exc.args[1:] if isinstance(a, attrs.Attribute)), None)
    quoted = re.match(r"^'(\w+)' (.*)$", message, re.S)
    name: str | None = attribute.name if attribute is not None else quoted.group(1) if quoted else None
    if name is not None and name in names:
        detail = quoted.group(2) if quoted and quoted.group(1) == name else message
        return (*path, name), detail.rstrip(".")  # attrs' messages carry the value
    return path, message


_MISSING = object()


def _lookup(data: Any, path: tuple[str, ...]) -> Any:
    """The raw value at a key path (list items by index), or ``_MISSING``: what a message quotes
    as "got ...", from the data as written, not as cattrs half-converted it."""
    for key in path:
        if isinstance(data, Mapping) and key in data:
            data = data[key]
        elif isinstance(data, list) and key.isdigit() and int(key) < len(data):
            data = data[int(key)]
        else:
            return _MISSING
    return data


def describe_type(tp: Any) -> str:
    """Human words for a type annotation: 'an integer', 'one of "a", "b"', 'a table'..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args if a is not type(None))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of {len(args)} values" if args and args[-1] is not Ellipsis else "a list"
    if origin in (list, set, frozenset) or tp in (list, set):
        return "a list" + (f" of {describe_type(args[0]).split(' ', 1)[-1]}s" if args and args[0] is not Any else "")
    if origin in (dict, Mapping) or tp is dict or attrs.has(tp):
        return "a table"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def describe_value(value: Any) -> str:
    """A value as an error quotes it, with its TOML kind (``'3' (string)``, ``true (boolean)``),
    cut to 40 characters so a pasted blob does not flood the message."""
    if value is _MISSING:
        return "nothing"
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "table"}.get(
        type(value), type(value).__name__
    )
    text = str(value).lower() if isinstance(value, bool) else repr(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


# --------------------------------------------------------------------------- reading and merging


MAX_CONFIG_BYTES = 1 << 20
"""A config is a page of TOML; anything far larger is not one (a device, a data file)."""
MAX_EXTENDS_DEPTH = 32


def read_toml(path: Path) -> dict[str, Any]:
    """Parse one TOML file; syntax errors become 'file:line:col: message'."""
    try:
        info = path.stat()
        if stat.S_ISREG(info.st_mode) and info.st_size > MAX_CONFIG_BYTES:
            raise UserError(f"{path}: {info.st_size:,} bytes is not a config file (at most {MAX_CONFIG_BYTES:,})")
        if not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode):
            raise UserError(f"{path}: not a regular file (a device, FIFO or socket); name a TOML file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a config file") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{path}:{line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); "
            "TOML files are UTF-8: re-save it as UTF-8"
        ) from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read config file: {exc.strerror}") from None
    try:
        return tomli.loads(text)
    except tomli.TOMLDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}:{exc.colno}: invalid TOML: {exc.msg}") from None
    except RecursionError:
        raise UserError(f"{path}: values nested too deeply to be a config") from None


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; any other value in ``top`` replaces the one in ``base``."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


PROVIDER_TABLES = ("model", "data")
"""Tables whose ``options`` belong to their ``provider``."""


def merge_layer(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`deep_merge`, except that a layer that changes ``model.provider`` or
    ``data.provider`` drops the base's ``options`` of the old provider (as Hydra's config
    groups replace, not merge): a gpt base's ``n_embd`` is no option of ``hf``."""
    base = dict(base)
    for table in PROVIDER_TABLES:
        old, new = base.get(table), top.get(table)
        if (
            isinstance(old, Mapping)
            and isinstance(new, Mapping)
            and new.get("provider", old.get("provider")) != old.get("provider")
        ):
            base[table] = {key: value for key, value in old.items() if key != "options"}
    return deep_merge(base, top)


def _load_chain(
    path: Path,
    seen: tuple[Path, ...],
    locations: dict[tuple[str, ...], Location],
    composed: dict[Path, dict[str, Any]] | None = None,
    secondaries: set[tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    """``path`` with its ``extends`` bases merged under it; ``composed`` keeps each file's result,
    so a base several files extend (a diamond) is read once, not once per path to it."""
    composed = {} if composed is None else composed
    path = path.resolve() if path.is_absolute() else path
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in (*seen, path.resolve()))
        raise UserError(f"{path}: 'extends' forms a cycle: {chain}")
    if len(seen) >= MAX_EXTENDS_DEPTH:
        raise UserError(
            f"{path}: 'extends' goes {len(seen)} files deep (at most {MAX_EXTENDS_DEPTH}); flatten the chain"
        )
    if path.resolve() in composed:
        return composed[path.resolve()]
    data = read_toml(path)
    own = _key_lines(path)
    move_keys(data, own, secondaries)  # this file's old keys as new ones: its values win over its bases' however spelt

    def load_base(base: Path) -> dict[str, Any]:
        return _load_chain(base, (*seen, path.resolve()), locations, composed, secondaries)

    merged = _bases(data.pop("extends", []), path.parent, f"{path}: ", load_base)
    locations.update(own)
    composed[path.resolve()] = merge_layer(merged, data)
    return composed[path.resolve()]


def _bases(extends: Any, folder: Path, where: str, load: typing.Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """The configs ``extends`` names (a file, or a list of files, relative to ``folder``), merged in order."""
    bases = [extends] if isinstance(extends, (str, Path)) else extends
    if not isinstance(bases, list) or not all(isinstance(base, (str, Path)) for base in bases):
        raise UserError(f"{where}extends: expected a file name or a list of file names, got {describe_value(extends)}")
    merged: dict[str, Any] = {}
    for base in bases:
        if not (folder / base).exists():
            raise UserError(f"{where}extends: {str(base)!r} not found (looked for {(folder / base).absolute()})")
        merged = merge_layer(merged, load(folder / base))
    return merged


_TABLE = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-.\"' ]+?)\s*=")


def _key_lines(path: Path) -> dict[tuple[str, ...], Location]:
    """Best-effort map of key path -> 'file:line', so errors can point at a line."""
    found: dict[tuple[str, ...], Location] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if match := _TABLE.match(line):
            table = _split_key(match.group(1))
            found.setdefault(table, f"{path}:{number}")
        elif match := _KEY.match(line):
            found[table + _split_key(match.group(1))] = f"{path}:{number}"
    return found


def _split_key(key: str) -> tuple[str, ...]:
    """``a.b.c`` (or TOML's quoted ``"a".b``) as its parts."""
    return tuple(part.strip().strip("\"'") for part in key.split("."))


def _nearest(locations: Mapping[tuple[str, ...], Location], path: tuple[str, ...]) -> Location | None:
    """The line of the closest enclosing table that has one: a missing key has no line of its own."""
    for end in range(len(path) - 1, 0, -1):
        if path[:end] in locations:
            return locations[path[:end]]
    return None


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``optimizer.lr=3e-4`` -> (("train", "lr"), 0.0003); the value is TOML, bare words are strings."""
    key, sep, value = text.partition("=")
    path = _split_key(key)
    if not sep or not all(path):
        raise UserError(f"--set {text}: expected KEY.PATH=VALUE, e.g. --set optimizer.lr=3e-4")
    try:
        return path, tomli.loads(f"v = {value}")["v"]
    except tomli.TOMLDecodeError:
        return path, value


def apply_override(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set ``value`` at ``path`` in ``data``, making the tables on the way; a non-table in the way
    is an error (``--set optimizer.lr.x=1`` over a number), not silently replaced."""
    node = data
    for i, key in enumerate(path[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise UserError(
                f"--set {'.'.join(path)}: {'.'.join(path[: i + 1])} is {describe_value(child)}, not a table"
            )
        node = child
    node[path[-1]] = value


Overrides = typing.Sequence[str] | Mapping[str, Any]
"""``--set`` texts (``"optimizer.lr=3e-4"``, TOML values) or, from Python, ``{"optimizer.lr": 3e-4}``."""


def load_config(path: str | Path, overrides: Overrides = ()) -> LoadedConfig:
    """Read, compose and structure a config file. Raises UserError on any mistake."""
    path = Path(path)
    locations: dict[tuple[str, ...], Location] = {}
    secondaries: set[tuple[str, ...]] = set()
    raw = _load_chain(path, (), locations, secondaries=secondaries)
    return _with_overrides(raw, overrides, locations, path, str(path), secondaries)


def load_config_data(data: Mapping[str, Any], overrides: Overrides = ()) -> LoadedConfig:
    """A config given as TOML-shaped data (the Python API): ``extends`` names files relative to
    the current directory; the rest is merged over them as a file's own keys are."""
    locations: dict[tuple[str, ...], Location] = {}
    secondaries: set[tuple[str, ...]] = set()
    layer = copy.deepcopy(dict(data))
    move_keys(layer, {}, secondaries)

    def load_base(base: Path) -> dict[str, Any]:
        return _load_chain(base, (), locations, secondaries=secondaries)

    raw = _bases(layer.pop("extends", []), Path(), "", load_base)  # files relative to the current directory
    locations = {key: where for key, where in locations.items() if _lookup(layer, key) is _MISSING}  # the dict's own
    merged = merge_layer(raw, layer)
    return _with_overrides(merged, overrides, locations, Path("config.toml"), "the config", secondaries)


def _with_overrides(
    raw: dict[str, Any],
    overrides: Overrides,
    locations: dict[tuple[str, ...], Location],
    path: Path,
    source: str,
    secondaries: set[tuple[str, ...]],
) -> LoadedConfig:
    """Apply the overrides (a provider switch drops the old provider's options; an old key is
    applied at its new place, after the files), then structure."""
    if isinstance(overrides, Mapping):
        changes = [(_split_key(key), value, f"overrides[{key!r}]") for key, value in overrides.items()]
    else:
        changes = [(*parse_override(text), f"--set {text}") for text in overrides]
    for key_path, value, where in changes:
        if len(key_path) == 2 and key_path[1] == "provider" and key_path[0] in PROVIDER_TABLES:
            raw = merge_layer(raw, {key_path[0]: {"provider": value}})
        layer: dict[str, Any] = {}
        apply_override(layer, key_path, value)
        own = {key_path: where}
        move_keys(layer, own, secondaries)
        if own == {key_path: where}:  # not a moved key: set as given (a table replaces the old one)
            apply_override(raw, key_path, value)
        else:
            raw = deep_merge(raw, layer)
        locations.update(own)
    drop_lone_secondaries(raw, secondaries)
    config = structure(raw, Config, locations=locations, source=source)
    return LoadedConfig(config=config, locations=locations, path=path)


def config_as_dict(config: Any) -> Any:
    """The config (or a plugin's table) as plain data (what config.toml and a checkpoint's manifest record)."""
    return CONVERTER.unstructure(config)


def toml_text(data: Mapping[str, Any]) -> str:
    """``data`` as TOML (tomli-w), ``None`` (unset) left out: what config.toml is written as."""
    return tomli_w.dumps(_without_none(data))


def _without_none(data: Any) -> Any:
    """TOML has no null: an unset value is an absent key (reading it back gives the default, None)."""
    if isinstance(data, Mapping):
        return {key: _without_none(value) for key, value in data.items() if value is not None}
    return [_without_none(item) for item in data if item is not None] if isinstance(data, list) else data
