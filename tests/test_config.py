"""Config composition and the one-clear-message rule, through the real CLI."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
import tomli
import tomli_w
from conftest import tiny_gpt_config

import coretrain
from coretrain import movedkeys
from coretrain.config import Config
from coretrain.configload import describe_type, load_config, structure


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def assert_user_error(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ")
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_extends_then_set_overrides_in_that_order(tmp_path: Path) -> None:
    write(tmp_path / "base.toml", "[train]\nmicro_batch_size = 4\ntrain_iters = 100\n[optimizer]\nlr = 0.1\n")
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[train]\ntrain_iters = 50\n')
    config = load_config(child, ["optimizer.lr=3e-4", "run.name=exp1", "optimizer.betas=[0.8, 0.9]"]).config
    assert config.train.micro_batch_size == 4  # from base
    assert config.train.train_iters == 50  # child beats base
    assert config.optimizer.lr == 3e-4  # --set beats both, typed by TOML
    assert config.run.name == "exp1"  # bare words are strings
    assert config.optimizer.betas == (0.8, 0.9)


def test_a_file_that_switches_provider_does_not_inherit_the_old_providers_options(tmp_path: Path) -> None:
    """As Hydra's config groups: the quickstart's gpt options are no options of hf."""
    base = (
        '[model]\nprovider = "gpt"\n[model.options]\nn_embd = 64\nn_layer = 2\n'
        '[data]\nprovider = "text-bytes"\n[data.options]\nseq_length = 64\nmax_bytes = 1000\n'
    )
    write(tmp_path / "base.toml", base)
    child = write(
        tmp_path / "child.toml",
        'extends = "base.toml"\n[model]\nprovider = "hf"\n[model.options]\npath = "models/tiny"\n'
        "[data.options]\nseq_length = 32\n",
    )
    config = load_config(child).config
    assert (config.model.provider, config.model.options) == ("hf", {"path": "models/tiny"})
    assert config.data.options == {"seq_length": 32, "max_bytes": 1000}  # same provider: merged
    same = load_config(tmp_path / "base.toml", ["model.provider=gpt", "model.options.n_layer=4"]).config
    assert same.model.options == {"n_embd": 64, "n_layer": 4}
    switched = load_config(tmp_path / "base.toml", ["data.provider=mock", "data.options.vocab_size=50"]).config
    assert (switched.data.provider, switched.data.options) == ("mock", {"vocab_size": 50})


def test_bad_toml_names_file_line_and_column(tmp_path: Path, cli: Any) -> None:
    path = write(tmp_path / "bad.toml", "[train]\nmicro_batch_size = = 3\n")
    assert_user_error(cli("run", str(path), cwd=tmp_path), f"{path}:2:20: invalid TOML")


def test_wrong_type_names_line_key_path_and_expected_type(tmp_path: Path, cli: Any) -> None:
    path = write(tmp_path / "c.toml", '[train]\nlog_interval = 10\nmicro_batch_size = "four"\n')
    assert_user_error(
        cli("config", "validate", str(path), cwd=tmp_path),
        f"{path}:3: train.micro_batch_size: expected an integer, got 'four' (string)",
    )


def takes_a_list(kind: Any) -> bool:
    """``list[...]`` or ``tuple[...]`` (written as a list: ``betas``) itself, or one arm of a union
    (``list[int] | None``)."""
    return any(
        list in (arm, typing.get_origin(arm)) or typing.get_origin(arm) is tuple
        for arm in (kind, *typing.get_args(kind))
    )


def list_fields(cls: Any) -> list[str]:
    """The keys of an attrs config class (not its own state) that take a list (or nothing)."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in attrs.fields(cls) if f.init and takes_a_list(hints[f.name])]


def every_list_key() -> list[tuple[str, ...]]:
    """Every key of the core's tables and of every installed plugin's table that takes a list."""
    keys = [
        (table, name)
        for table, kind in typing.get_type_hints(Config).items()
        if attrs.has(kind)
        for name in list_fields(kind)
    ]
    for name, entry in sorted(coretrain.discover().items()):
        cls = entry.load()
        keys += [("plugins", name, field) for field in list_fields(cls)] if attrs.has(cls) else []
    return keys


