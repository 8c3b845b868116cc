"""Fill-in-the-middle in ``indexed`` (Megatron-LM's GPTFIMDataset): pieces cut at the end of each
document, rearranged as PSM or SPM around the sentinel tokens, the sample's length kept; each
sample's draws its own, so a resumed run and DataLoader workers see the same samples.
``benchmarks/megatron_fim_parity.py`` compares the transformation with Megatron-LM's own class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CORPUS

from coretrain import UserError
from coretrain.testing import run_steps, stop_and_resume

transformers = pytest.importorskip("transformers")

SENTINELS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]


def save_bpe(directory: Path, bos: bool = False) -> Any:
    """A BPE with EOS and the FIM sentinels as special tokens, saved as a user's is; with ``bos``
    one that starts every text with <s> (as Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>", *SENTINELS]
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=special))
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=SENTINELS,
    )  # fmt: skip
    fast.save_pretrained(directory)
    return fast


def write_code(path: Path, documents: int) -> Path:
    """Documents of three lines of code each, as jsonl."""
    path.write_text(
        "".join(json.dumps({"text": "\n".join(CORPUS[i : i + 3])}) + "\n" for i in range(0, 3 * documents, 3))
    )
    return path


@pytest.fixture(scope="module")
def fim_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A BPE with the FIM sentinels, and code prepared with it (EOD after each)."""
    from coretrain_data_prepare.prepare import Request, prepare

    root = tmp_path_factory.mktemp("fim")
    save_bpe(root / "tokenizer")
    source = write_code(root / "code.jsonl", 80)
    prepare(Request(inputs=[str(source)], tokenizer=str(root / "tokenizer"), output_prefix=str(root / "code"),
                    json_keys=["text"], append_eod=True))  # fmt: skip
    return root / "tokenizer", root / "code_text_document"


def sections(fim_data: tuple[Path, Path], tmp_path: Path, **fim: Any) -> dict[str, Any]:
    tokenizer, prefix = fim_data
    options = {"data_path": str(prefix), "split": "90,10,0", "seq_length": 32, "cache_dir": str(tmp_path / "cache")}
    return {
        "model": {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "data": {"provider": "indexed", "options": {**options, **fim}},
        "tokenizer": {"path": str(tokenizer)},
        "train": {"micro_batch_size": 4, "log_interval": 1, "eval_iters": 1, "eval_interval": 3},
    }


def test_each_piece_is_rearranged_around_the_sentinels_and_keeps_its_text(
    fim_data: tuple[Path, Path], tmp_path: Path
) -> None:
    """With fim_rate = 1 and fim_spm_rate = 0 every piece is PSM: <pre> prefix <suf> suffix <mid>
    middle, whose prefix + middle + suffix is the piece's text; with fim_spm_rate = 1, SPM:
    <pre> <suf> suffix <mid> prefix middle. A sample keeps its length (cut, or padded at the end)."""
    config = sections(fim_data, tmp_path, fim_rate=1.0, fim_spm_rate=0.0)
    windows = run_steps(tmp_path / "psm", 1, config=config).run.datasets.train
    fim = windows.fim
    pre, mid, suf, pad = fim.tokenizer.convert_tokens_to_ids(SENTINELS)
    for k in range(20):
        base, sample = windows.base.window(k), windows.window(k)
        assert len(sample) == len(base) == 33 and sample[0] == pre
        assert pad not in sample or set(sample[list(sample).index(pad) :].tolist()) == {pad}  # only at the end
        piece = base[: np.flatnonzero(base == fim.tokens.eod)[0]] if fim.tokens.eod in base else base
        psm = fim.permute(piece, 1.0, np.random.RandomState(k))  # spm_rate 0: PSM
        assert psm[0] == pre and list(psm).count(suf) == 1 and list(psm).count(mid) == 1
        cut_suffix, cut_middle = int(np.flatnonzero(psm == suf)[0]), int(np.flatnonzero(psm == mid)[0])
        prefix, suffix, middle = psm[1:cut_suffix], psm[cut_suffix + 1 : cut_middle], psm[cut_middle + 1 :]
        assert "".join(fim.decode(part) for part in (prefix, middle, suffix)) == fim.decode(piece)
    spm_fim = type(fim)(1.0, 1.0, fim.tokenizer, fim.tokens, special=fim.special)
    spm = spm_fim.permute(piece, 1.0, np.random.RandomState(0))
    assert list(spm[:2]) == [pre, suf] and list(spm).count(mid) == 1


def test_a_samples_form_is_its_own_whatever_was_read_before_it_and_a_run_resumes_exactly(
    fim_data: tuple[Path, Path], tmp_path: Path
) -> None:
    from coretrain_indexed.fim import FIMWindows

    config = sections(fim_data, tmp_path, fim_rate=0.5, fim_spm_rate=0.5)
    first = run_steps(tmp_path / "a", 1, config=config).run.datasets.train
    assert isinstance(first, FIMWindows)
    forward = [first.window(k).tolist() for k in range(30)]
    backward = [first.window(k).tolist() for k in reversed(range(30))][::-1]
    assert forward == backward  # (Megatron draws from one generator in reading order: workers would differ)
    assert sum(first.window(k).tolist() != first.base.window(k).tolist() for k in range(30)) > 5
    workers = {**config, "data": {**config["data"], "num_workers": 2}}
    whole = run_steps(tmp_path / "whole", 8, config=workers)
    stopped, resumed = stop_and_resume(tmp_path / "split", stop_at=4, steps=8, config=config)
    assert [m["loss"] for m in stopped.metrics + resumed.metrics] == [m["loss"] for m in whole.metrics]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer": None}, r"data\.options\.fim_rate: no tokenizer: set \[tokenizer\] path"),
        ({"fim_middle_token": "<mid>"}, r"data\.options\.fim_middle_token: '<mid>' is not a token of the tokenizer"),
        ({"fim_split_sample": "</s>"}, r"data\.options\.fim_fragment_rate: fim_split_sample splits pieces"),
        ({"fim_rate": 1.5}, r"data\.options\.fim_rate: must be >= 0 and <= 1"),
    ],
)
def test_fim_mistakes_are_one_error(
    fim_data: tuple[Path, Path], tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    config = sections(fim_data, tmp_path, fim_rate=0.5)
    if change.pop("tokenizer", True) is None:
        del config["tokenizer"]
    config["data"]["options"].update(change)
    with pytest.raises(UserError, match=message):
        run_steps(tmp_path / "run", 1, config=config)


@pytest.mark.parametrize(
    ("fim", "message"),
    [
        (
            {"fim_middle_token": "<fim_prefix>"},
            r"fim_middle_token: the same token as fim_prefix_token \('<fim_prefix>'\)",
        ),
        ({"fim_pad_token": "def"}, r"fim_pad_token: 'def' is an ordinary token of the tokenizer, not a special one"),
        ({"fim_eod_token": "<fim_pad>"}, "fim_eod_token: the end-of-document token .* is also a FIM sentinel"),
    ],
)
def test_sentinels_that_are_not_distinct_special_tokens_are_one_error(
    fim_data: tuple[Path, Path], tmp_path: Path, fim: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError, match=f"data.options.{message}"):
        run_steps(tmp_path, steps=1, config=sections(fim_data, tmp_path, fim_rate=0.5, **fim))


@pytest.mark.parametrize("include", [True, False])
def test_a_tokenizer_that_adds_a_bos_keeps_it_as_megatron_does_unless_told_not_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], include: bool
) -> None:
    """Megatron's HuggingFaceTokenizer by default encodes with the tokenizer's own special tokens
    (``tokenizer(text)``) and decodes keeping them: with a tokenizer that starts every text with
    <s>, ``data prepare`` starts each document with it and FIM encodes each of prefix, middle and
    suffix with one. ``include_special_tokens = false`` (Megatron's
    ``--tokenizer-hf-no-include-special-tokens``), read by ``data prepare --config`` and by the
    run from the one file: no <s> anywhere."""
    import tomli_w

    from coretrain.cli import main

    fast = save_bpe(tmp_path / "tokenizer", bos=True)
    source = write_code(tmp_path / "code.jsonl", 30)
    config = sections((tmp_path / "tokenizer", tmp_path / "code_text_document"), tmp_path, fim_rate=1.0)
    config["data"]["options"] |= {"fim_spm_rate": 0.0, "include_special_tokens": include}
    (tmp_path / "run.toml").write_text(tomli_w.dumps(config))
    args = [str(source), "--config", str(tmp_path / "run.toml"), "--output-prefix", str(tmp_path / "code")]
    assert main(["data", "prepare", *args, "--append-eod"]) == 0, capsys.readouterr().err
    flag = ["--tokenizer-hf-no-include-special-tokens"] if not include else []
    by_flag = [str(source), "--tokenizer", str(tmp_path / "tokenizer"), "--output-prefix", str(tmp_path / "flag")]
    assert main(["data", "prepare", *by_flag, "--append-eod", *flag]) == 0  # the same without --config
    bins = [(tmp_path / f"{name}_text_document.bin").read_bytes() for name in ("code", "flag")]
    assert bins[0] == bins[1]
    windows = run_steps(tmp_path / "out", 1, config=config).run.datasets.train
    fim, bos = windows.fim, fast.bos_token_id
    pre, mid, suf, _ = fast.convert_tokens_to_ids(SENTINELS)
    documents = np.split(windows.base.source.tokens, np.cumsum(windows.base.source.document_lengths)[:-1])
    assert all((d[0] == bos) == include for d in documents) and len(documents) == 30
    piece = documents[0][:-1]  # a document without its EOD
    psm = fim.permute(piece, 1.0, np.random.RandomState(3))
    starts = [1, int(np.flatnonzero(psm == suf)[0]) + 1, int(np.flatnonzero(psm == mid)[0]) + 1]
    assert [start < len(psm) and psm[start] == bos for start in starts] == [include] * 3  # each part's first token
    assert list(psm).count(bos) == (3 if include else 0)  # the document's own <s> is not part of the text
    assert (bos in psm) == include and psm[0] == pre
