"""`coretrain data prepare`: jsonl, parquet and text through a local tokenizer into .bin/.idx,
read back by a reader written here from the format's spec and by the `indexed` provider."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CORPUS, PROSE, run_cli

from coretrain.cli import main
from coretrain.testing import run_steps

SPEC_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def read_by_spec(prefix: Path) -> tuple[str, list[list[int]]]:
    """The documents of a pair, read as Megatron-Core's MMapIndexedDataset documents it."""
    index = (prefix.parent / f"{prefix.name}.idx").read_bytes()
    assert index[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents = struct.unpack("<QBQQ", index[9:34])
    assert version == 1
    lengths = np.frombuffer(index, "<i4", sequences, 34)
    pointers = np.frombuffer(index, "<i8", sequences, 34 + 4 * sequences)
    doc_index = np.frombuffer(index, "<i8", documents, 34 + 12 * sequences)
    assert doc_index[0] == 0 and doc_index[-1] == sequences
    data = (prefix.parent / f"{prefix.name}.bin").read_bytes()
    dtype = np.dtype(SPEC_DTYPES[code])
    tokens = [np.frombuffer(data, dtype, int(n), int(p)).tolist() for n, p in zip(lengths, pointers)]
    return SPEC_DTYPES[code], [sum(tokens[a:b], []) for a, b in zip(doc_index[:-1], doc_index[1:])]


def prepare(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["data", "prepare", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    lines = [json.dumps({"text": text, "id": i}) for i, text in enumerate(CORPUS[:60])]
    (tmp_path / "code.jsonl").write_text("\n".join(lines[:30]) + "\n\n" + "\n".join(lines[30:]) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": PROSE[:40]}), tmp_path / "prose.parquet")
    (tmp_path / "notes.txt").write_text("\n".join(PROSE[40:50]) + "\n\n")
    return {"jsonl": tmp_path / "code.jsonl", "parquet": tmp_path / "prose.parquet", "text": tmp_path / "notes.txt"}


def test_jsonl_parquet_and_text_become_one_pair_that_the_spec_reads_back(
    tmp_path: Path, tokenizer_dir: Path, inputs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    prefix = tmp_path / "out" / "mixed"
    files = [str(inputs[kind]) for kind in ("jsonl", "parquet", "text")]
    code, out, _ = prepare(
        *files, "--tokenizer", str(tokenizer_dir), "--output-prefix", str(prefix), "--append-eod", capsys=capsys
    )
    assert code == 0
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = CORPUS[:60] + PROSE[:40] + PROSE[40:50]  # the blank jsonl line and text lines are not documents
    expected = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in texts]
    dtype, documents = read_by_spec(tmp_path / "out" / "mixed_text_document")
    assert dtype == "<u2" and documents == expected  # 300 ids: Megatron's uint16
    tokens = sum(map(len, expected))
    assert f"wrote {prefix}_text_document.bin/.idx: 110 documents, {tokens:,} tokens (uint16)" in out
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_the_indexed_provider_trains_on_what_prepare_wrote(
    tmp_path: Path, tokenizer_dir: Path, inputs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = tmp_path / "data" / "code"
    code, _, _ = prepare(
        str(inputs["jsonl"]),
        "--tokenizer",
        str(tokenizer_dir),
        "--output-prefix",
        str(prefix),
        "--append-eod",
        capsys=capsys,
    )
    assert code == 0
    gpt = {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 304}}
    data = {
        "provider": "indexed",
        "options": {"data_path": f"{prefix}_text_document", "split": "90,10,0", "seq_length": 16},
    }
    result = run_steps(tmp_path / "run", 6, config={"model": gpt, "data": data, "train": {"micro_batch_size": 4}})
    assert result.exit_code == 0 and len(result.run.datasets.train) > 0
    losses = [row["loss"] for row in result.metrics if "loss" in row]
    assert losses and all(np.isfinite(losses))


def test_one_tokenizer_section_prepares_the_data_sizes_it_and_pads_the_models_vocabulary(
    tmp_path: Path, tokenizer_dir: Path, inputs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's [tokenizer]: `data prepare --config` writes with it what `--tokenizer` writes,
    `indexed` takes its vocabulary from it, and the gpt pads that as Megatron does."""
    from transformers import AutoTokenizer

    run_config = tmp_path / "run.toml"
    run_config.write_text(f'[model]\nprovider = "gpt"\n\n[tokenizer]\npath = "{tokenizer_dir}"\n')
    by_flag, by_config = tmp_path / "flag" / "code", tmp_path / "config" / "code"
    assert (
        prepare(
            str(inputs["jsonl"]), "--tokenizer", str(tokenizer_dir), "--output-prefix", str(by_flag), capsys=capsys
        )[0]
        == 0
    )
    assert (
        prepare(str(inputs["jsonl"]), "--config", str(run_config), "--output-prefix", str(by_config), capsys=capsys)[0]
        == 0
    )
    for suffix in (".bin", ".idx"):
        assert (
            Path(f"{by_config}_text_document{suffix}").read_bytes()
            == Path(f"{by_flag}_text_document{suffix}").read_bytes()
        )
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    gpt = {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16, "make_vocab_size_divisible_by": 64}}
    data = {
        "provider": "indexed",
        "options": {"data_path": f"{by_config}_text_document", "split": "90,10,0", "seq_length": 16},
    }
    sections = {"model": gpt, "data": data, "tokenizer": {"path": str(tokenizer_dir)}, "train": {"micro_batch_size": 4}}
    result = run_steps(tmp_path / "run", 2, config=sections)
    assert result.run.datasets.vocab_size == vocab and vocab % 64  # the tokenizer's, not the largest id + 1
    assert result.run.model.lm_head.weight.shape[0] == -(-vocab // 64) * 64
    code, _, err = prepare(
        str(inputs["jsonl"]), "--config", str(tmp_path / "x.toml"), "--output-prefix", "p", capsys=capsys
    )
    assert code == 2 and "x.toml: config file not found" in err
    run_config.write_text('[model]\nprovider = "gpt"\n')
    code, _, err = prepare(str(inputs["jsonl"]), "--config", str(run_config), "--output-prefix", "p", capsys=capsys)
    assert code == 2 and "run.toml: no [tokenizer] path" in err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"text": "a"}\n{"text": "b"\n', "code.jsonl:2: not a JSON line"),
        (
            '{"text": "a"}\n{"body": "b"}\n',
            "code.jsonl:2: no field 'text' (fields: ['body']); choose them with --json-keys",
        ),
        ('{"text": 3}\n', "code.jsonl:1: field 'text' is int, expected a string"),
        ('["text"]\n', "code.jsonl:1: expected a JSON object with ['text'], got list"),
        ("\n\n", "no document with any text to tokenize"),
    ],
)
def test_bad_input_is_one_error_and_the_previous_output_stays(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], content: str, fragment: str
) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "def f(x): return x"}\n')
    prefix = str(tmp_path / "out")
    assert prepare(str(good), "--tokenizer", str(tokenizer_dir), "--output-prefix", prefix, capsys=capsys)[0] == 0
    before = (tmp_path / "out_text_document.bin").read_bytes()
    bad = tmp_path / "code.jsonl"
    bad.write_text(content)
    code, _, err = prepare(str(bad), "--tokenizer", str(tokenizer_dir), "--output-prefix", prefix, capsys=capsys)
    assert code == 2 and fragment in err and "Traceback" not in err and err.count("error:") == 1, err
    assert (tmp_path / "out_text_document.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out_text_document.bin", "out_text_document.idx"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--tokenizer", "nowhere"], "--tokenizer nowhere: not a directory"),
        (["--tokenizer", "{tok}", "--workers", "0"], "--workers 0: expected 1 or more"),
        (["--tokenizer", "{tok}", "missing.jsonl"], "missing.jsonl: no such input file"),
    ],
)
def test_bad_options_are_one_error(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    args = [a.replace("{tok}", str(tokenizer_dir)) for a in args]
    files = [a for a in args if a.endswith(".jsonl")] or [str(tmp_path / "a.jsonl")]
    options = [a for a in args if not a.endswith(".jsonl")]
    code, _, err = prepare(*files, *options, "--output-prefix", str(tmp_path / "o"), capsys=capsys)
    assert code == 2 and fragment in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "code.jsonl:1: JSON nested too deeply to read"),
        ('{"text": "a\\ud800b"}', "code.jsonl:1: field 'text' is not Unicode text (a lone surrogate '\\ud800'"),
    ],
)
def test_json_that_python_reads_but_no_tokenizer_should_is_one_error(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], line: str, fragment: str
) -> None:
    (tmp_path / "code.jsonl").write_text(line + "\n")
    code, _, err = prepare(
        str(tmp_path / "code.jsonl"),
        "--tokenizer",
        str(tokenizer_dir),
        "--output-prefix",
        str(tmp_path / "o"),
        capsys=capsys,
    )
    assert code == 2 and fragment in err and err.count("\n") == 1, err


def big_id_tokenizer(directory: Path) -> Path:
    """A tokenizer of 3 tokens whose ids are 0, 1 and 70000: uint16 by its size, but 70000 does not fit."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "big": 70000}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)
    return directory


def test_bad_output_prefixes_keys_and_tokenizers_are_one_error_each(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a big a", "x": "a"}\n')
    (tmp_path / "file").write_text("")
    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(tokenizer_dir, broken)
    (broken / "tokenizer_config.json").write_text("{not json")
    tok = str(tokenizer_dir)
    cases = [
        (["--tokenizer", tok, "--output-prefix", str(tmp_path / "file" / "o")], "a folder on its path is a file"),
        (["--tokenizer", tok, "--output-prefix", str(tmp_path) + "/"], "a directory; the prefix starts the file names"),
        (
            ["--tokenizer", tok, "--output-prefix", "/proc/coretrain/o"],
            "--output-prefix /proc/coretrain/o: cannot write there",
        ),
        (
            ["--tokenizer", tok, "--output-prefix", "o", "--json-keys", "../x"],
            "--json-keys '../x': a key names output files",
        ),
        (["--tokenizer", str(broken), "--output-prefix", "o"], f"--tokenizer {broken}: not a Hugging Face tokenizer"),
        (
            ["--tokenizer", str(big_id_tokenizer(tmp_path / "big")), "--output-prefix", str(tmp_path / "o")],
            "token id 70000 does not fit uint16 (0..65535)",
        ),
    ]
    for args, fragment in cases:
        code, _, err = prepare(str(source), *args, capsys=capsys)
        assert code == 2 and fragment in err and err.count("\n") == 1, (args, err)
    assert not (tmp_path / "x_document.bin").exists() and not list(tmp_path.glob(".o_*"))  # nothing left behind


class Killed(BaseException):
    """Where the test stops the writer, as SIGKILL would: nothing after it runs, no clean-up."""


class KilledAfter:
    """File-system calls that let ``allowed`` of them through, then kill the writer."""

    def __init__(self, allowed: int) -> None:
        self.allowed, self.made = allowed, 0

    def __call__(self, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.made == self.allowed:
                raise Killed
            self.made += 1
            return original(*args, **kwargs)

        return call


def test_a_writer_killed_at_any_step_of_its_commit_leaves_the_previous_pair_or_the_new_one(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file-system change of the commit, in turn, is the last one a writer makes: the names
    PREFIX.bin/.idx then read as the previous pair or the new one — never a new .bin beside an
    old .idx (renamed separately, they were). The previous pair is plain files, as Megatron writes."""
    from coretrain_data_prepare import pairs
    from coretrain_data_prepare import prepare as module
    from coretrain_indexed.format import IndexedTokens, write_indexed

    prefix = tmp_path / "corpus_text_document"
    old_documents = [[5, 6, 7]] * 50
    source = tmp_path / "new.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[:20]))
    args = (str(source), "--tokenizer", str(tokenizer_dir), "--output-prefix", str(tmp_path / "corpus"))

    def documents() -> list[list[int]]:
        tokens = IndexedTokens(str(prefix))
        return [tokens.document(d).tolist() for d in range(len(tokens))]

    def plain_previous_pair() -> None:
        for path in [*tmp_path.glob(".corpus_text_document*"), *tmp_path.glob("corpus_text_document.*")]:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        write_indexed(str(prefix), old_documents)

    assert prepare(*args, capsys=capsys)[0] == 0
    new_documents = documents()
    allowed, outcomes, finished = 0, set(), False
    while not finished:
        plain_previous_pair()
        kill = KilledAfter(allowed)
        with monkeypatch.context() as patch:
            for name in ("replace", "symlink", "link"):
                patch.setattr(pairs.os, name, kill(getattr(os, name)))
            patch.setattr(module.PairWriter, "discard", lambda self: None)  # a killed writer cleans nothing up
            try:
                finished = prepare(*args, capsys=capsys)[0] == 0
            except Killed:
                pass
        seen = documents()
        assert seen in (old_documents, new_documents), allowed
        outcomes.add("new" if seen == new_documents else "old")
        allowed += 1
    assert allowed >= 5 and outcomes == {"old", "new"}
    assert prepare(*args, capsys=capsys)[0] == 0 and documents() == new_documents  # leftovers do not stand in the way
    versions = [p for p in tmp_path.glob(".corpus_text_document.*") if p.is_dir() and not p.is_symlink()]
    assert len(versions) == 1  # the committed one; earlier ones and a killed writer's are gone


@pytest.mark.slow
def test_the_command_with_worker_processes_writes_the_same_pair_as_one_process(
    tmp_path: Path, tokenizer_dir: Path, inputs: dict[str, Path]
) -> None:
    """A real `coretrain data prepare` with 2 workers: same bytes as in one process, the
    progress lines without a terminal, two keys of one jsonl as two pairs."""
    both = tmp_path / "both.jsonl"
    both.write_text("".join(json.dumps({"text": c, "doc": p}) + "\n" for c, p in zip(CORPUS[:40], PROSE[:40])))
    results: dict[str, Any] = {}
    for workers in ("1", "2"):
        prefix = str(tmp_path / f"w{workers}")
        result = run_cli(
            "data",
            "prepare",
            str(both),
            "--tokenizer",
            str(tokenizer_dir),
            "--output-prefix",
            prefix,
            "--json-keys",
            "text",
            "doc",
            "--append-eod",
            "--workers",
            workers,
            "--log-interval",
            "10",
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
        assert "processed 40 documents" in result.stderr
        results[workers] = [(tmp_path / f"w{workers}_{key}_document.bin").read_bytes() for key in ("text", "doc")]
    assert results["1"] == results["2"]
    _, docs = read_by_spec(tmp_path / "w2_doc_document")
    assert len(docs) == 40 and all(doc[-1] == 2 for doc in docs)  # "</s>" is id 2
