"""Hostile and careless input: every case is one ``error:`` line and a non-zero exit, never a
traceback, a hang or a silent success. In-process, through ``coretrain.cli.main`` with the
output captured, as the CLI's own tests should be (the real CLI is smoke-tested elsewhere).
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coretrain.cli import main
from coretrain.testing import tiny_config, write_config


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, the one error line) of ``coretrain ARGV``; fails on anything but one error line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1 and "Traceback" not in err, (code, err)
    return code, errors[0]


@pytest.fixture
def config(tmp_path: Path, no_autoload: None) -> Path:
    return write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", train={"train_iters": 2}))


@pytest.fixture
def on_path(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path`` importable, as the current directory is for `coretrain run` (``mod:fn``)."""
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in [m for m, module in sys.modules.items() if str(tmp_path) in str(getattr(module, "__file__", ""))]:
        del sys.modules[name]


# --------------------------------------------------------------------------- extends


def test_an_extends_chain_of_a_thousand_files_is_refused(tmp_path: Path, capsys: Any) -> None:
    for i in range(1000):
        (tmp_path / f"c{i}.toml").write_text(f'extends = "c{i + 1}.toml"\n' if i < 999 else "[run]\n")
    _, line = cli(capsys, "config", "validate", str(tmp_path / "c0.toml"))
    assert "'extends' goes 32 files deep (at most 32); flatten the chain" in line


def test_a_diamond_of_extends_reads_each_file_once(tmp_path: Path, config: Path, monkeypatch: Any) -> None:
    from coretrain import configload

    for level in range(16):  # each level extends both files of the level below: 2**16 paths
        for side in "ab":
            below = [f"l{level + 1}{s}.toml" for s in "ab"] if level < 15 else []
            (tmp_path / f"l{level}{side}.toml").write_text(f"extends = {below!r}\n".replace("'", '"'))
    (tmp_path / "top.toml").write_text(f'extends = ["l0a.toml", "l0b.toml", "{config.name}"]\n')
    reads: list[Path] = []
    real = configload.read_toml
    monkeypatch.setattr(configload, "read_toml", lambda path: reads.append(path) or real(path))
    loaded = configload.load_config(tmp_path / "top.toml")
    assert loaded.config.train.train_iters == 2
    assert len(reads) == len({p.resolve() for p in reads}) == 34  # 32 levels' files, top and c.toml


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_extends_of_something_that_is_not_a_config_file_is_refused(
    tmp_path: Path, capsys: Any, kind: str, config: Path
) -> None:
    if kind == "fifo":
        os.mkfifo(tmp_path / "base.toml")  # reading it would wait for a writer forever
        target, words = "base.toml", "not a regular file"
    elif kind == "dev-zero":
        target, words = "/dev/zero", "not a regular file"
    else:
        (tmp_path / "base.toml").write_bytes(b"#" * (2 << 20))
        target, words = "base.toml", "is not a config file (at most 1,048,576)"
    config.write_text(f'extends = "{target}"\n' + config.read_text())
    timer = threading.Timer(20, lambda: os.kill(os.getpid(), signal.SIGALRM))  # a hang fails, not blocks
    timer.start()
    try:
        _, line = cli(capsys, "config", "validate", str(config))
    finally:
        timer.cancel()
    assert words in line


# --------------------------------------------------------------------------- providers