def test_a_string_for_a_list_is_one_error_not_a_list_of_its_characters() -> None:
    """`target_modules = "q_proj"` became ["q", "_", "p", ...] and `pretrained_exclude = "head"`
    ["h", "e", "a", "d"] without a word (cattrs iterates a string), and `betas = "0.9 0.95"` was three
    lines, two of them "optimizer.betas.0: expected a finite number, got nothing". Every key of the
    core's and of every installed plugin's tables that takes a list refuses one, in one line; a
    tuple from Python is a list."""
    keys = every_list_key()
    assert ("checkpoint", "pretrained_exclude") in keys and ("plugins", "lora", "target_modules") in keys
    assert ("optimizer", "betas") in keys and len(keys) > 15
    for key in keys:
        with pytest.raises(coretrain.UserError) as caught:
            coretrain.load_plugins({"model": {"provider": "gpt"}}, [f'{".".join(key)}="0.9 x"'], autoload=False)
        dotted = ".".join(key)
        problems = [line for line in str(caught.value).splitlines() if f": {dotted}" in line]  # (not a required key's)
        assert len(problems) == 1 and f"{dotted}: expected a list" in problems[0], (key, problems)
        assert "got '0.9 x' (string)" in problems[0], key

    assert describe_type(list[Any]) == "a list" and describe_type(list[str]) == "a list of strings"  # not "typing.Anys"
    loaded = coretrain.load({}, {"train.exit_signals": ("SIGTERM",), "checkpoint.pretrained_exclude": ("head",)})
    assert (loaded.config.train.exit_signals, loaded.config.checkpoint.pretrained_exclude) == (["SIGTERM"], ["head"])


def test_unknown_key_suggests_the_right_one(tmp_path: Path, cli: Any) -> None:
    path = write(tmp_path / "c.toml", "[train]\ntrain_iter = 10\n")
    assert_user_error(
        cli("config", "validate", str(path), cwd=tmp_path),
        "train.train_iter: unknown key (did you mean 'train_iters'?)",
    )


def test_a_plugins_own_state_is_no_key_a_config_sets(tmp_path: Path, cli: Any) -> None:
    """early-stopping keeps its best value in a field of its class (init=False, checkpointed): an
    unknown key was answered "did you mean 'best'?" for `best` itself, and the known keys listed
    it. They are the keys a config may set."""
    path = write(tmp_path / "c.toml", "[plugins.early-stopping]\nbest = 1.0\n")
    assert_user_error(
        cli("config", "validate", str(path), cwd=tmp_path),
        "plugins.early-stopping.best: unknown key (known keys: metric, mode, patience, min_delta, check_finite)",
    )


def test_unknown_plugin_suggests_the_installed_one(tmp_path: Path, cli: Any) -> None:
    path = write(tmp_path / "c.toml", '[model]\nprovider = "gtp"\n')
    assert_user_error(
        cli("run", str(path), cwd=tmp_path),
        "model.provider: no plugin named 'gtp' is installed (did you mean 'gpt'?)",
    )


def test_plugin_table_errors_use_the_plugin_key_path(tmp_path: Path, cli: Any) -> None:
    path = write(
        tmp_path / "c.toml",
        '[model]\nprovider = "gpt"\n[model.options]\nn_layers = 2\n[plugins.progress]\nplain = "yes"\n',
    )
    assert_user_error(
        cli("config", "validate", str(path), cwd=tmp_path),
        "model.options.n_layers: unknown key (did you mean 'n_layer'?)",
    )
    path = write(tmp_path / "d.toml", '[plugins.progress]\nplain = "yes"\n')
    assert_user_error(
        cli("config", "validate", str(path), cwd=tmp_path),
        f"{path}:2: plugins.progress.plain: expected true or false, got 'yes' (string)",
    )
    path = write(tmp_path / "e.toml", '[plugins.wandb]\nmode = "offlin"\n')  # an optional choice
    assert_user_error(
        cli("config", "validate", str(path), cwd=tmp_path),
        f"{path}:2: plugins.wandb.mode: expected one of 'online', 'offline', 'disabled', "
        "got 'offlin' (string) (did you mean 'offline'?)",
    )


def test_inconsistent_batch_sizes(tmp_path: Path, cli: Any) -> None:
    path = write(tmp_path / "c.toml", "[train]\nmicro_batch_size = 4\nglobal_batch_size = 10\n")
    assert_user_error(
        cli("config", "validate", str(path), cwd=tmp_path),
        "train.global_batch_size (10) is not a multiple of train.micro_batch_size × data-parallel size "
        "(4 × 1 = 4); set train.decrease_batch_size_if_needed = true to train with a global batch of 8",
    )


