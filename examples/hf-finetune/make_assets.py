"""Make what a user would have downloaded, locally: a tiny Llama, its tokenizer, and a small
instruction set (``assets/``). Nothing is fetched from the network.

    python examples/hf-finetune/make_assets.py [DIR]      # default: examples/hf-finetune/assets
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
import transformers
from quiet import quiet_libraries
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent / "assets"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def instructions(count: int = 2000, seed: int = 0) -> list[dict[str, str]]:
    """Two kinds of records: prompt/response pairs, and chats (rendered by the chat template)."""
    rng = random.Random(seed)
    records: list[dict[str, str]] = []
    for i in range(count):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        if i % 2:
            records.append({"prompt": f"What is {a} plus {b}?\nAnswer:", "response": f" {a + b}"})
        else:
            word = rng.choice(["fox", "dog", "cat", "owl", "bee"])
            records.append({"prompt": f"Spell '{word}' backwards.\nAnswer:", "response": f" {word[::-1]}"})
    return records


def pretrain(
    model: transformers.LlamaForCausalLM,
    tokenizer: transformers.PreTrainedTokenizerFast,
    texts: list[str],
    steps: int = 300,
) -> None:
    """A few hundred steps of plain next-token training, so the base knows the text's shape
    (what a downloaded model brings); the fine-tune then teaches it to answer."""
    ids = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [2]]
    stream = torch.tensor(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - 33, (32,), generator=generator)
        batch = torch.stack([stream[s : s + 33] for s in starts])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"pretrained the base for {steps} steps (loss {loss.item():.2f})")


def main(assets: Path = ASSETS) -> None:
    quiet_libraries()
    # one torch thread: a tiny model gains nothing from more, and on a busy machine idle
    # intra-op threads spin (a loaded shared box once took 46 minutes instead of seconds)
    torch.set_num_threads(1)
    assets.mkdir(parents=True, exist_ok=True)
    records = instructions()
    with open(assets / "instructions.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = [r["prompt"] + r["response"] for r in records]
    tokenizer.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(assets / "tokenizer")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    model = transformers.LlamaForCausalLM(config)
    pretrain(model, fast, texts)
    model.save_pretrained(assets / "tiny-llama")
    fast.save_pretrained(assets / "tiny-llama")  # a model directory usually carries its tokenizer
    print(f"wrote {assets}: tiny-llama/, tokenizer/, instructions.jsonl ({len(records)} records)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS)
