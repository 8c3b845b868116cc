"""The hook contract is written once (coretrain.hookspecs.HookSpecs); every first-party
implementation is held to it: its arguments are the spec's and annotated as the spec's are,
and it returns what the spec returns (None where the spec's answer is optional)."""

from __future__ import annotations

import inspect
import re
from importlib import metadata

import pytest

from coretrain.hookspecs import HookSpecs
from coretrain.markers import PROJECT
from coretrain.pluginmanager import AUTOLOAD_GROUP, GROUP, HOOKSPECS_GROUP

FIRST_PARTY = "coretrain-plugins"


def spelled(annotation: object) -> str:
    """An annotation as written, each dotted name cut to its last part (``torch.nn.Module`` and
    ``nn.Module`` are one type), spaces dropped."""
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", text).replace(" ", "")


def implementations() -> list[tuple[str, str, object]]:
    found = {}
    for group in (GROUP, AUTOLOAD_GROUP):
        for point in metadata.entry_points(group=group):
            if point.dist is not None and point.dist.name == FIRST_PARTY:
                found[point.name] = point.load()
    return [
        (name, hook, member)
        for name, cls in sorted(found.items())
        for hook, member in inspect.getmembers(cls)
        if getattr(member, f"{PROJECT}_impl", None) is not None
    ]


def specification(hook: str) -> object:
    """The spec of ``hook``: the core's, or a plugin distribution's (``coretrain.hookspecs``)."""
    owners = [HookSpecs, *(point.load() for point in metadata.entry_points(group=HOOKSPECS_GROUP))]
    return next(getattr(owner, hook) for owner in owners if hasattr(owner, hook))


def test_the_first_party_plugins_implement_hooks() -> None:
    hooks = {hook for _, hook, _ in implementations()}
    plugin_specs = {name for p in metadata.entry_points(group=HOOKSPECS_GROUP) for name in dir(p.load())}
    assert len(hooks) >= 15 and hooks <= set(dir(HookSpecs)) | plugin_specs


@pytest.mark.parametrize(
    ("plugin", "hook", "function"), implementations(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_each_implementation_is_typed_as_its_spec(plugin: str, hook: str, function: object) -> None:
    spec = inspect.signature(specification(hook))  # type: ignore[arg-type]
    impl = inspect.signature(function)  # type: ignore[arg-type]
    wrapper = getattr(function, f"{PROJECT}_impl", {}).get("wrapper", False)
    for name, parameter in impl.parameters.items():
        if name == "self":
            continue
        assert name in spec.parameters, f"{plugin}.{hook}: argument '{name}' is not in the spec"
        if parameter.annotation is not inspect.Parameter.empty and spelled(parameter.annotation) != "Any":
            want = spelled(spec.parameters[name].annotation)
            assert spelled(parameter.annotation) == want, f"{plugin}.{hook}({name}): spec says {want}"
    returned, promised = spelled(impl.return_annotation), spelled(spec.return_annotation)
    if not wrapper and impl.return_annotation is not inspect.Signature.empty and returned != "Any":
        allowed = {promised, promised.removesuffix("|None"), "None"} if promised.endswith("|None") else {promised}
        assert returned in allowed, f"{plugin}.{hook} returns {returned}; the spec: {promised}"