@pytest.mark.parametrize(
    ("source", "provider", "words"),
    [
        ("def build():\n    raise ValueError('no weights here')\n", "mod:build", "ValueError: no weights here"),
        ("import sys\ndef build():\n    sys.exit(0)\n", "mod:build", "called sys.exit(0)"),
        ("raise ZeroDivisionError('at import')\n", "mod:build", "cannot import 'mod:build': ZeroDivisionError"),
        ("", ":mlp", "':mlp' is not an import path; expected 'package.module:function'"),
        ("", "mod:", "'mod:' is not an import path"),
    ],
)
@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_model_provider_that_raises_exits_or_cannot_be_named_is_one_error(
    on_path: Path, config: Path, capsys: Any, source: str, provider: str, words: str, command: str
) -> None:
    (on_path / "mod.py").write_text(source)
    argv = ["run"] if command == "run" else ["config", "validate"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, line = cli(
            capsys, *argv, str(config), "--set", f'model.provider="{provider}"', "--set", "model.options={}"
        )
        gc.collect()  # a lock file left open by the failed start would warn here
    assert words in line, line
    assert not (on_path / "out" / "checkpoints").exists()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


WHERE_IMPORTS_LOOK = "(looked for in the current directory and on PYTHONPATH: run from its folder, or add it there)"


def test_a_provider_module_not_found_says_where_imports_look(on_path: Path, config: Path, capsys: Any) -> None:
    """Run from another folder than the provider's module, whose name may even be a folder there
    (Python imports it as an empty namespace package): one line says where imports look; a
    module that is found but imports a missing library names that library alone."""
    (on_path / "models").mkdir()  # a folder, no models.py
    (on_path / "needs.py").write_text("import no_such_library\ndef build():\n    pass\n")
    for provider, words in (
        ("nowhere:build", "ModuleNotFoundError: No module named 'nowhere' " + WHERE_IMPORTS_LOOK),
        ("nowhere.sub:build", "ModuleNotFoundError: No module named 'nowhere' " + WHERE_IMPORTS_LOOK),
        ("models:build", "AttributeError: module 'models' has no attribute 'build' " + WHERE_IMPORTS_LOOK),
        ("needs:build", "ModuleNotFoundError: No module named 'no_such_library'"),
    ):
        _, line = cli(capsys, "config", "validate", str(config), "--set", f'model.provider="{provider}"')
        assert line.endswith(f"cannot import '{provider}': {words}"), line


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ("cross_entrpy", "'cross_entrpy' is neither an installed loss (cross_entropy, mse) nor an import path"),
        ("cross_entrpy", "did you mean 'cross_entropy'"),
        ("nosuchmodule:loss", "model.loss"),
    ],
)
def test_a_loss_that_is_not_installed_or_importable_is_one_error(
    config: Path, capsys: Any, loss: str, expected: str
) -> None:
    _, line = cli(capsys, "config", "validate", str(config), "--set", f'model.loss="{loss}"')
    assert expected in line


BAD_LOSS = """
import torch


class Output:  # what a Hugging Face model returns when the batch has no labels: loss None
    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class Net(torch.nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.layer, self.returns = torch.nn.Linear(4, 1), returns

    def forward(self, x, y=None):
        prediction = self.layer(x)
        if self.returns == "strings":
            return "a", "b"
        if y is None:  # model.loss is set: the loss function gets the outputs
            return prediction
        per_sample = (prediction - y) ** 2
        if self.returns == "dict":
            return {"loss": per_sample, "first": per_sample[0, 0].detach()}
        if self.returns == "two values":  # the loss and another value, unnamed
            return per_sample.mean(), per_sample.max()
        if self.returns == "tuple without a loss":  # nanoGPT's (logits, loss) with the loss None
            return prediction, None
        return Output(None, prediction) if self.returns == "no loss" else per_sample


def build(returns="tensor"):
    return Net(returns)


def unreduced(outputs, target):
    return (outputs - target) ** 2
"""


@pytest.mark.parametrize(
    ("returns", "overrides", "words"),
    [
        ("tensor", [], "the loss is a tensor of shape (8, 1), not one value; reduce it to one (e.g. loss.mean())"),
        ("tensor", ["train.micro_batch_size=4", "train.global_batch_size=8"], "a tensor of shape (4, 1)"),
        ("dict", [], "the loss is a tensor of shape (8, 1), not one value"),
        ("tensor", ['model.loss="mod:unreduced"'], "the loss is a tensor of shape (8, 1), not one value"),
        ("no loss", [], "the model returned a Output without a loss (a Hugging Face model computes one only when"),
        ("tensor", ['model.loss="cross_entropy"'], 'model.loss = "cross_entropy": the target is torch.float32 (class'),
        ("two values", [], "the model returned a tuple holding 2 single values, so which is the loss is unclear; "),
        ("tuple without a loss", [], "the model returned a tuple without a loss (a Hugging Face model computes"),
        ("strings", ['model.loss="mse"'], "model.loss: the model returned a tuple, which holds no logits; return a"),
    ],
)
def test_a_loss_that_is_not_one_value_or_a_float_class_target_is_one_error(
    on_path: Path, config: Path, capsys: Any, returns: str, overrides: list[str], words: str
) -> None:
    """The model (or ``model.loss``) hands back the loss; anything but one value is the user's to
    fix, said before torch's "grad can be implicitly created only for scalar outputs" or a
    TypeError on None — on the one-micro-batch fast path, under accumulation and through a loss."""
    (on_path / "mod.py").write_text(BAD_LOSS)
    sets = ['model.provider="mod:build"', f'model.options={{returns="{returns}"}}', *overrides]
    code, line = cli(capsys, "run", str(config), *(arg for value in sets for arg in ("--set", value)))
    assert code == 2 and words in line, line


