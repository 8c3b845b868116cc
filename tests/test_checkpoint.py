"""Checkpoint pieces: RNG state survives a weights_only round trip; incomplete saves are ignored."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import REPO
from helpers_inprocess import config, make_model, train

import coretrain
from coretrain import hookimpl
from coretrain.checkpoint.layout import complete_steps
from coretrain.checkpoint.pretrained import EXCLUDE_HINT
from coretrain.checkpoint.state import rng_state, set_rng_state
from coretrain.errors import UserError
from coretrain.testing import run_steps, tiny_config, write_config


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_round_trips_through_weights_only_load(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = draws()
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == expected


def test_resume_ignores_an_uncommitted_save_and_falls_back_past_a_corrupt_one(
    tmp_path: Any, no_autoload: None, caplog: pytest.LogCaptureFixture
) -> None:
    run, _ = train(config(tmp_path, train={"exit_interval": 4}))
    root = tmp_path / "out" / "checkpoints"
    (root / "step_00000008.tmp").mkdir()  # a save that never committed
    assert complete_steps(root) == [4]
    resumed, _ = train(config(tmp_path, train={"train_iters": 6}))
    assert resumed.state.step == 6  # resumed from 4, not from the .tmp
    (root / "step_00000006" / "model.pt").write_bytes(b"truncated")
    fallback, _ = train(config(tmp_path, train={"train_iters": 8}), ("first", FirstWeights()))
    assert fallback.state.step == 8 and "falling back" in caplog.text and "step_00000006" in caplog.text
    assert (root / "step_00000006" / "model.pt").read_bytes() == b"truncated"  # the fallback deletes nothing
    (root / "step_00000004" / "rank_00000.pt").write_bytes(b"")
    (root / "step_00000008" / "optimizer.pt").unlink()
    with pytest.raises(UserError, match=r"step_00000004/rank_00000.pt: cannot load checkpoint file: EOFError"):
        train(config(tmp_path, train={"train_iters": 9}))  # nothing loadable left: the oldest's error


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path: Any, no_autoload: None) -> None:
    train(config(tmp_path, train={"train_iters": 10}, checkpoint={"save_interval": 2, "keep_last": 2}))
    assert complete_steps(tmp_path / "out" / "checkpoints") == [8, 10]


def whole_tensors(weights: dict[str, Any]) -> dict[str, Any]:
    """Copies of the weights, a sharded one gathered whole (while the run's process group lives:
    torch 2.9 cannot gather after it is gone)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in weights.items()}


class FirstWeights:
    @hookimpl
    def on_train_start(self, run: Any) -> None:
        self.weights = whole_tensors(run.model.state_dict())
        self.step = run.state.step


class LastWeights:
    @hookimpl
    def on_train_end(self, run: Any) -> None:
        self.weights = whole_tensors(run.model.state_dict())


def test_pretrained_loads_weights_only_and_starts_at_step_zero(tmp_path: Any, no_autoload: None) -> None:
    source, _ = train(config(tmp_path / "a", train={"train_iters": 6}))
    seen = FirstWeights()
    target, _ = train(
        config(
            tmp_path / "b",
            train={"train_iters": 3},
            checkpoint={"pretrained": str(tmp_path / "a" / "out" / "checkpoints" / "step_00000006")},
        ),
        ("seen", seen),
    )
    assert seen.step == 0 and target.state.step == 3
    assert all(torch.equal(seen.weights[k], v) for k, v in source.model.state_dict().items())
    assert target.scheduler.position == 3  # a fresh optimizer and schedule


