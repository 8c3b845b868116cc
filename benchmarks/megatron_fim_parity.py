"""Does ``indexed``'s fill-in-the-middle rearrange samples as Megatron-LM's ``GPTFIMDataset`` does?
Checked against Megatron-LM's own class on the same files, tokenizer and random draws.

    pip download --no-deps --ignore-requires-python megatron-core==0.19.2 -d /tmp/mcore
    unzip -q /tmp/mcore/megatron_core-*.whl -d /tmp/mcore/x
    # megatron/training/datasets/fim_dataset.py of Megatron-LM at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
    # (2026-08-22; the file as f88b85f8 left it), saved as /tmp/mlm/fim_dataset.py
    python benchmarks/megatron_fim_parity.py --megatron /tmp/mcore/x --fim /tmp/mlm/fim_dataset.py --work /tmp/fim

Megatron-LM's ``GPTFIMDataset`` (Megatron-LM is not on PyPI: its one file, beside the
Megatron-Core wheel's datasets as ``benchmarks/megatron_order_parity.py`` imports them) reads its
samples with one generator per dataset, in the order they are read. coretrain gives each
sample a generator of its own (so that resume and worker counts change nothing); to compare
the transformation itself, coretrain's ``FIM.sample`` is fed Megatron's base windows' twins
(``DocumentWindows``, equal to Megatron's token for token) and one generator seeded as
Megatron's, sample after sample in the same order. The tokenizer is Megatron-Core's own
``HuggingFaceTokenizer`` over a BPE trained here with the FIM sentinels as special tokens, one
that adds nothing to a text and one that starts each with a BOS (as Llama's), each with
Megatron's default ``include_special_tokens=True`` (a piece's text keeps its special tokens, each
part is encoded with the BOS the tokenizer adds) and with
``--tokenizer-hf-no-include-special-tokens``; the corpus (the standard library's source, one
file a document, EOD after each) is made by ``coretrain data prepare`` in the same mode.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

import numpy as np
from megatron_order_parity import import_megatron

SENTINELS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>"}
FILE_SEP = "<file_sep>"
SETTINGS = [
    {"seed": 1234, "seq": 64, "rate": 0.5, "spm": 0.5},
    {"seed": 7, "seq": 128, "rate": 1.0, "spm": 0.3},
    {"seed": 3, "seq": 256, "rate": 0.9, "spm": 0.5, "no_prefix": '"""'},
    {"seed": 11, "seq": 96, "rate": 0.8, "spm": 0.5, "split": FILE_SEP, "fragment": 0.5},
]
SAMPLES = 400


def tokenizer_dir(work: Path, texts: list[str], bos: bool) -> Path:
    """A byte-level BPE with EOS and the FIM sentinels as special tokens, saved as a user's is;
    with ``bos``, one that starts every text with ``<s>`` (as Llama's does)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special = ["<unk>", "<s>", "</s>", *SENTINELS.values(), FILE_SEP]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=special))
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=[*SENTINELS.values(), FILE_SEP],
    )  # fmt: skip
    directory = work / ("tokenizer-bos" if bos else "tokenizer")
    fast.save_pretrained(directory)
    return directory


def corpus(work: Path, tokenizer: Path, include_special_tokens: bool) -> Path:
    """The standard library's modules (pairs of files joined by the file separator) as .bin/.idx."""
    from coretrain_data_prepare.prepare import Request, prepare

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-m]*.py"))[:120]
    texts = [f.read_text(encoding="utf-8", errors="replace")[:3000] for f in files]
    joined = [texts[i] + FILE_SEP + texts[i + 1] for i in range(0, len(texts) - 1, 2)]
    source = work / "code.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in joined))
    output = work / f"code-{tokenizer.name}-{include_special_tokens}"
    prepare(Request(inputs=[str(source)], tokenizer=str(tokenizer), output_prefix=str(output), json_keys=["text"],
                    append_eod=True, include_special_tokens=include_special_tokens))  # fmt: skip
    return output.with_name(output.name + "_text_document")


