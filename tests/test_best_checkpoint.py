"""keep-best: the best evaluated step is saved, kept from keep_last, and found as checkpoints/best."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from coretrain import UserError, hookimpl, movedkeys
from coretrain.testing import run_steps


def settings(mode: str = "min", eval_interval: int = 2, **train: Any) -> dict[str, dict[str, Any]]:
    return {
        "train": {"eval_interval": eval_interval, "eval_iters": 1, **train},
        "checkpoint": {"save_interval": 4, "keep_last": 1},
        "plugins": {"keep-best": {"metric": "valid/loss", "mode": mode}},
    }


def kept(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))


def best_state(out: Path) -> dict[str, Any]:
    """keep-best's state in the newest checkpoint: what a resumed run knows of the best so far."""
    newest = (out / "checkpoints" / "latest").read_text().strip()
    saved = torch.load(out / "checkpoints" / f"step_{int(newest):08d}" / "rank_00000.pt", weights_only=True)
    state: dict[str, Any] = saved["plugins"]["keep-best"]
    return state


def test_keep_last_1_keeps_the_best_evaluation_and_best_points_at_it(tmp_path: Path) -> None:
    """ "max" of a falling loss: the first evaluation (step 2) stays the best. It was saved at
    its own step although 2 is no save step, and keep_last = 1 deletes every other but the newest."""
    result = run_steps(tmp_path, 12, config=settings("max"))
    out = result.output_dir
    assert kept(out) == ["step_00000002", "step_00000012"]
    assert os.readlink(out / "checkpoints" / "best") == "step_00000002"
    first = result.evals[0]
    assert first["step"] == 2
    assert best_state(out) == {"metric": "valid/loss", "mode": "max", "value": first["valid/loss"], "step": 2}


def test_the_final_validation_can_be_the_best(tmp_path: Path) -> None:
    """Evaluations at 5 and 10, then the final one at 12 after the final save: a falling loss
    makes step 12 the best, and the step-10 checkpoint goes."""
    result = run_steps(tmp_path, 12, config=settings("min", eval_interval=5))
    out = result.output_dir
    assert [e["step"] for e in result.evals] == [5, 10, 12]
    assert os.readlink(out / "checkpoints" / "best") == "step_00000012"
    assert result.run.plugins.get("keep-best").value == result.evals[-1]["valid/loss"]  # type: ignore[union-attr]
    assert kept(out) == ["step_00000012"]


def test_a_resumed_run_knows_the_best_so_far_and_resume_takes_the_newest(tmp_path: Path) -> None:
    first = run_steps(tmp_path, 12, config=settings("max", exit_interval=6))
    assert first.run.state.step == 6
    resumed = run_steps(tmp_path, 12, config=settings("max"))
    assert resumed.evals[0]["step"] == 8  # resumed from step 6, the newest, not from the best
    out = resumed.output_dir
    assert os.readlink(out / "checkpoints" / "best") == "step_00000002"  # step 8 did not beat it
    assert kept(out) == ["step_00000002", "step_00000012"]