@pytest.mark.parametrize(
    "wrapped",
    [
        lambda sd: {"model": {f"_orig_mod.{k}": v for k, v in sd.items()}, "iter_num": 6, "config": {"lr": 0.1}},
        lambda sd: {"state_dict": sd, "epoch": 1, "global_step": 6},
        lambda sd: {f"module.{k}": v for k, v in sd.items()},  # torch.save(ddp_model.state_dict())
    ],
    ids=["nanogpt-compiled", "state_dict", "ddp"],
)
def test_pretrained_takes_the_weights_of_a_training_scripts_own_file(
    tmp_path: Any, no_autoload: None, wrapped: Any
) -> None:
    """A file another loop saved: nanoGPT's ckpt.pt (its compiled model's names), a state dict
    under 'state_dict', a DDP model's 'module.' names; the weights load as they were (the
    script-weights plugin, on by default, reads them)."""
    source, _ = train(config(tmp_path / "a", train={"train_iters": 6}))
    weights = {k: v.clone() for k, v in source.model.state_dict().items()}
    torch.save(wrapped(weights), tmp_path / "ckpt.pt")
    seen = FirstWeights()
    pretrained = {"pretrained": str(tmp_path / "ckpt.pt")}
    plugin = {"script-weights": {}}  # (on by default; these tests load only the plugins they name)
    train(config(tmp_path / "b", train={"train_iters": 2}, checkpoint=pretrained, plugins=plugin), ("seen", seen))
    assert seen.step == 0 and seen.weights.keys() == weights.keys()
    assert all(torch.equal(seen.weights[k], v) for k, v in weights.items())