DICT_ROWS = """
import torch


class Rows(torch.utils.data.Dataset):  # a dict per row, its target under a key of its own
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"features": torch.ones(8), "target": torch.zeros(1)}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, features):
        return self.layer(features)


def data(context):
    return {"train": Rows()}


def model(run):
    return Net()
"""


def test_a_dict_batch_without_a_target_key_names_the_keys_that_hold_one(
    on_path: Path, config: Path, capsys: Any
) -> None:
    """``model.loss`` over dict rows whose target is under ``target``: one line naming every key a
    target is found under and the batch's own; the FLOP count (timers), which meets the same
    batch first, leaves the saying to that line."""
    (on_path / "rows.py").write_text(DICT_ROWS)
    sets = ['model.provider="rows:model"', 'model.loss="mse"', 'data.provider="rows:data"', "plugins.timers={}"]
    code = main(["run", str(config), *(arg for value in sets for arg in ("--set", value))])
    err = capsys.readouterr().err
    assert code == 2 and "error: model.loss needs a target: a batch of (inputs..., target) or a dict with it as " in err
    assert "'labels', 'label' or 'label_ids' (this batch has ['features', 'target']: rename its target's key)" in err
    assert [line.startswith("error:") for line in err.splitlines()].count(True) == 1, err
    assert "could not count the model's FLOPs" not in err, err


def test_plugins_lists_only_the_plugins_named_and_a_misspelt_name_is_one_error(capsys: Any) -> None:
    assert main(["plugins", "ddp", "keep-best"]) == 0
    listing = capsys.readouterr().out
    shown = [line.split()[0] for line in listing.splitlines() if line and not line.startswith(" ")]
    assert shown == ["ddp", "keep-best"], listing  # in the order asked, without the list of commands
    assert "find_unused_parameters: bool = False" in listing and "metric: str = required" in listing
    _, line = cli(capsys, "plugins", "ddp", "dpp")
    assert line == "error: no plugin 'dpp' is installed (did you mean 'ddp'?); `coretrain plugins` lists all"


NUMPY_DATA = """
import numpy as np
import torch


class Rows(torch.utils.data.Dataset):  # numpy rows, as a pandas or numpy user hands them over: float64
    def __init__(self, count):
        self.x = np.random.default_rng(0).normal(size=(count, 4))
        self.y = self.x.sum(axis=1, keepdims=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class Converts(torch.nn.Module):  # a model that takes float64 and converts it itself
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x.float())


def data():
    return Rows(256), Rows(64)


def plain():
    return torch.nn.Linear(4, 1)


def converts():
    return Converts()
"""


@pytest.mark.parametrize("checks", [True, False])
def test_float64_batches_in_a_float32_model_are_one_error_saying_to_convert(
    on_path: Path, config: Path, capsys: Any, checks: bool
) -> None:
    """numpy's float64 rows into a float32 Linear: torch's "mat1 and mat2 must have the same
    dtype", explained by data-checks (on by default); a model that converts them trains."""
    (on_path / "npdata.py").write_text(NUMPY_DATA)
    sets = ['data.provider="npdata:data"', 'model.loss="mse"', f"plugins.data-checks.enabled={str(checks).lower()}"]
    argv = [arg for value in sets for arg in ("--set", value)]
    code, line = cli(capsys, "run", str(config), "--set", 'model.provider="npdata:plain"', *argv)
    explained = "the train and valid batches hold float64 tensors (numpy's default float type), and the model"
    assert code == 1 and (explained in line) == checks and "must have the same dtype" in line, line
    assert main(["run", str(config), "--set", 'model.provider="npdata:converts"', *argv]) == 0


UNEVEN_DATA = """
import torch


def sample(i):
    ids = torch.arange(3 + i % 5) % 50  # 3 to 7 tokens
    return {"input_ids": ids, "labels": ids}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        i = 0
        while True:
            yield sample(i)
            i += 1


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)

    def forward(self, input_ids, labels):
        return torch.nn.functional.cross_entropy(self.out(self.emb(input_ids)).flatten(0, 1), labels.flatten())


def stream():
    return Stream()


def samples():
    return [sample(i) for i in range(64)]


def model():
    return Bag()
"""


