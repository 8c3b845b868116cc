"""Load the exported model with plain transformers and answer a few prompts.

coretrain checkpoint export runs/hf-finetune --format hf --merge-lora --to runs/hf-finetune/hf
python examples/hf-finetune/load_back.py runs/hf-finetune/hf
"""

from __future__ import annotations

import sys

import torch
import transformers
from quiet import quiet_libraries


def main(directory: str) -> None:
    quiet_libraries()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    for prompt in ("What is 12 plus 30?\nAnswer:", "Spell 'owl' backwards.\nAnswer:"):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        print(repr(prompt), "->", repr(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))


if __name__ == "__main__":
    main(sys.argv[1])