class NewHead(torch.nn.Module):
    """The tiny MLP with a last layer of two outputs for its one: a head of its own on a
    pretrained body, as a classifier fine-tuned on other classes has."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model().net
        self.net[3] = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x).sum(dim=1, keepdim=True), y)


HEAD, BODY = ("net.3.weight", "net.3.bias"), ("net.0.weight", "net.0.bias")


FSDP = {"distributed": {"strategy": "fsdp"}}
EXCLUDES = [  # (the source's layout, the target's, pretrained_exclude): each kind of load, each form of name
    ({}, {}, ["net.3"]),
    ({}, {}, ["net.3.*"]),
    ({}, {}, list(HEAD)),
    (FSDP, FSDP, ["net.3"]),
    ({}, FSDP, ["net.3.*"]),
    (FSDP, {}, list(HEAD)),
]


@pytest.mark.parametrize(
    ("source", "target", "exclude"),
    EXCLUDES,
    ids=["module", "glob", "names", "sharded-to-fsdp", "replicated-to-fsdp", "sharded-to-plain"],
)
def test_pretrained_exclude_keeps_a_new_heads_initialisation_and_loads_the_rest(
    tmp_path: Any, no_autoload: None, source: dict, target: dict, exclude: list[str]
) -> None:
    """Fine-tuning a trained body with a new head: the head is the model's own initialisation
    (that of the same run without pretrained weights), every other weight the checkpoint's; from
    a replicated or a sharded checkpoint (FSDP's) into a plain or a sharded model."""
    last = LastWeights()
    train(config(tmp_path / "a", train={"train_iters": 6}, **source), ("last", last))
    trained = last.weights
    assert (tmp_path / "a/out/checkpoints/step_00000006/sharded").is_dir() == bool(source)
    new_head = {"provider": "test_checkpoint:NewHead"}
    fresh, seen = FirstWeights(), FirstWeights()
    train(config(tmp_path / "fresh", model=new_head, train={"train_iters": 1}, **target), ("seen", fresh))
    pretrained = {"pretrained": str(tmp_path / "a" / "out"), "pretrained_exclude": exclude}
    tuned = config(tmp_path / "b", model=new_head, train={"train_iters": 1}, checkpoint=pretrained, **target)
    train(tuned, ("seen", seen))
    initial, loaded = fresh.weights, seen.weights
    assert all(torch.equal(loaded[k], initial[k]) for k in HEAD)
    assert all(torch.equal(loaded[k], trained[k]) for k in BODY)
    assert not torch.equal(initial[BODY[0]], trained[BODY[0]])  # the body did come from the checkpoint


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_a_pretrained_checkpoint_that_does_not_fit_names_the_parameters_and_pretrained_exclude(
    tmp_path: Any, no_autoload: None, layout: str
) -> None:
    """The same error for both kinds of checkpoint (DCP's own named one tensor as an unreadable
    file); a pattern of pretrained_exclude that matches nothing is a mistake, not a no-op."""
    fsdp = FSDP if layout == "sharded" else {}
    train(config(tmp_path / "a", train={"train_iters": 2}, **fsdp))
    new_head = {"provider": "test_checkpoint:NewHead"}
    pretrained: dict[str, Any] = {"pretrained": str(tmp_path / "a" / "out")}
    with pytest.raises(UserError) as caught:
        train(config(tmp_path / "b", model=new_head, checkpoint=pretrained))
    assert str(caught.value) == (
        f"{tmp_path / 'a/out/checkpoints/step_00000002'}: the checkpoint does not fit the model: 'net.3.weight' has "
        "shape [1, 16] in the checkpoint, [2, 16] now; 'net.3.bias' has shape [1] in the checkpoint, [2] now"
        + EXCLUDE_HINT
    )
    with pytest.raises(UserError, match=r"pretrained_exclude: 'net.33' matches no parameter's name \(did you mean"):
        train(config(tmp_path / "b", model=new_head, checkpoint={**pretrained, "pretrained_exclude": ["net.33"]}))


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_a_resume_into_a_changed_model_names_what_does_not_fit_whatever_the_layout(
    tmp_path: Any, no_autoload: None, layout: str
) -> None:
    """A model changed on purpose (resume-checks told to allow it) whose weights cannot take the
    checkpoint: one error naming the parameters and the change, for a sharded checkpoint too (it
    was DCP's 'cannot load checkpoint file: ValueError: Size mismatch' of one tensor)."""
    fsdp = FSDP if layout == "sharded" else {}
    train(config(tmp_path, train={"train_iters": 2}, **fsdp))
    narrower = {"options": {"width": 8}}
    allowed = {"resume-checks": {"allow_changes": ["model"]}}
    with pytest.raises(UserError) as caught:
        train(config(tmp_path, model=narrower, train={"train_iters": 4}, plugins=allowed, **fsdp))
    assert str(caught.value) == (
        f"{tmp_path / 'out/checkpoints/step_00000002'}: the checkpoint does not fit the model: 'net.0.weight' has "
        "shape [16, 4] in the checkpoint, [8, 4] now; 'net.0.bias' has shape [16] in the checkpoint, [8] now; "
        "'net.3.weight' has shape [1, 16] in the checkpoint, [1, 8] now; changed since the checkpoint: "
        "model.options.width (None -> 8)"
    )


@pytest.mark.parametrize("named", ["out", "out/checkpoints"])
def test_pretrained_and_resume_take_a_run_directory_as_its_newest_complete_checkpoint(
    tmp_path: Any, no_autoload: None, named: str
) -> None:
    source, _ = train(config(tmp_path / "a", train={"train_iters": 6}, checkpoint={"save_interval": 2}))
    newest = tmp_path / "a" / "out" / "checkpoints" / "step_00000006"
    (newest.parent / "step_00000008.tmp").mkdir()  # a save that never committed is passed over
    seen = FirstWeights()
    pretrained = {"pretrained": str(tmp_path / "a" / named)}
    target, _ = train(config(tmp_path / "b", train={"train_iters": 3}, checkpoint=pretrained), ("seen", seen))
    assert seen.step == 0 and target.state.step == 3
    assert all(torch.equal(seen.weights[k], v) for k, v in source.model.state_dict().items())
    resumed = FirstWeights()  # checkpoint.resume names the run too: it continues from step 6
    train(
        config(tmp_path / "c", train={"train_iters": 8}, checkpoint={"resume": str(tmp_path / "a" / named)}),
        ("r", resumed),
    )
    assert resumed.step == 6 and all(torch.equal(resumed.weights[k], v) for k, v in source.model.state_dict().items())


def test_pretrained_naming_a_run_without_a_complete_checkpoint_is_one_error(tmp_path: Any, no_autoload: None) -> None:
    (tmp_path / "a" / "checkpoints" / "step_00000002.tmp").mkdir(parents=True)
    with pytest.raises(UserError, match=r"checkpoint.pretrained: .*checkpoints holds no complete checkpoint"):
        train(config(tmp_path / "b", checkpoint={"pretrained": str(tmp_path / "a")}))


@pytest.fixture
def trained(tmp_path: Path, no_autoload: None) -> Path:
    """A run's output dir with a complete checkpoint at step 2."""
    train(config(tmp_path, train={"train_iters": 2}))
    return tmp_path / "out"


def export_to(run_dir: Path, to: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from coretrain.cli import main

    code = main(["checkpoint", "export", str(run_dir), "--to", str(to)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_export_takes_out_as_predict_names_its_output(trained: Path, tmp_path: Path) -> None:
    """``--out`` (predict's option) is ``--to``: a user who exported with the other command's word gets the file."""
    from safetensors.torch import load_file

    from coretrain.cli import main

    assert main(["checkpoint", "export", str(trained), "--out", str(tmp_path / "w.safetensors")]) == 0
    assert load_file(tmp_path / "w.safetensors")


def test_export_refuses_what_is_not_a_regular_file_and_leaves_it_as_it_was(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    fifo, link, folder = tmp_path / "pipe", tmp_path / "link.safetensors", tmp_path / "folder"
    os.mkfifo(fifo)
    os.symlink("/dev/null", link)
    folder.mkdir()
    for target, says in ((fifo, "is not a regular file"), (link, "is a symbolic link"), (folder, "is a directory")):
        code, _, err = export_to(trained, target, capsys)
        assert code == 2 and err.startswith(f"error: --to: '{target}' ") and says in err, err
        assert len(err.splitlines()) == 1
    assert os.path.islink(link) and os.readlink(link) == "/dev/null"  # nothing was renamed over them
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_export_says_when_it_replaces_a_file_and_writes_it_whole(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    target = tmp_path / "m.safetensors"
    code, out, _ = export_to(trained, target, capsys)
    assert code == 0 and "replaced" not in out
    code, out, _ = export_to(trained, target, capsys)
    assert code == 0 and "(replaced the file that was there)" in out
    assert set(load_file(str(target))) == set(torch.load(trained / "checkpoints/step_00000002/model.pt"))


def test_the_guides_plugin_for_a_format_of_your_own_reads_npz_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_autoload: None
) -> None:
    """docs/guides/checkpoints.md's ``read_pretrained`` plugin, as a user copies it: a run starts
    from a ``.npz`` of the weights (at learning rate 0 it ends with them); without the plugin the
    same file is one error naming it (no reader of the core's or the built-ins' takes it)."""
    guide = (REPO / "docs" / "guides" / "checkpoints.md").read_text()
    block = re.search(r"<!-- tests/test_checkpoint.py runs this block -->\n```python\n(.*?)```", guide, re.S)
    assert block is not None
    source, _ = train(config(tmp_path / "source", train={"train_iters": 4}))
    weights = {name: value.detach().numpy() for name, value in source.model.state_dict().items()}
    np.savez(tmp_path / "weights.npz", **weights)
    write_config(
        tmp_path / "finetune.toml", tiny_config(tmp_path / "out", train={"train_iters": 2}, optimizer={"lr": 0.0})
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), "docs/guides/checkpoints.md", "exec"), namespace)
    assert namespace["result"].step == 2
    trained = torch.load(tmp_path / "out" / "checkpoints" / "step_00000002" / "model.pt")
    assert trained.keys() == weights.keys() and all(np.array_equal(trained[k].numpy(), v) for k, v in weights.items())
    with pytest.raises(UserError, match=r"weights.npz: cannot load checkpoint file"):
        coretrain.train("finetune.toml", overrides={"checkpoint.pretrained": "weights.npz", "run.output_dir": "other"})


def test_pretrained_reads_a_safetensors_export_by_its_header_on_any_torch(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export is weights to start from, named ``.safetensors`` or not: the safetensors plugin
    reads it (``read_pretrained``), not ``torch.load``, which reads safetensors only from torch 2.12
    on and only by the name (older ones called it "an object that is not plain data ... a crafted
    or foreign file?"). A damaged one is one error."""
    from coretrain.checkpoint import safeload

    saved = torch.load(trained / "checkpoints" / "step_00000002" / "model.pt")
    plugin = {"safetensors": {}}  # (on by default; these tests load only the plugins they name)
    for name in ("m.safetensors", "m_weights"):
        code, out, err = export_to(trained, tmp_path / name, capsys)
        assert code == 0 and out.startswith(f"wrote {tmp_path / name} (checkpoint ") and "named" not in out, (out, err)
    with monkeypatch.context() as patched:  # as torch < 2.12 reads it: not at all
        patched.setattr(safeload, "load_file", lambda *_, **__: pytest.fail("torch.load was asked"))
        for name in ("m.safetensors", "m_weights"):
            seen = FirstWeights()
            pretrained = {"pretrained": str(tmp_path / name)}
            train(config(tmp_path / f"run_{name}", checkpoint=pretrained, plugins=plugin), ("seen", seen))
            assert seen.step == 0 and all(torch.equal(seen.weights[key], value) for key, value in saved.items())
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes((tmp_path / "m.safetensors").read_bytes()[:-8])
    with pytest.raises(UserError, match=r"damaged.safetensors is a safetensors file that cannot be read: "):
        train(config(tmp_path / "c", checkpoint={"pretrained": str(damaged)}, plugins=plugin))


def test_export_into_a_place_it_cannot_write_is_one_error(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = export_to(trained, Path("/proc/m.safetensors"), capsys)  # unwritable even for root
    assert code in (1, 2) and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "SafetensorError" not in err


def test_safetensors_export_needs_none_of_the_runs_plugins(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import json

    manifest = trained / "checkpoints/step_00000002/checkpoint.json"
    recorded = json.loads(manifest.read_text())
    recorded["config"]["plugins"] = {"uninstalled-since": {}}  # the run used a plugin this machine lacks
    manifest.write_text(json.dumps(recorded))
    code, out, err = export_to(trained, tmp_path / "m.safetensors", capsys)
    assert code == 0 and (tmp_path / "m.safetensors").is_file(), err
    said = err + caplog.text
    assert "no plugin named 'uninstalled-since' is installed" in said and "on-by-default export formats" in said


def test_export_to_a_format_no_plugin_writes_names_it(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coretrain.cli import main

    code = main(["checkpoint", "export", str(trained), "--to", str(tmp_path / "m.onnx"), "--format", "onnx"])
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.startswith("error: --format onnx: no plugin writes that format")
        and len(err.splitlines()) == 1
    )


def damage_rank_file(step: Path, change: Any) -> None:
    path = step / "rank_00000.pt"
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def damage_torch_file(name: str, change: Any) -> Any:
    def damage(step: Path) -> None:
        state = torch.load(step / name, weights_only=True)
        state = change(state) or state
        torch.save(state, step / name)

    return damage


def damage_manifest(key: str, value: Any) -> Any:
    def damage(step: Path) -> None:
        import json

        manifest = json.loads((step / "checkpoint.json").read_text())
        (step / "checkpoint.json").write_text(json.dumps({**manifest, key: value}))

    return damage


PENDING_NAN = {  # a pending log interval whose applied loss is NaN: no saved run has one
    "losses": torch.tensor([float("nan")]),
    "samples": 8,
    "grad_norms": torch.ones(1),
    "steps": torch.tensor([4]),
}

DAMAGES = {  # name: (damage to step 4, the file named, words in the reason)
    "rank-extra-key": (lambda s: damage_rank_file(s, lambda st: st.update(bogus=1)), "rank_00000.pt", "bogus"),
    "rank-missing-key": (lambda s: damage_rank_file(s, lambda st: st.pop("scheduler")), "rank_00000.pt", "scheduler"),
    "short-rng-state": (
        lambda s: damage_rank_file(s, lambda st: st["rng"].update(torch=st["rng"]["torch"][:100])),
        "rank_00000.pt",
        "rng.torch",
    ),
    "negative-step": (
        lambda s: damage_rank_file(s, lambda st: st["train"].update(step=-7)),
        "rank_00000.pt",
        "train.step",
    ),
    "other-step": (lambda s: damage_rank_file(s, lambda st: st["train"].update(step=9)), "rank_00000.pt", "train.step"),
    "optimizer-shapes": (
        damage_torch_file("optimizer.pt", lambda st: st["state"][0].update(exp_avg=torch.zeros(3, 3))),
        "optimizer.pt",
        "state[0].exp_avg",
    ),
    "model-other-keys": (
        damage_torch_file("model.pt", lambda st: {f"renamed.{k}": v for k, v in st.items()}),
        "model.pt",
        "is missing from the checkpoint",
    ),
    "model-not-tensors": (damage_torch_file("model.pt", lambda st: {k: 1.5 for k in st}), "model.pt", "a tensor"),
    "consumed-samples-10**15": (
        lambda s: damage_rank_file(s, lambda st: st["train"].update(consumed_samples=10**15)),
        "rank_00000.pt",
        "train.consumed_samples is 1000000000000000",
    ),
    "counters-both-10**15": (
        lambda s: damage_rank_file(
            s, lambda st: (st["train"].update(consumed_samples=10**15), st["scheduler"].update(samples=10**15))
        ),
        "rank_00000.pt",
        "after 4 step(s)",
    ),
    "pending-loss-nan": (
        lambda s: damage_rank_file(s, lambda st: st.update(interval_log=PENDING_NAN)),
        "rank_00000.pt",
        "interval_log.losses: expected finite values",
    ),
    "pending-loss-float64": (
        lambda s: damage_rank_file(
            s, lambda st: st.update(interval_log={**PENDING_NAN, "losses": torch.ones(1, dtype=torch.float64)})
        ),
        "rank_00000.pt",
        "interval_log.losses: expected a torch.float32 tensor",
    ),
    "grad-scaler-nan": (
        lambda s: damage_rank_file(s, lambda st: st.update(grad_scaler={"scale": float("nan"), "growth_factor": 2.0})),
        "rank_00000.pt",
        "grad_scaler.scale: expected a finite number > 0",
    ),
    "model-nan": (
        damage_torch_file(
            "model.pt", lambda st: {k: v.fill_(float("nan")) if k.endswith("weight") else v for k, v in st.items()}
        ),
        "model.pt",
        "holds NaN or Inf",
    ),
    "model-float64": (
        damage_torch_file("model.pt", lambda st: {k: v.double() for k, v in st.items()}),
        "model.pt",
        "is torch.float64 in the checkpoint, torch.float32 in the model",
    ),
    "manifest-step-text": (damage_manifest("step", "four"), "checkpoint.json", "step"),
    "manifest-negative-world": (damage_manifest("world_size", -2), "checkpoint.json", "world_size"),
    "manifest-float-step": (damage_manifest("step", 4.5), "checkpoint.json", "step"),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_checkpoint_file_of_the_wrong_structure_is_named_and_resume_falls_back(
    tmp_path: Path, no_autoload: None, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    damage, file, words = DAMAGES[name]
    train(config(tmp_path, train={"train_iters": 4}, checkpoint={"save_interval": 2}))
    root = tmp_path / "out" / "checkpoints"
    damage(root / "step_00000004")
    with caplog.at_level("INFO", logger="coretrain"):
        resumed, code = train(config(tmp_path, train={"train_iters": 6}, checkpoint={"save_interval": 2}))
    warning = next(r.message for r in caplog.records if "falling back" in r.message)
    assert f"{root / 'step_00000004' / file}: not a valid checkpoint file" in warning and words in warning, warning
    assert any(f"resumed from {root / 'step_00000002'}" in r.message for r in caplog.records)
    assert code == 0 and resumed.state.step == 6 and resumed.state.consumed_samples == 6 * 8


def test_a_damaged_only_checkpoint_is_one_error_naming_the_file(tmp_path: Path, no_autoload: None) -> None:
    train(config(tmp_path, train={"train_iters": 2}))
    damage_rank_file(tmp_path / "out/checkpoints/step_00000002", lambda st: st["train"].update(step=-7))
    with pytest.raises(UserError) as caught:
        train(config(tmp_path, train={"train_iters": 4}))
    assert "rank_00000.pt: not a valid checkpoint file: train.step: expected an integer >= 0" in str(caught.value)
    assert sorted(p.name for p in (tmp_path / "out/checkpoints").iterdir()) == ["latest", "step_00000002"]


PLUGIN_STATES = {  # early stopping's saved state, damaged: (the change, words in the reason)
    "best NaN": ({"best": float("nan")}, "plugins.early-stopping.best"),
    "best text": ({"best": "low"}, "plugins.early-stopping.best"),
    "negative best_step": ({"best_step": -3}, "plugins.early-stopping.best_step: must be >= 0"),
    "stopped_at text": ({"stopped_at": "soon"}, "plugins.early-stopping.stopped_at"),
    "unknown key": ({"patience_left": 2}, "plugins.early-stopping.patience_left: unknown key"),
}


@pytest.mark.parametrize("name", list(PLUGIN_STATES))
def test_a_plugin_state_that_does_not_fit_its_declared_shape_is_named_and_resume_falls_back(
    tmp_path: Path, no_autoload: None, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    """Checked as the core's rank file is (early stopping declares coretrain_state): a newest
    checkpoint whose plugin state is damaged is passed over, the only one is refused."""
    change, words = PLUGIN_STATES[name]
    stops = {"early-stopping": {"patience": 50}}
    sections = {"train": {"train_iters": 4, "eval_interval": 2, "eval_iters": 1}, "checkpoint": {"save_interval": 2}}
    run_steps(tmp_path, 4, config=sections, tables=stops)
    root = tmp_path / "out" / "checkpoints"
    damage_rank_file(root / "step_00000004", lambda st: st["plugins"]["early-stopping"].update(change))
    more = {**sections, "train": {**sections["train"], "train_iters": 6}}
    with caplog.at_level("INFO", logger="coretrain"):
        resumed = run_steps(tmp_path, 6, config=more, tables=stops)
    warning = next(r.message for r in caplog.records if "falling back" in r.message)
    assert f"{root / 'step_00000004' / 'rank_00000.pt'}: not a valid checkpoint file" in warning and words in warning
    assert resumed.exit_code == 0 and resumed.run.state.step == 6  # from step 2
    shutil.rmtree(root / "step_00000002")
    damage_rank_file(root / "step_00000006", lambda st: st["plugins"]["early-stopping"].update(change))
    shutil.rmtree(root / "step_00000004")
    with pytest.raises(UserError, match=re.escape(words)):
        run_steps(tmp_path, 8, config={**more, "train": {**more["train"], "train_iters": 8}}, tables=stops)


CHANGES = [  # (sections changed on resume, the key, applied?)
    ({"run": {"seed": 11}}, "run.seed", False),
    ({"model": {"options": {"width": 8}}}, "model.options.width", False),
    ({"data": {"options": {"samples": 300}}}, "data.options.samples", False),
    ({"data": {"provider": "coretrain.testing:tiny_data"}}, "data.provider", False),
    ({"tokenizer": {"path": "models/another-tokenizer"}}, "tokenizer.path", False),
    ({"train": {"global_batch_size": 16}}, "train.global_batch_size", True),
    ({"train": {"clip_grad": 0.5}}, "train.clip_grad", True),
    ({"run": {"precision": "bf16"}}, "run.precision", True),
]


@pytest.mark.parametrize(("changed", "key", "applied"), CHANGES, ids=[c[1] for c in CHANGES])
def test_a_changed_key_on_resume_is_applied_and_listed_or_refused_by_name(
    tmp_path: Path, no_autoload: None, caplog: pytest.LogCaptureFixture, changed: dict, key: str, applied: bool
) -> None:
    train(config(tmp_path, train={"train_iters": 4}))
    again = config(tmp_path, **{**changed, "train": {"train_iters": 6, **changed.get("train", {})}})
    if not applied:
        with pytest.raises(UserError) as caught:
            train(again)
        message = str(caught.value)
        assert f"would change what it means: {key} " in message and "train.train_iters" not in message
        assert f'[plugins.resume-checks] allow_changes = ["{key}"]' in message
        assert sorted(p.name for p in (tmp_path / "out/checkpoints").iterdir()) == ["latest", "step_00000004"]
        allow = {"resume-checks": {"allow_changes": [key.split(".")[0]]}}
        again = config(tmp_path, **{**changed, "train": {"train_iters": 6}, "plugins": allow})
        if key.startswith("model"):
            return  # a narrower model than the weights: apply() names the parameters (tests/test_trust.py)
    with caplog.at_level("WARNING", logger="coretrain"):
        resumed, code = train(again)
    warning = next(r.message for r in caplog.records if "resuming with changed settings" in r.message)
    assert f"{key} " in warning and "train.train_iters 4 -> 6" in warning, warning
    assert code == 0 and resumed.state.step == 6
    if key == "train.global_batch_size":
        assert resumed.state.consumed_samples == 4 * 8 + 2 * 16  # the new batch from the first resumed step


def test_changing_only_when_the_job_stops_resumes_without_a_warning(
    tmp_path: Path, no_autoload: None, caplog: pytest.LogCaptureFixture
) -> None:
    train(config(tmp_path, train={"train_iters": 6, "exit_interval": 2}))
    with caplog.at_level("WARNING", logger="coretrain"):
        resumed, code = train(config(tmp_path, train={"train_iters": 6, "exit_interval": 4}))
    assert code == 0 and resumed.state.step == 4
    assert not [r.message for r in caplog.records if "changed settings" in r.message]


def test_a_sharded_checkpoint_whose_weights_hold_nan_is_refused_naming_it(tmp_path: Path) -> None:
    """DCP files are read into the model's own tensors: a NaN planted there (never saved: a
    non-finite loss stops a run first) stops the resume, naming the checkpoint."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from coretrain.checkpoint.load import load_sharded
    from coretrain.errors import CheckpointUnreadable

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    weights = get_model_state_dict(model)
    weights["0.weight"] = torch.full((4, 4), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": weights}, checkpoint_id=str(tmp_path / "sharded"), no_dist=True)
    with pytest.raises(CheckpointUnreadable, match=r"sharded: not a valid checkpoint: '0.weight' holds NaN or Inf"):
        load_sharded(model, None, tmp_path / "sharded", with_frozen=True, single_process=True)


def test_a_sharded_checkpoint_of_0_3_with_nested_optimizer_groups_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sharded checkpoints save the optimizer's groups flat (one entry per parameter) since
    pipeline stages each hold other parameters; one saved before, with torch's nested groups,
    is told apart by its keys and resumes as it was saved."""
    from coretrain.checkpoint import state

    fsdp = {"distributed": {"strategy": "fsdp"}, "train": {"log_interval": 1}}
    whole = run_steps(tmp_path / "whole", steps=6, config=fsdp)
    nested = state.dcp_options
    monkeypatch.setattr(state, "dcp_options", lambda with_frozen: nested(with_frozen, flat=False))
    first = run_steps(tmp_path / "old", steps=6, config={**fsdp, "train": {"log_interval": 1, "exit_interval": 3}})
    saved = torch.distributed.checkpoint.FileSystemReader(str(first.output_dir / "checkpoints/step_00000003/sharded"))
    assert "optimizer.param_groups.0.params" in saved.read_metadata().state_dict_metadata  # the nested form
    monkeypatch.undo()
    resumed = run_steps(tmp_path / "old", steps=6, config=fsdp)
    assert [m["loss"] for m in first.metrics + resumed.metrics] == [m["loss"] for m in whole.metrics]


def test_a_resume_reads_a_sharded_checkpoints_metadata_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restricted reader of DCP's ``.metadata`` is pure Python (1.4 s for 28,800 chunks, on
    every rank): a resume reads it once, to check it before the run changes, and the load and
    DCP's reader take what was checked (read three times before)."""
    from coretrain.checkpoint import dcpmetadata

    fsdp = {"distributed": {"strategy": "fsdp"}, "train": {"log_interval": 1}}
    first = run_steps(tmp_path, steps=4, config={**fsdp, "train": {"log_interval": 1, "exit_interval": 2}})
    reads: list[int] = []
    real = dcpmetadata.load
    monkeypatch.setattr(dcpmetadata, "load", lambda stream: reads.append(1) or real(stream))
    resumed = run_steps(tmp_path, steps=4, config=fsdp)
    assert [m["step"] for m in first.metrics + resumed.metrics] == [1, 2, 3, 4] and len(reads) == 1


@pytest.mark.parametrize("async_save", [False, True])
def test_storage_writers_per_rank_writes_a_sharded_checkpoint_in_that_many_files_that_resume_exactly(
    tmp_path: Path, async_save: bool
) -> None:
    """checkpoint.storage_writers_per_rank is DCP's thread count (Megatron-Bridge's key): each
    writer thread writes a file of its own, and the checkpoint resumes as one written by one."""
    fsdp = {"distributed": {"strategy": "fsdp"}, "train": {"log_interval": 1}}
    whole = run_steps(tmp_path / "whole", steps=6, config=fsdp)
    writers = {**fsdp, "checkpoint": {"storage_writers_per_rank": 3, "async_save": async_save}}
    first = run_steps(tmp_path / "split", steps=6, config={**writers, "train": {"log_interval": 1, "exit_interval": 3}})
    files = sorted(p.name for p in (first.output_dir / "checkpoints/step_00000003/sharded").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    one = sorted(p.name for p in (whole.output_dir / "checkpoints/step_00000006/sharded").glob("*.distcp"))
    assert one == ["__0_0.distcp"]  # the default: one writer per rank
    resumed = run_steps(tmp_path / "split", steps=6, config=writers)
    assert [m["loss"] for m in first.metrics + resumed.metrics] == [m["loss"] for m in whole.metrics]