def megatron_hf_tokenizer(directory: Path) -> Any:
    """Megatron-Core's ``HuggingFaceTokenizer`` (its libraries package loaded by path: the
    ``megatron.core.tokenizers`` package is stood in for by ``import_megatron``)."""
    libraries = directory / "megatron" / "core" / "tokenizers" / "text" / "libraries"
    package = types.ModuleType("megatron_tokenizer_libraries")
    package.__path__ = [str(libraries)]
    sys.modules[package.__name__] = package
    for name in ("abstract_tokenizer", "huggingface_tokenizer"):
        spec = importlib.util.spec_from_file_location(f"{package.__name__}.{name}", libraries / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module.HuggingFaceTokenizer


def import_fim(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("megatron_fim_dataset", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron", type=Path, required=True, help="the unzipped megatron-core wheel")
    parser.add_argument(
        "--fim", type=Path, required=True, help="Megatron-LM's megatron/training/datasets/fim_dataset.py"
    )
    parser.add_argument("--work", type=Path, required=True, help="a directory for the corpus and caches")
    args = parser.parse_args()
    builder, _, _ = import_megatron(args.megatron)
    megatron_fim = import_fim(args.fim)
    hf_tokenizer_class = megatron_hf_tokenizer(args.megatron)
    import transformers

    args.work.mkdir(parents=True, exist_ok=True)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-m]*.py"))[:120]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    equal = total = 0
    for bos in (False, True):
        directory = tokenizer_dir(args.work, texts, bos)
        hf = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        assert (hf("x")["input_ids"][0] == hf.bos_token_id) == bos
        for include in (True, False):  # Megatron's default, --tokenizer-hf-no-include-special-tokens
            prefix = corpus(args.work, directory, include)
            megatron_tokenizer = hf_tokenizer_class(str(directory), include_special_tokens=include)
            wrapped = types.SimpleNamespace(_tokenizer=megatron_tokenizer, eod=hf.eos_token_id, pad=-1)
            wrapped.unique_identifiers = {"class": "HuggingFaceTokenizer", "path": str(directory), "special": include}
            wrapped.vocab_size = len(hf)
            for setting in SETTINGS:
                same, changed = compare(setting, prefix, wrapped, hf, include, builder, megatron_fim, args.work)
                equal, total = equal + same, total + SAMPLES
                kind = f"{'a BOS-adding' if bos else 'a plain'} tokenizer, include_special_tokens={include}"
                print(f"{kind}, {setting}: {same} of {SAMPLES} samples equal ({changed} rearranged by Megatron)")
    print(f"all: {equal} of {total} samples equal")


def compare(
    setting: dict[str, Any],
    prefix: Path,
    wrapped: Any,
    hf: Any,
    include: bool,
    builder: Any,
    fim_module: Any,
    work: Path,
) -> tuple[int, int]:
    """Samples of Megatron's GPTFIMDataset equal to coretrain's FIM of the same base windows,
    and how many Megatron rearranged."""
    from coretrain_indexed.fim import FIM, sentinel_ids
    from coretrain_indexed.splits import build_splits

    from coretrain import DatasetContext

    seed, seq = setting["seed"], setting["seq"]
    extra = {**SENTINELS, "eod": "</s>"}
    config = fim_module.GPTFIMDatasetConfig(
        random_seed=seed, sequence_length=seq, blend=([str(prefix)], None), split="100,0,0",
        tokenizer=wrapped, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        path_to_cache=str(work / "megatron"), mid_level_dataset_surplus=0.005,
        fim_rate=setting["rate"], fim_spm_rate=setting["spm"], fim_extra_tokens=extra,
        fim_split_sample=setting.get("split"), fim_fragment_rate=setting.get("fragment"),
        fim_no_prefix=setting.get("no_prefix"),
    )  # fmt: skip
    (theirs, _, _) = builder(fim_module.GPTFIMDataset, [SAMPLES, 0, 0], lambda: True, config).build()
    context = DatasetContext(train_samples=SAMPLES, valid_samples=0, test_samples=0, seed=seed)
    base = build_splits(str(prefix), ("100,0,0", "megatron-core"), {}, seq, context, str(work / "ours")).train
    tokens = sentinel_ids(hf, {**SENTINELS, "split": setting.get("split")}, "</s>")
    fim = FIM(
        *(setting["rate"], setting["spm"], hf, tokens, setting.get("fragment"), setting.get("no_prefix")),
        special=frozenset(hf.all_special_tokens),
        include_special_tokens=include,
    )
    rng = np.random.RandomState(seed=seed)  # Megatron's one generator, drawn from in reading order
    changed = same = 0
    for k in range(SAMPLES):
        window = base.window(k)
        megatron = theirs._query_document_sample_shuffle_indices(k)[0]
        same += bool(np.array_equal(fim.sample(window, rng), megatron))
        changed += not np.array_equal(megatron, window)
    return same, changed


if __name__ == "__main__":
    main()