@pytest.mark.parametrize("kind", ["samples", "stream"])
def test_samples_of_different_lengths_are_one_error_saying_to_pad_them(
    on_path: Path, config: Path, capsys: Any, kind: str
) -> None:
    """torch's "stack expects each tensor to be equal size" from the default collate, with the
    fix: a list of samples when data-checks reads its first batch, a stream at its first step."""
    (on_path / "uneven.py").write_text(UNEVEN_DATA)
    sets = [f'data.provider="uneven:{kind}"', 'model.provider="uneven:model"', "train.eval_iters=0"]
    sets += ["plugins.data-checks.enabled=true", "plugins.streams.enabled=true"]  # both on by default
    code, line = cli(capsys, "run", str(config), *(arg for value in sets for arg in ("--set", value)))
    assert "the samples of a micro-batch hold tensors of different lengths, which the default collate" in line
    assert "stack expects each tensor to be equal size" in line and "pad them in data.collate_fn" in line, line
    assert code == (2 if kind == "samples" else 1)


EXTRA_KEY_DATA = """
import torch


class Rows(torch.utils.data.Dataset):  # each sample carries its id, as a dataset's record does
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((4,), float(i % 7))
        return {"x": x, "y": x.sum(0, keepdim=True), "id": i}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layer(x), y)


class WholeBatch(Net):
    def forward(self, batch):  # the dict as one argument, as some codebases write it
        return super().forward(batch["x"], batch["y"])


def data():
    return Rows()


def model():
    return Net()


def whole_batch():
    return WholeBatch()


class Outputs(Net):  # returns outputs for model.loss, but still takes the target
    def forward(self, x, y):
        return self.layer(x)


class Recorded(Net):  # its loss computed where autograd records nothing
    def forward(self, x, y):
        with torch.no_grad():
            return super().forward(x, y)


def outputs():
    return Outputs()


def recorded():
    return Recorded()


def pairs():  # (x, y) samples: with model.loss set, y is the target
    rows = Rows()
    return [(rows[i]["x"], rows[i]["y"]) for i in range(len(rows))]
"""


def test_a_batch_key_the_model_does_not_take_is_one_error_naming_it(on_path: Path, config: Path, capsys: Any) -> None:
    """A dict batch is model(**batch): a record's 'id' ends in "forward() got an unexpected keyword
    argument 'id'", which data-checks explains with the fix; so is a forward(self, batch)."""
    (on_path / "records.py").write_text(EXTRA_KEY_DATA)
    sets = ['data.provider="records:data"', 'model.provider="records:model"', "train.eval_iters=0"]
    sets += ["plugins.data-checks.enabled=true"]
    code, line = cli(capsys, "run", str(config), *(arg for value in sets for arg in ("--set", value)))
    assert code == 1 and line.startswith("error: the batches hold 'id', which Net.forward() does not take"), line
    assert "leave it out of the samples or in data.collate_fn, or give forward a **kwargs" in line
    sets[1] = 'model.provider="records:whole_batch"'  # forward(self, batch)
    code, line = cli(capsys, "run", str(config), *(arg for value in sets for arg in ("--set", value)))
    assert code == 1 and line.startswith("error: WholeBatch.forward() takes the batch as one argument"), line
    assert "hand the dict over in a tuple from data.collate_fn (return (batch,): model(*batch))" in line


def test_a_forward_that_wants_the_held_back_target_or_a_loss_without_gradient_is_one_error(
    on_path: Path, config: Path, capsys: Any
) -> None:
    """With model.loss set the batch's target is held back: a forward that still takes it ended in
    "forward() missing 1 required positional argument: 'y'"; a loss computed under no_grad in
    "element 0 of tensors does not require grad". data-checks says why and what to change."""
    (on_path / "records.py").write_text(EXTRA_KEY_DATA)
    sets = ['data.provider="records:pairs"', 'model.provider="records:outputs"', 'model.loss="mse"']
    sets += ["train.eval_iters=0", "plugins.data-checks.enabled=true"]
    code, line = cli(capsys, "run", str(config), *(arg for value in sets for arg in ("--set", value)))
    assert code == 1 and line.startswith("error: Outputs.forward() misses 'y': with model.loss = 'mse'"), line
    assert "drop the target from forward's arguments, or unset model.loss and return the loss" in line
    sets[1:3] = ['model.provider="records:recorded"']
    code, line = cli(capsys, "run", str(config), *(arg for value in sets for arg in ("--set", value)))
    assert code == 1 and line.startswith("error: the loss carries no gradient (element 0 of tensors"), line


