"""Do ``[tokenizer] tokenizer_type``'s Megatron types give Megatron's token ids?

    python -m venv /tmp/mc && /tmp/mc/bin/pip install torch==2.13.0 megatron-core==0.16.1 sentencepiece tiktoken
    git -C MEGATRON_LM show ecb5dfa^:megatron/training/tokenizer/gpt2_tokenization.py > /tmp/mlm/gpt2_tokenization.py
    python benchmarks/megatron_tokenizer_parity.py --megatron-python /tmp/mc/bin/python \\
        --gpt2-tokenization /tmp/mlm/gpt2_tokenization.py --null-tokenizer MC_0_19_2/null_tokenizer.py

Vocabularies are trained here on some standard-library files (SentencePiece BPE of 300 pieces,
a GPT-2 byte-level BPE of 400, a tiktoken BPE of 300 written as Megatron's JSON), then held-out
texts (other files' paragraphs, Unicode, runs of spaces and newlines) are tokenized by this
project (``coretrain_tokenizer.megatron``, as a run's providers call it) and by Megatron
(Megatron-Core's ``MegatronTokenizer`` with the sentencepiece and tiktoken libraries, Megatron-LM's
GPT-2 BPE, Megatron-Core 0.19.2's NullTokenizer) in the other interpreter. Prints, per type,
how many texts got the same ids.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EXTRA = ["héllo wörld — ünïcode ✓ 日本語", "tabs\tand   runs   of spaces\n\n\nand newlines", "", " leading", "x  y"]

MEGATRON_SIDE = r"""
import importlib.util, json, sys
from megatron.core.tokenizers import MegatronTokenizer
work, gpt2_tokenization, null_tokenizer = sys.argv[1:4]
texts = json.load(open(f"{work}/texts.json"))

def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

sp = MegatronTokenizer.from_pretrained(tokenizer_path=f"{work}/sp.model", metadata_path={"library": "sentencepiece"})
tik = MegatronTokenizer.from_pretrained(
    tokenizer_path=f"{work}/tik.json", metadata_path={"library": "tiktoken"}, vocab_size=1300
)
gpt2 = load(gpt2_tokenization, "gpt2_tokenization").GPT2Tokenizer(
    f"{work}/gpt2-vocab.json", f"{work}/gpt2-merges.txt", errors="replace", special_tokens=[], max_len=None
)
null = load(null_tokenizer, "null_tokenizer").NullTokenizer(50)
numbers = [" ".join(str((i * 7 + j) % 50) for j in range(i % 9 + 1)) for i in range(len(texts))]
print(json.dumps({
    "SentencePieceTokenizer": [sp.tokenize(t) for t in texts],
    "TikTokenizer": [tik.tokenize(t) for t in texts],
    "GPT2BPETokenizer": [gpt2.encode(t) for t in texts],
    "NullTokenizer": [null.text_to_ids(t) for t in numbers],
    "eod": {"TikTokenizer": tik.eod, "NullTokenizer": null.eod, "GPT2BPETokenizer": gpt2.encoder["<|endoftext|>"]},
}))
"""


def paragraphs(files: list[Path], count: int) -> list[str]:
    found = [p for f in files for p in f.read_text(errors="replace").split("\n\n") if p.strip()]
    return found[:count]


def train_vocabularies(work: Path) -> None:
    """SentencePiece, GPT-2 byte-level BPE and tiktoken vocabularies from the same corpus."""
    import sentencepiece
    import tokenizers
    from tiktoken._educational import bpe_train

    corpus = work / "corpus.txt"
    corpus.write_text("".join(f.read_text() for f in sorted(STDLIB.glob("a*.py"))[:6]))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(work / "sp"), vocab_size=300, model_type="bpe", minloglevel=2
    )
    gpt2 = tokenizers.ByteLevelBPETokenizer()
    gpt2.train([str(corpus)], vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    gpt2.save_model(str(work), "gpt2")
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer narrates every merge
        ranks = bpe_train(data=corpus.read_text()[:30000], vocab_size=300, pat_str=pattern)
    entries = sorted(ranks.items(), key=lambda item: item[1])
    vocab = [
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode(errors="replace")}
        for t, r in entries
    ]
    (work / "tik.json").write_text(json.dumps(vocab))


def ours(work: Path, texts: list[str]) -> dict[str, list[list[int]]]:
    from coretrain_tokenizer import megatron

    def settings(kind: str, **values: Any) -> megatron.Settings:
        return megatron.Settings(tokenizer_type=kind, **values)

    built = {
        "SentencePieceTokenizer": megatron.build(
            settings("SentencePieceTokenizer", path=str(work / "sp.model")), "parity"
        ),
        "TikTokenizer": megatron.build(
            settings("TikTokenizer", path=str(work / "tik.json"), vocab_size=1300), "parity"
        ),
        "GPT2BPETokenizer": megatron.build(
            settings(
                "GPT2BPETokenizer", vocab_file=str(work / "gpt2-vocab.json"), merge_file=str(work / "gpt2-merges.txt")
            ),
            "parity",
        ),
        "NullTokenizer": megatron.build(settings("NullTokenizer", vocab_size=50), "parity"),
    }
    numbers = [" ".join(str((i * 7 + j) % 50) for j in range(i % 9 + 1)) for i in range(len(texts))]
    ids = {
        kind: [list(tokenizer(t)["input_ids"]) for t in texts]
        for kind, tokenizer in built.items()
        if kind != "NullTokenizer"
    }
    ids["NullTokenizer"] = [list(built["NullTokenizer"](t)["input_ids"]) for t in numbers]
    ids["eod"] = {kind: built[kind].eos_token_id for kind in ("TikTokenizer", "NullTokenizer", "GPT2BPETokenizer")}  # type: ignore[assignment]
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-python", required=True)
    parser.add_argument(
        "--gpt2-tokenization", required=True, help="Megatron-LM's megatron/training/tokenizer/gpt2_tokenization.py"
    )
    parser.add_argument(
        "--null-tokenizer", required=True, help="Megatron-Core's tokenizers/text/libraries/null_tokenizer.py"
    )
    parser.add_argument("--work", default="/tmp/tokenizer-parity")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    train_vocabularies(work)
    held_out = sorted(STDLIB.glob("c*.py"))[:5]
    texts = paragraphs(held_out, 200) + EXTRA
    (work / "texts.json").write_text(json.dumps(texts))
    mine = ours(work, texts)
    command = [args.megatron_python, "-c", MEGATRON_SIDE, str(work), args.gpt2_tokenization, args.null_tokenizer]
    theirs = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    for kind in ("SentencePieceTokenizer", "TikTokenizer", "GPT2BPETokenizer", "NullTokenizer"):
        same = sum(a == b for a, b in zip(mine[kind], theirs[kind]))
        print(f"{kind:24s} {same} of {len(texts)} texts: the same ids")
    print(f"end of document: ours {mine['eod']}, Megatron's {theirs['eod']}")


if __name__ == "__main__":
    main()
