"""``[plugins.tokenizer] tokenizer_type``: Megatron's tokenizer types built as transformers tokenizers, and
the run's tokenizer handed to every data provider, a user's own too, on ``DatasetContext``.
Megatron itself gives the same ids on held-out texts (benchmarks/megatron_tokenizer_parity.py:
205 of 205 for each type); here the vocabularies are trained on the spot, as a user's would be."""

from __future__ import annotations

import base64
import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, load_script, run_here

from coretrain.testing import tiny_config, write_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])

PROVIDER = """
import json
from coretrain.testing import tiny_data

def provide(context, out, text):
    tokenizer = context.tokenizer
    said = {"ids": tokenizer(text)["input_ids"], "eos": tokenizer.eos_token_id, "size": len(tokenizer)}
    open(out, "w").write(json.dumps(said))
    return tiny_data(context)
"""


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The parity benchmark's vocabularies (SentencePiece, GPT-2 byte-level BPE, tiktoken in
    Megatron's JSON, trained on a few standard-library files), the GPT-2 one also saved as a
    Hugging Face directory."""
    pytest.importorskip("sentencepiece")
    import tokenizers
    import transformers

    parity = load_script(REPO / "benchmarks" / "megatron_tokenizer_parity.py")
    root = tmp_path_factory.mktemp("vocabularies")
    parity.train_vocabularies(root)
    bpe = tokenizers.ByteLevelBPETokenizer(str(root / "gpt2-vocab.json"), str(root / "gpt2-merges.txt"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(
        root / "hf"
    )
    return root


def tables(tokenizer: dict[str, Any]) -> dict[str, Any]:
    """``[tokenizer]`` (the path, shared by every plugin) and the ``tokenizer`` plugin's table
    (Megatron's type and its other files)."""
    shared = {key: value for key, value in tokenizer.items() if key in ("path", "trust_remote_code")}
    types = {key: value for key, value in tokenizer.items() if key not in shared}
    return {"tokenizer": shared, "plugins": {"tokenizer": types}}


def run_with(tmp_path: Path, tokenizer: dict[str, Any], text: str = "def main(): return 42") -> tuple[Any, Any]:
    (tmp_path / "my_data.py").write_text(PROVIDER)
    out = tmp_path / "seen.json"
    data = {"provider": "my_data:provide", "options": {"out": str(out), "text": text}}
    config = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", data=data, **tables(tokenizer)))
    job = run_here("run", str(config), cwd=tmp_path)
    return job, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize(
    ("tokenizer", "eos", "size"),
    [
        ({"path": "hf"}, 0, 400),
        ({"tokenizer_type": "HuggingFaceTokenizer", "path": "hf"}, 0, 400),
        (
            {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "gpt2-vocab.json", "merge_file": "gpt2-merges.txt"},
            0,
            400,
        ),
        ({"tokenizer_type": "SentencePieceTokenizer", "path": "sp.model"}, 2, 300),
        ({"tokenizer_type": "Llama2Tokenizer", "path": "sp.model"}, 2, 300),
        ({"tokenizer_type": "TikTokenizer", "path": "tik.json", "vocab_size": 1300}, 2, 1300),
        ({"tokenizer_type": "NullTokenizer", "vocab_size": 50}, 49, 50),
    ],
)
def test_every_type_reaches_a_users_own_provider_on_the_context(
    tmp_path: Path, vocabularies: Path, tokenizer: dict[str, Any], eos: int, size: int
) -> None:
    files = {
        key: str(vocabularies / value) if key in ("path", "vocab_file", "merge_file") else value
        for key, value in tokenizer.items()
    }
    text = "3 1 4 1 5" if tokenizer.get("tokenizer_type") == "NullTokenizer" else "def main(): return 42"  # ids as text
    job, seen = run_with(tmp_path, files, text)
    assert job.returncode == 0, job.stderr
    assert seen["eos"] == eos and seen["size"] == size and len(seen["ids"]) > 3
    assert all(0 <= i < size for i in seen["ids"])


def test_the_types_give_the_ids_their_libraries_give(vocabularies: Path) -> None:
    """The same ids as the libraries Megatron wraps (sentencepiece, tiktoken + 1000 special ids)."""
    import sentencepiece
    import tiktoken
    from coretrain_tokenizer import megatron

    def built(**values: Any) -> Any:
        return megatron.build(megatron.Settings(**values), "test")

    text = (STDLIB / "contextlib.py").read_text()[:3000]
    sp = built(tokenizer_type="SentencePieceTokenizer", path=str(vocabularies / "sp.model"))
    reference = sentencepiece.SentencePieceProcessor(model_file=str(vocabularies / "sp.model"))
    assert sp(text)["input_ids"] == reference.encode_as_ids(text)
    tik = built(tokenizer_type="TikTokenizer", path=str(vocabularies / "tik.json"), vocab_size=1300)
    entries = json.loads((vocabularies / "tik.json").read_text())
    ranks = {base64.b64decode(e["token_bytes"]): e["rank"] for e in entries}
    plain = tiktoken.Encoding("t", pat_str=megatron.TIKTOKEN_PATTERNS["v2"], mergeable_ranks=ranks, special_tokens={})
    assert tik(text)["input_ids"] == [i + 1000 for i in plain.encode(text)]
    assert tik.decode(tik(text)["input_ids"]) == text
    null = built(tokenizer_type="NullTokenizer", vocab_size=50)
    assert null("3 1 4 1 5")["input_ids"] == [3, 1, 4, 1, 5] and null.eos_token_id == 49


@pytest.mark.parametrize(
    ("tokenizer", "words"),
    [
        (
            {"tokenizer_type": "WordPiece"},
            "tokenizer.tokenizer_type: 'WordPiece' is not one of HuggingFaceTokenizer, GPT2BPE",
        ),
        (
            {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "gpt2-vocab.json"},
            "tokenizer.merge_file: tokenizer_type",
        ),
        (
            {"tokenizer_type": "SentencePieceTokenizer", "path": "missing.model"},
            "tokenizer.path: missing.model is not a file",
        ),
        ({"tokenizer_type": "NullTokenizer"}, 'tokenizer.vocab_size: tokenizer_type = "NullTokenizer" needs'),
        (
            {"tokenizer_type": "TikTokenizer", "path": "tik.json", "tiktoken_pattern": "v3"},
            "plugins.tokenizer.tiktoken_pattern",
        ),
    ],
)
def test_a_tokenizer_that_cannot_be_built_is_one_error(
    tmp_path: Path, vocabularies: Path, tokenizer: dict[str, Any], words: str
) -> None:
    files = {
        k: str(vocabularies / v) if k in ("vocab_file",) or (k == "path" and v == "tik.json") else v
        for k, v in tokenizer.items()
    }
    job, _ = run_with(tmp_path, files)
    assert job.returncode == 2 and "Traceback" not in job.stderr and job.stderr.count("error:") == 1, job.stderr
    assert words in job.stderr, job.stderr


def test_data_prepare_and_indexed_take_a_sentencepiece_tokenizer_from_the_config(
    tmp_path: Path, vocabularies: Path
) -> None:
    """``data prepare --config`` (two spawned workers, each building the type) writes the ids the
    SentencePiece model gives, and an ``indexed`` run sizes its vocabulary from the same type."""
    import sentencepiece

    docs = [p for p in (STDLIB / "contextlib.py").read_text().split("\n\n") if p.strip()][:40]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = {"tokenizer_type": "SentencePieceTokenizer", "path": str(vocabularies / "sp.model")}
    gpt = {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 16, "make_vocab_size_divisible_by": 64}}
    prefix = tmp_path / "sp"
    data = {
        "provider": "indexed",
        "options": {"data_path": f"{prefix}_text_document", "split": "90,10,0", "seq_length": 16},
    }
    sections = {"model": gpt, "data": data, "train": {"micro_batch_size": 4, "train_iters": 3}, **tables(tokenizer)}
    config = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", **sections))
    made = run_here(
        "data",
        "prepare",
        str(tmp_path / "docs.jsonl"),
        "--config",
        str(config),
        "--output-prefix",
        str(prefix),
        "--workers",
        "2",
        cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr
    reference = sentencepiece.SentencePieceProcessor(model_file=str(vocabularies / "sp.model"))
    written = np.fromfile(f"{prefix}_text_document.bin", dtype=np.uint16).tolist()
    assert written == [i for d in docs for i in reference.encode_as_ids(d)]
    trained = run_here("run", str(config), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert "padded vocab (size: 300) with 20 dummy tokens (new size: 320)" in trained.stderr