# --------------------------------------------------------------------------- new-plugin


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("loss-spikes\n", "is not a plugin name"),
        ("a" * 300, "is not a plugin name; use at most 64"),
        ("gpt", "'gpt' is already the name of an installed plugin"),
    ],
)
def test_new_plugin_refuses_a_name_that_would_make_a_broken_or_shadowing_package(
    tmp_path: Path, capsys: Any, name: str, words: str
) -> None:
    code, line = cli(capsys, "new-plugin", name, "--dir", str(tmp_path / "pkg"))
    assert code == 2 and words in line
    assert not (tmp_path / "pkg").exists()


# --------------------------------------------------------------------------- the run's own files


def test_a_nul_byte_in_the_output_dir_is_a_config_error(config: Path, capsys: Any) -> None:
    code = main(["run", str(config), "--set", 'run.output_dir="runs/a\\u0000b"'])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: invalid config:") and "Traceback" not in err
    assert "run.output_dir: contains a NUL byte" in err


def test_checkpoints_being_a_file_is_refused_before_training(config: Path, tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").write_text("not a directory")
    code, line = cli(capsys, "run", str(config))
    assert code == 2 and f"'{tmp_path / 'out' / 'checkpoints'}' exists and is not a directory" in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_config_being_run_in_its_output_dir_is_never_written_over(
    tmp_path: Path, capsys: Any, no_autoload: None
) -> None:
    """run.output_dir = "." beside the user's config.toml: the run wrote its resolved config over
    the user's file (comments and all). Refused, the file untouched; the run's own recorded
    config, run again from its directory, resumes as before."""
    import tomli

    (tmp_path / "mine").mkdir()
    table = tiny_config(tmp_path / "mine", train={"train_iters": 2})
    mine = write_config(tmp_path / "mine" / "config.toml", table)
    text = mine.read_text() + "# my notes\n"
    mine.write_text(text)
    code, line = cli(capsys, "run", str(mine))
    assert code == 2 and f"run.output_dir: '{tmp_path / 'mine'}' holds a config.toml no run wrote (yours?)" in line
    assert mine.read_text() == text and not (tmp_path / "mine" / "checkpoints").exists()

    table = tiny_config(tmp_path / "out", train={"train_iters": 2})
    assert main(["run", str(write_config(tmp_path / "c.toml", table))]) == 0
    recorded = tmp_path / "out" / "config.toml"
    assert tomli.loads(recorded.read_text())["train"]["train_iters"] == 2
    assert main(["run", str(recorded), "--set", "train.train_iters=3"]) == 0
    assert tomli.loads(recorded.read_text())["train"]["train_iters"] == 3
    err = capsys.readouterr().err
    assert "resumed from" in err and "(step 2, 16 samples consumed)" in err


class SavesState:
    """A plugin whose checkpoint state cannot be saved: it contains itself, or nests too deeply."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    from coretrain import hookimpl

    @hookimpl
    def on_checkpoint(self) -> Any:
        state: Any = {}
        if self.kind == "itself":
            state["me"] = [state]
        else:
            for _ in range(10000):
                state = {"deeper": state}
        return state


@pytest.mark.parametrize(("kind", "words"), [("itself", "contains itself"), ("deep", "nested more than 64")])
def test_plugin_state_that_contains_itself_or_nests_deeply_names_the_plugin(
    tmp_path: Path, no_autoload: None, kind: str, words: str
) -> None:
    from coretrain.errors import PluginError
    from coretrain.testing import run_steps

    with pytest.raises(PluginError) as caught:
        run_steps(tmp_path, steps=2, plugins={"keeper": SavesState(kind)})
    message = str(caught.value)
    assert message.startswith("plugin 'keeper' failed in on_checkpoint at step 2: TypeError: returned state") and (
        words in message
    ), message


BAD_DATA = """
import torch
from coretrain.testing import tiny_data


class Failing(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        if 20 <= index < 40:  # the first and last samples read fine (the start-up check reads those)
            raise ValueError(f"sample {index} is corrupt on disk")
        return torch.zeros(4), torch.zeros(1)


def failing(context):
    return Failing()


def with_nan(context):
    datasets = tiny_data(context)
    datasets.train.tensors[0][37] = float("nan")  # one bad record in the input
    return datasets
"""


def test_a_data_worker_s_own_error_message_is_the_one_line(on_path: Path, config: Path, capsys: Any) -> None:
    (on_path / "baddata.py").write_text(BAD_DATA)
    code, line = cli(
        capsys, "run", str(config), "--set", 'data.provider="baddata:failing"', "--set", "data.num_workers=1"
    )
    assert code == 1 and "ValueError: sample" in line and "is corrupt on disk" in line, line
    assert "(in DataLoader worker process 0)" in line


def test_nan_in_the_input_stops_the_run_with_one_error_naming_the_step(
    on_path: Path, config: Path, capsys: Any
) -> None:
    (on_path / "baddata.py").write_text(BAD_DATA)
    code, line = cli(
        capsys, "run", str(config), "--set", 'data.provider="baddata:with_nan"', "--set", "train.train_iters=40"
    )
    assert code == 1 and "the loss is not finite at step" in line and "(loss nan)" in line, line
    step = int(line.split("at step ")[1].split()[0])
    metrics_file = on_path / "out" / "metrics.jsonl"
    rows = [json.loads(r) for r in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)  # no NaN row was logged
    assert step < 40 and not (on_path / "out" / "checkpoints").exists()


def test_with_the_guards_plugin_a_nan_step_is_skipped_and_the_run_completes(
    on_path: Path, config: Path, capsys: Any
) -> None:
    (on_path / "baddata.py").write_text(BAD_DATA)
    code = main(
        ["run", str(config), "--set", 'data.provider="baddata:with_nan"', "--set", "train.train_iters=40"]
        + ["--set", 'plugins.guards.action="skip"']
    )
    assert code == 0, capsys.readouterr().err


def test_a_checkpoint_due_after_a_nan_step_is_not_written(on_path: Path, config: Path, capsys: Any) -> None:
    (on_path / "baddata.py").write_text(BAD_DATA)
    nan = ("--set", 'data.provider="baddata:with_nan"', "--set", "train.train_iters=40")
    every_step = ("--set", "checkpoint.save_interval=1", "--set", "train.log_interval=40")
    code, line = cli(capsys, "run", str(config), *nan, *every_step)
    step = int(line.split("at step ")[1].split()[0])
    saved = sorted(int(p.name[5:]) for p in (on_path / "out" / "checkpoints").glob("step_????????"))
    assert code == 1 and saved == list(range(1, step)), (line, saved)  # every step before the NaN, none after


# --------------------------------------------------------------------------- resume


def test_a_damaged_only_checkpoint_and_a_refused_change_are_one_error_each(
    config: Path, tmp_path: Path, capsys: Any
) -> None:
    import torch

    assert main(["run", str(config)]) == 0
    capsys.readouterr()
    step = tmp_path / "out" / "checkpoints" / "step_00000002"
    longer = ("--set", "train.train_iters=4")
    recorded = (tmp_path / "out" / "config.toml").read_text()
    checks = ("--set", "plugins.resume-checks.allow_changes=[]")  # on by default; autoload is off here
    code, line = cli(capsys, "run", str(config), *longer, *checks, "--set", "run.seed=8")
    assert code == 2 and f"resuming from {step} would change what it means: run.seed 7 -> 8" in line, line
    assert (tmp_path / "out" / "config.toml").read_text() == recorded  # still the checkpoints' config

    state = torch.load(step / "rank_00000.pt", weights_only=True)
    state["rng"]["torch"] = state["rng"]["torch"][:100]  # a short RNG state, as a bad copy leaves it
    torch.save(state, step / "rank_00000.pt")
    code, line = cli(capsys, "run", str(config), *longer)
    assert code == 2 and f"{step / 'rank_00000.pt'}: not a valid checkpoint file: rng.torch: expected" in line, line


def test_new_plugin_into_a_directory_that_has_files_makes_its_own_folder_there(tmp_path: Path, capsys: Any) -> None:
    """--dir plugins/ (a folder of other packages): the package goes to plugins/coretrain-NAME,
    not among them; a new or empty --dir is the package's own directory."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "other.txt").write_text("x")
    assert main(["new-plugin", "loss-spikes", "--dir", str(tmp_path / "plugins")]) == 0
    assert (tmp_path / "plugins" / "coretrain-loss-spikes" / "pyproject.toml").is_file()
    assert main(["new-plugin", "loss-spikes", "--dir", str(tmp_path / "fresh")]) == 0
    assert (tmp_path / "fresh" / "pyproject.toml").is_file()
    assert f"wrote {tmp_path / 'fresh'}" in capsys.readouterr().out


# --------------------------------------------------------------------------- values out of bounds


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["EPOCHS", "1e12"], "train.train_epochs: must be <="),
        (["--set", "checkpoint.storage_writers_per_rank=50000"], "checkpoint.storage_writers_per_rank: must be"),
        (["--nproc-per-node", "-2"], "argument --nproc-per-node: expected a whole number >= 1, got '-2'"),
        (["--nproc-per-node", "0"], "argument --nproc-per-node: expected a whole number >= 1, got '0'"),
        (["--max-restarts", "-1"], "argument --max-restarts: expected a whole number >= 0, got '-1'"),
        (["--replace-failed-ranks"], "--replace-failed-ranks: only when coretrain starts the ranks"),
        (["--max-restarts", "2"], "--max-restarts: only when coretrain starts the ranks"),
        # layout errors of a job: said once by the launcher, before any rank starts
        (["--nproc-per-node", "2", "--set", "distributed.pp_size=2"], "the 1F1B schedule needs at least as many"),
        (
            ["--nproc-per-node", "2", "--set", "distributed.ep_size=2", "--set", 'distributed.strategy="ddp"'],
            'expert parallelism runs on FSDP2, not strategy = "ddp"',
        ),
        (["--nproc-per-node", "4", "--set", "distributed.ep_size=3"], "ep_size (3) must divide the ranks of one"),
        (
            ["--nproc-per-node", "2", "--set", 'model.provider="gpt"', "--set", "model.options.n_layer=3"]
            + ["--set", "distributed.pp_size=2", "--set", "train.global_batch_size=32"],
            "distributed.pp_size (2) must divide the model's 3 blocks",
        ),
        (
            ["--nproc-per-node", "2", "--set", "distributed.cp_size=2", "--set", "data.options.seq_length=30"],
            "distributed.cp_size (2) must cut the sequence length (30) into 2 × cp_size equal chunks",
        ),
        (["--set", 'plugins.fault-injection.action="raise"'], "plugins.fault-injection.step: set step"),
        (["--set", 'plugins.fault-injection={action="raise", step=-1}'], "plugins.fault-injection.step: must be > 0"),
        (["--set", 'plugins.fault-injection={action="raise", step=1, ranks=[5]}'], "ranks: [5] are not ranks of"),
        (["--set", 'plugins.fault-injection={action="raise", step=9}'], "step: 9 is past the run's last step (2)"),
        (["--set", 'plugins.fault-injection={action="raise", probability=2.0}'], "probability: must be"),
        (
            ["--set", 'plugins.fault-injection={action="sleep", step=1, sleep_seconds=-1.0}'],
            "sleep_seconds: must be >= 0",
        ),
        # Megatron's DDP knobs where the strategy has no such setting
        (
            ["--set", "plugins.fsdp.bucket_size=40000000"],
            'the unit is block_types; it cannot be 40000000 here (strategy = "ddp"',
        ),
        (["--set", "plugins.fsdp.overlap_grad_reduce=false"], "FSDP2 always reduce-scatters a block's gradients while"),
        (["--set", "plugins.fsdp.use_distributed_optimizer=false"], "FSDP2 always shards the optimizer state"),
        (
            ["--set", "plugins.ddp.overlap_param_gather=true"],
            "ZeroRedundancyOptimizer broadcasts the updated parameters",
        ),
        (["--set", 'plugins.rerun.mode="validate"'], "plugins.rerun.mode"),
        (["--set", "plugins.timers.timing_log_level=3"], "plugins.timers.timing_log_level"),
    ],
)
def test_a_value_out_of_bounds_is_one_error_line(config: Path, capsys: Any, argv: list[str], words: str) -> None:
    """The message (its one error line, and the config's problems listed below it) names the key or flag."""
    if argv[0] == "EPOCHS":  # a run counted in epochs (no train_iters)
        config = write_config(config, tiny_config(config.parent / "out", train={"train_epochs": float(argv[1])}))
        argv = []
    try:
        code = main(["run", str(config), *argv])
    except SystemExit as exit:  # argparse's own exit, as the console script ends on it
        code = int(exit.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert words in err, err