def test_missing_file_and_missing_base_and_bad_set(tmp_path: Path, cli: Any) -> None:
    assert_user_error(cli("run", "nope.toml", cwd=tmp_path), "nope.toml: config file not found")
    path = write(tmp_path / "c.toml", 'extends = "base.toml"\n')
    assert_user_error(cli("run", str(path), cwd=tmp_path), "extends: 'base.toml' not found")
    ok = write(tmp_path / "ok.toml", "")
    assert_user_error(
        cli("config", "validate", str(ok), "--set", "train.lr", cwd=tmp_path),
        "--set train.lr: expected KEY.PATH=VALUE",
    )
    assert_user_error(
        cli("config", "validate", str(ok), "--set", "optimizer.lr=fast", cwd=tmp_path),
        "--set optimizer.lr=fast: optimizer.lr: expected a finite number, got 'fast' (string)",
    )


def test_extends_cycle_is_reported(tmp_path: Path, cli: Any) -> None:
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    assert_user_error(cli("run", str(tmp_path / "a.toml"), cwd=tmp_path), "'extends' forms a cycle")


def test_config_show_marks_non_defaults_and_includes_plugin_defaults(tmp_path: Path, cli: Any) -> None:
    path = write(tmp_path / "c.toml", tiny_gpt_config(tmp_path / "out"))
    result = cli("config", "show", str(path), "--set", "optimizer.lr=0.01", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "lr = 0.01  # default: 0.0003" in lines
    assert "weight_decay = 0.01" in lines  # a default, unmarked
    assert "n_layer = 1  # default: 4" in lines  # provider options with their defaults
    assert "dropout = 0.0" in lines
    assert "[plugins.progress]" in lines  # autoloaded plugins show too
    (iters,) = [line for line in lines if line.startswith("train_iters = ")]
    assert iters.endswith("# default: (unset)")  # as declared, not 1000 (what a run counted by nothing else takes)
    assert lines[0].endswith("resolved (--set applied); '# default: ...' marks values you changed")
    by_samples = tiny_gpt_config(tmp_path / "out").replace("train_iters = ", "train_samples = ")
    lines = cli("config", "show", str(write(tmp_path / "s.toml", by_samples)), cwd=tmp_path).stdout.splitlines()
    assert "# train_iters = (unset)" in lines  # unset: no "default: 1000" (that is a run counted by nothing else)
    assert not [line for line in lines[1:] if line.startswith("# ") and "# default" in line]


def test_resolved_config_written_by_a_run_loads_back_identically(tmp_path: Path, cli: Any) -> None:
    path = write(tmp_path / "c.toml", tiny_gpt_config(tmp_path / "out", train_iters=2, eval_iters=0))
    result = cli("run", str(path), "--set", "optimizer.lr=0.002", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    saved = tomli.loads((tmp_path / "out" / "config.toml").read_text())
    assert structure(saved, Config) == load_config(path, ["optimizer.lr=0.002"]).config


def test_a_choice_differing_only_in_case_is_the_suggestion(tmp_path: Path, cli: Any) -> None:
    path = write(tmp_path / "c.toml", '[optimizer]\nname = "adamW"\n')
    assert_user_error(
        cli("config", "validate", str(path), cwd=tmp_path),
        "optimizer.name: must be adamw, adam, sgd, adafactor or 'package.module:Class', got 'adamW' "
        "(did you mean 'adamw'?)",
    )
    bad_set = cli("config", "validate", str(path), "--set", "optimizer.lr", cwd=tmp_path)
    assert "e.g. --set optimizer.lr=3e-4" in bad_set.stderr  # an example that is itself valid


def test_a_third_party_plugins_own_attrs_validators_name_the_option_and_the_set_flag(tmp_path: Path) -> None:
    from attrs import define, field, validators

    from coretrain.configload import structure
    from coretrain.errors import UserError

    @define(kw_only=True)
    class LrCsv:
        every: int = field(default=5, validator=validators.gt(0))
        mode: str = field(default="a", validator=validators.in_(["a", "w"]))

        def __attrs_post_init__(self) -> None:
            if self.every == 7:
                raise ValueError("every = 7 collides with the log interval")

    where = {("plugins", "lr-csv", "every"): "--set plugins.lr-csv.every=0"}
    for table, expected in [
        ({"every": 0}, "--set plugins.lr-csv.every=0: plugins.lr-csv.every: must be > 0: 0"),
        ({"mode": "x"}, "plugins.lr-csv.mode: must be in ['a', 'w'] (got 'x')"),
        ({"every": 7}, "plugins.lr-csv: every = 7 collides with the log interval"),
    ]:
        with pytest.raises(UserError) as error:
            structure(table, LrCsv, prefix=("plugins", "lr-csv"), locations=where)
        assert expected in str(error.value) and "expected a table" not in str(error.value)


OLD_VALUES = {
    "checkpoint.keep_best": "valid/loss",
    "checkpoint.keep_best_mode": "max",
    "run.peak_tflops": 312.0,
    "distributed.step_timeout_seconds": 60.0,
    "scheduler": {"decay_style": "linear"},
    "checkpoint.allow_changes": ["run.seed"],
}


@pytest.mark.parametrize("old", sorted(movedkeys.MOVED))
def test_every_moved_key_still_loads_at_its_new_place_with_one_warning(
    old: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key that moved with its feature to a plugin's table keeps working (DEVELOPERS.md's rule)."""
    monkeypatch.setattr(movedkeys, "_warned", set())
    new, _ = movedkeys.MOVED[old]
    value = OLD_VALUES[old]
    extra = {"plugins.keep-best.metric": "valid/loss"} if old == "checkpoint.keep_best_mode" else {}
    with caplog.at_level("WARNING", logger="coretrain"):
        for _ in range(2):
            loaded = coretrain.load({"model": {"provider": "m"}}, {old: value, **extra})
    data = coretrain.config_as_dict(loaded.config)
    for part in new.split("."):
        data = data[part]
    assert data == value
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert said == [f"overrides[{old!r}]: {old} is deprecated: it is {new} now; rename it"]


class ClosedPipe:
    """stdout whose reader went away (``| head`` after its lines)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_stops_early_is_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from coretrain.cli import main

    config = tmp_path / "c.toml"
    config.write_text(tiny_gpt_config(tmp_path / "out"))
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["config", "show", str(config)]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "means"),
    [("bf16_mixed", "bf16"), ("fp16_mixed", "fp16"), ("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("bf16", "bf16")],
)
def test_megatron_bridge_and_lightning_precision_names_are_read_as_ours(name: str, means: str) -> None:
    """run.precision takes Megatron-Bridge's recipe names and Lightning's for the same mixed
    precision; the run (and its config.toml) sees ours, so every plugin reads one spelling."""
    config = coretrain.load({"model": {"provider": "m"}, "run": {"precision": name}}).config
    assert config.run.precision == means


def test_a_precision_name_we_do_not_take_is_one_error_listing_those_we_do() -> None:
    with pytest.raises(coretrain.UserError, match=r"run\.precision: expected one of 'fp32', 'bf16', .*'16-mixed', got"):
        coretrain.load({"model": {"provider": "m"}, "run": {"precision": "bf16_with_fp8_delayed_scaling_mixed"}})


BASE_VALUES = {  # a value of each moved key other than OLD_VALUES'
    "checkpoint.keep_best": "train/loss",
    "checkpoint.keep_best_mode": "min",
    "run.peak_tflops": 989.0,
    "distributed.step_timeout_seconds": 30.0,
    "scheduler": {"decay_style": "cosine"},
    "checkpoint.allow_changes": ["data.options"],
}


def toml_at(dotted: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for "a.b"."""
    *tables, name = dotted.split(".")
    data: dict[str, Any] = {name: value}
    for table in reversed(tables):
        data = {table: data}
    return data


@pytest.mark.parametrize("old", sorted(movedkeys.MOVED))
@pytest.mark.parametrize("spelling", ["child old, base new", "child new, base old", "--set old, file new"])
def test_the_child_wins_over_its_base_whatever_name_either_uses(
    old: str, spelling: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config that extends another (or a --set) and sets a moved key under its old name still
    overrides the base's value under the new name, and the other way round."""
    from coretrain.configload import deep_merge

    monkeypatch.setattr(movedkeys, "_warned", set())
    new, _ = movedkeys.MOVED[old]
    turned_on = toml_at("plugins.keep-best.metric", "valid/loss") if old == "checkpoint.keep_best_mode" else {}
    base_key, child_key = (new, old) if spelling != "child new, base old" else (old, new)
    base = deep_merge({"model": {"provider": "m"}, **turned_on}, toml_at(base_key, BASE_VALUES[old]))
    write(tmp_path / "base.toml", tomli_w.dumps(base))
    if spelling == "--set old, file new":
        loaded = coretrain.load(tmp_path / "base.toml", {old: OLD_VALUES[old]})
    else:
        child = {"extends": "base.toml", **toml_at(child_key, OLD_VALUES[old])}
        loaded = coretrain.load(write(tmp_path / "child.toml", tomli_w.dumps(child)))
    data = coretrain.config_as_dict(loaded.config)
    for part in new.split("."):
        data = data[part]
    expected = OLD_VALUES[old]
    if isinstance(expected, dict):  # a moved table merges with the base's: the child's keys win
        assert {key: data[key] for key in expected} == expected
    else:
        assert data == expected