def test_export_and_resume_follow_best(tmp_path: Path, cli: Any) -> None:
    result = run_steps(tmp_path, 8, config=settings("max"))
    out = result.output_dir
    exported = cli(
        "checkpoint", "export", str(out), "--step", "best", "--to", str(tmp_path / "best.safetensors"), cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    assert "step_00000002" in exported.stdout
    weights = load_file(tmp_path / "best.safetensors")
    newest = load_file_of(cli, out, tmp_path)
    assert any(not (weights[name] == newest[name]).all() for name in weights)  # step 2's weights, not step 8's
    listing = cli("checkpoint", "list", str(out), cwd=tmp_path)
    assert "complete best" in listing.stdout.splitlines()[1]
    again = run_steps(
        tmp_path / "again",
        4,
        config={"checkpoint": {"resume": str(out / "checkpoints" / "best")}, "train": {"eval_iters": 0}},
    )
    assert again.run.state.step == 4 and again.hooks("on_log")[0] == 4  # resumed at step 2: steps 3..4


def load_file_of(cli: Any, out: Path, tmp_path: Path) -> dict[str, Any]:
    done = cli("checkpoint", "export", str(out), "--to", str(tmp_path / "newest.safetensors"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return load_file(tmp_path / "newest.safetensors")


def test_export_best_without_keep_best_is_one_clear_error(tmp_path: Path, cli: Any) -> None:
    out = run_steps(tmp_path, 4).output_dir
    result = cli(
        "checkpoint", "export", str(out), "--step", "best", "--to", str(tmp_path / "w.safetensors"), cwd=tmp_path
    )
    assert result.returncode == 2
    assert "--step best: " in result.stderr and "[plugins.keep-best]" in result.stderr


def test_keep_best_of_a_metric_not_evaluated_or_without_evaluations_is_one_clear_error(tmp_path: Path) -> None:
    wrong = settings()
    wrong["plugins"]["keep-best"]["metric"] = "valid/accuracy"
    with pytest.raises(UserError, match=r"plugins.keep-best.metric: 'valid/accuracy' is not among .*valid/loss"):
        run_steps(tmp_path / "a", 4, config=wrong)
    never = settings()
    del never["train"]["eval_interval"]
    with pytest.raises(UserError, match=r"plugins.keep-best.metric = 'valid/loss', but this run never evaluates"):
        run_steps(tmp_path / "b", 4, config=never)


class AddsScore:
    """A plugin that adds its own evaluated metric in on_eval (tryfirst), as a user's F1 would."""

    @hookimpl(tryfirst=True)
    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        metrics["valid/score"] = -abs(step - 4)  # best at step 4


def test_keep_best_watches_a_metric_a_plugin_adds_in_on_eval(tmp_path: Path) -> None:
    config = settings("max")
    config["plugins"]["keep-best"]["metric"] = "valid/score"
    result = run_steps(tmp_path, 8, config=config, plugins={"score": AddsScore()})
    assert os.readlink(result.output_dir / "checkpoints" / "best") == "step_00000004"


@pytest.mark.parametrize("original", ["kept", "deleted"])
def test_a_run_copied_with_cp_rl_resumes_and_best_is_the_link_again(tmp_path: Path, original: str) -> None:
    """``cp -rL`` (here copytree, which follows links) turns ``best`` into a copy of its step; the
    run failed at every improving evaluation (IsADirectoryError). A copy of a step that still
    exists gives way to the link; one whose step retention deleted becomes that step again."""
    first = run_steps(tmp_path / "run", 8, config=settings("max"))
    copy = tmp_path / "copy"
    shutil.copytree(first.output_dir.parent, copy)  # follows the link: best is a directory now
    best = copy / "out" / "checkpoints" / "best"
    assert best.is_dir() and not best.is_symlink()
    weights = (best / "model.pt").read_bytes()
    if original == "deleted":
        shutil.rmtree(copy / "out" / "checkpoints" / "step_00000002")
    resumed = run_steps(copy, 12, config=settings("max"))
    assert resumed.exit_code == 0 and resumed.run.state.step == 12
    assert os.readlink(best) == "step_00000002"  # the link again, to the same (still best) step
    assert (best / "model.pt").read_bytes() == weights
    assert kept(copy / "out") == ["step_00000002", "step_00000012"]


def test_a_best_that_coretrain_did_not_make_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "out" / "checkpoints" / "best").mkdir(parents=True)
    with pytest.raises(UserError, match=r"checkpoints/best is not the link coretrain keeps .*\(a directory"):
        run_steps(tmp_path, 4, config=settings())
    assert not (tmp_path / "out" / "checkpoints" / "step_00000002").exists()  # nothing trained


def test_a_best_link_leading_outside_the_run_is_not_trusted(tmp_path: Path, cli: Any) -> None:
    """A ``best`` pointing at another run's step: its value is not read as this run's best so far,
    ``--step best`` and ``checkpoint.resume = ".../best"`` do not follow it, and a resumed run
    points it at its own best again (its checkpointed state knows which step that is)."""
    other = run_steps(tmp_path / "other", 4, config=settings("max")).output_dir
    out = run_steps(tmp_path / "run", 4, config=settings("max", eval_interval=3)).output_dir
    link = out / "checkpoints" / "best"
    link.unlink()
    os.symlink(other / "checkpoints" / "step_00000002", link)  # leads outside the run
    exported = cli("checkpoint", "export", str(out), "--step", "best", "--to", str(tmp_path / "b.st"), cwd=tmp_path)
    assert exported.returncode == 2 and "has no best checkpoint" in exported.stderr
    with pytest.raises(UserError, match=r"checkpoint.resume: .*best -> .* is not a link to a step directory beside it"):
        run_steps(tmp_path / "again", 4, config={"checkpoint": {"resume": str(link)}, "train": {"eval_iters": 0}})
    resumed = run_steps(tmp_path / "run", 8, config=settings("max", eval_interval=3))
    assert resumed.exit_code == 0
    assert os.readlink(link) == "step_00000003"  # its own best (the first evaluation: "max" of a falling loss)


def test_the_old_checkpoint_keep_best_keys_still_work_with_one_deprecation_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(movedkeys, "_warned", set())  # a fresh process, as far as warnings go
    train = {"eval_interval": 2, "eval_iters": 1}
    old = {"train": train, "checkpoint": {"keep_best": "valid/loss", "keep_best_mode": "max"}}
    with caplog.at_level("WARNING", logger="coretrain"):
        result = run_steps(tmp_path / "a", 6, config=old)
        run_steps(tmp_path / "b", 6, config=old)  # a second load in the process: no second warning
    assert os.readlink(result.output_dir / "checkpoints" / "best") == "step_00000002"
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(said) == 2, said
    assert "checkpoint.keep_best is deprecated: it is plugins.keep-best.metric now" in said[0]
    assert "checkpoint.keep_best_mode is deprecated: it is plugins.keep-best.mode now" in said[1]
    # a checkpoint written with the old keys resumes under the new ones, with no change to warn of
    new = {"train": train, "plugins": {"keep-best": {"metric": "valid/loss", "mode": "max"}}}
    caplog.clear()
    with caplog.at_level("WARNING", logger="coretrain"):
        resumed = run_steps(tmp_path / "a", 8, config=new)
    assert resumed.exit_code == 0 and not [r for r in caplog.records if "keep" in r.getMessage()]


def test_a_keep_best_mode_without_keep_best_turns_nothing_on(tmp_path: Path) -> None:
    result = run_steps(tmp_path, 4, config={"checkpoint": {"keep_best_mode": "max"}})
    assert result.exit_code == 0 and result.run.plugins.get("keep-best") is None


def test_the_python_api_reports_the_checkpoints_plugins_named(tmp_path: Path) -> None:
    """``TrainResult.checkpoints`` holds each named link a plugin left beside the steps (the core
    names none); the old ``best_checkpoint`` still answers, with one deprecation warning."""
    import coretrain
    from coretrain.testing import tiny_config

    config = tiny_config(tmp_path / "out", **settings("max"))
    result = coretrain.train(config, overrides={"train.train_iters": 8})
    link = tmp_path / "out" / "checkpoints" / "best"
    assert result.checkpoints == {"best": link}
    assert os.readlink(link) == "step_00000002"
    with pytest.warns(DeprecationWarning, match=r'result.checkpoints.get\("best"\)'):
        assert result.best_checkpoint == link
    (link.parent / "elsewhere").symlink_to(tmp_path)  # a link that leads out of the run is no checkpoint of it
    assert coretrain.train(config, overrides={"train.train_iters": 10}).checkpoints == {"best": link}


@pytest.mark.parametrize("entry", ["0.2", "not its own"])
def test_a_checkpoint_of_0_2_resumes_the_best_from_its_manifest_entry(
    tmp_path: Path, entry: str, caplog: pytest.LogCaptureFixture
) -> None:
    """0.2's ``checkpoint.keep_best`` kept the best in the ``best`` entry of the manifest the link
    points at, not as a plugin state: keep-best reads it on resume. The entry is keep-best's to
    read (the core's manifest check leaves it alone): one that is not ``{metric, mode, value}``
    is not used, and the best starts afresh."""
    first = run_steps(tmp_path, 4, config=settings("max"))  # "max" of a falling loss: step 2 stays the best
    root = first.output_dir / "checkpoints"
    value = first.evals[0]["valid/loss"]
    rank_file = root / "step_00000004" / "rank_00000.pt"
    saved = torch.load(rank_file, weights_only=True)
    del saved["plugins"]["keep-best"]  # what 0.2 wrote: no state of the plugin
    torch.save(saved, rank_file)
    manifest = root / "step_00000002" / "checkpoint.json"
    recorded = json.loads(manifest.read_text())
    recorded["best"] = {"metric": "valid/loss", "mode": "max", "value": value if entry == "0.2" else "high"}
    manifest.write_text(json.dumps(recorded))

    with caplog.at_level("WARNING", logger="coretrain"):
        resumed = run_steps(tmp_path, 8, config=settings("max"))
    assert resumed.evals[0]["step"] == 6
    best = resumed.run.plugins.get("keep-best")
    if entry == "0.2":
        assert os.readlink(root / "best") == "step_00000002"  # step 6 did not beat the resumed best
        assert (best.value, best.step) == (value, 2)  # type: ignore[union-attr]
    else:
        assert os.readlink(root / "best") == "step_00000006"  # afresh: the first evaluation after the resume
        said = [record.getMessage() for record in caplog.records]
        assert any("the 'best' entry of step 2's checkpoint.json is not one it wrote" in line for line in said), said
