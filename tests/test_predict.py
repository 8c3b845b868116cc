"""coretrain predict: every sample's prediction, from a chosen checkpoint, written once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import config_file, gpt_preset, in_one_job, metrics_rows, run_here

import coretrain
from coretrain import hookimpl
from coretrain.testing import tiny_config, write_config


def digits_config(tmp_path: Path, **train: Any) -> Path:
    config = tiny_config(
        tmp_path / "out",
        model={"provider": "workloads:cnn", "loss": "cross_entropy"},
        data={"provider": "workloads:digits"},
        train={"train_iters": 6, "eval_full": True, "eval_interval": 3, **train},
        checkpoint={"save_interval": 3},
        plugins={"keep-best": {"metric": "valid/accuracy", "mode": "max"}},
    )
    return write_config(tmp_path / "c.toml", config)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predictions_of_the_test_split_match_its_evaluation(tmp_path: Path, cli: Any) -> None:
    """Every test sample once, in order, with its prediction and target; their accuracy is the
    test/accuracy the run reported for the same (newest) weights."""
    config = digits_config(tmp_path)
    assert cli("run", str(config), cwd=tmp_path).returncode == 0
    tested = [r for r in metrics_rows(tmp_path / "out") if "test/accuracy" in r][-1]
    result = cli("predict", str(config), "--out", str(tmp_path / "preds.jsonl"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    predicted = records(tmp_path / "preds.jsonl")
    assert [r["index"] for r in predicted] == list(range(201))
    assert set(predicted[0]) == {"index", "prediction", "output", "target"} and len(predicted[0]["output"]) == 10
    accuracy = sum(r["prediction"] == r["target"] for r in predicted) / len(predicted)
    assert accuracy == pytest.approx(tested["test/accuracy"], abs=1e-6)
    assert "201 records -> " in result.stdout
    assert not (tmp_path / "out" / "predict" / "checkpoints").exists()


@pytest.mark.parametrize("loss_first", [False, True])
def test_a_model_returning_a_tuple_trains_on_its_loss_and_predicts_its_logits(
    tmp_path: Path, cli: Any, loss_first: bool
) -> None:
    """nanoGPT's ``(logits, loss)`` and transformers' ``(loss, logits)`` (``return_dict=False``):
    the loss is the tuple's one single value, and the run is the one of the same model returning
    its logits under ``model.loss = "cross_entropy"``; with ``model.loss`` the tuple's model (called
    without targets) gives its logits first. Predict writes the same logits for all three."""
    runs = {
        "own_loss": {"provider": "workloads:tuple_cnn", "options": {"loss_first": loss_first}},
        "tuple_and_model_loss": {"provider": "workloads:tuple_cnn", "loss": "cross_entropy"},
        "logits_and_model_loss": {"provider": "workloads:cnn", "loss": "cross_entropy"},
    }
    losses, outputs = {}, {}
    for name, model in runs.items():
        out = tmp_path / name
        config = tiny_config(
            out,
            model=model,
            data={"provider": "workloads:digits"},
            train={"train_iters": 12, "log_interval": 1, "eval_full": True, "eval_interval": 12},
            optimizer={"lr": 0.005},
        )
        config_path = write_config(out.with_suffix(".toml"), config)
        done = cli("run", str(config_path), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        keys = ("loss", "valid/loss", "test/loss")
        losses[name] = {(r["step"], key): r[key] for r in metrics_rows(out) for key in keys if key in r}
        predicted = out.with_suffix(".jsonl")
        done = cli("predict", str(config_path), "--split", "valid", "--out", str(predicted), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        outputs[name] = [value for record in records(predicted) for value in record["output"]]
    reference = losses["logits_and_model_loss"]
    assert len(reference) == 14 and reference[12, "valid/loss"] < reference[1, "loss"] - 0.1  # it learns
    for name in runs:
        assert losses[name] == pytest.approx(reference, rel=1e-6), name
        assert len(outputs[name]) == 359 * 10 and outputs[name] == pytest.approx(
            outputs["logits_and_model_loss"], rel=1e-5
        )


def test_checkpoint_choice_split_and_parquet(tmp_path: Path, cli: Any) -> None:
    import pyarrow.parquet as pq

    config = digits_config(tmp_path)
    assert cli("run", str(config), cwd=tmp_path).returncode == 0
    outputs = {}
    for choice in ("3", "6", "best", "none"):
        out = tmp_path / f"valid-{choice}.parquet"
        done = cli("predict", str(config), "--split", "valid", "--checkpoint", choice, "--out", str(out), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        outputs[choice] = pq.read_table(out).to_pylist()
    assert len(outputs["6"]) == 359
    assert outputs["3"] != outputs["6"] and outputs["none"] != outputs["6"]
    best = (tmp_path / "out" / "checkpoints" / "best").resolve().name
    assert outputs["best"] == outputs["3" if best.endswith("3") else "6"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--split", "nope"), "--split nope: the data provider has no such split; it has train, valid, test"),
        (("--checkpoint", "9"), "--checkpoint 9: no complete checkpoint at that step; complete: [3, 6]"),
        (("--out", "x.csv"), "no plugin writes .csv files; use .jsonl or .parquet"),
        (("--out", "."), "--out .: is a directory; give a file name"),
        (("--out", "c.toml/p.jsonl"), "--out c.toml/p.jsonl: a folder on its path is a file"),
        (("--data", "prompts.jsonl"), "--data: the data provider 'workloads:digits' names no tokenizer"),
        (("--temperature", "-1"), "--temperature -1.0: expected 0 (greedy) or more"),
        (("--top-p", "0"), "--top-p 0.0: expected a share of the probability mass in (0, 1]"),
        (("--max-new-tokens", "0"), "--max-new-tokens 0: expected a positive number"),
    ],
)
def test_bad_choices_are_one_clear_error(tmp_path: Path, cli: Any, args: tuple[str, ...], message: str) -> None:
    config = digits_config(tmp_path)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def main("}\n')
    assert cli("run", str(config), cwd=tmp_path).returncode == 0
    argv = ["predict", str(config), "--out", str(tmp_path / "p.jsonl"), *args]
    if "--out" in args:
        argv = ["predict", str(config), *args]
    result = cli(*argv, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr
    assert result.stderr.count("\n") == 1  # one line
    if message.startswith("--out ."):  # refused before the pass: no predict run was made
        assert not (tmp_path / "out" / "predict").exists()


def test_a_language_models_predictions_are_token_ids_and_the_console_says_only_where_they_went(
    tmp_path: Path, cli: Any
) -> None:
    """With model.loss = "cross_entropy" an LM's logits are (sequence × vocabulary) per sample:
    its prediction is the token id at each position (an argmax taken twice gave a position),
    written without the logits. No training banner, no "completed at step 0"."""
    lm = {"model": {"loss": "cross_entropy"}}
    config = config_file(tmp_path / "lm.toml", gpt_preset(tmp_path / "out"), lm, train_iters=2, eval_iters=0)
    assert cli("run", str(config), cwd=tmp_path).returncode == 0
    result = cli("predict", str(config), "--split", "valid", "--out", str(tmp_path / "p.jsonl"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    predicted = records(tmp_path / "p.jsonl")
    first = predicted[0]
    assert set(first) == {"index", "prediction", "target"}
    assert len(first["prediction"]) == len(first["target"]) == 32  # seq_length
    assert all(isinstance(token, int) and 0 <= token < 256 for r in predicted for token in r["prediction"])
    assert result.stdout.strip().splitlines() == [f"predict: {len(predicted)} records -> {tmp_path / 'p.jsonl'}"]
    assert result.stderr == ""

    # the quickstart's way, without model.loss: the model returns its loss given the targets, and
    # its logits without them; predict calls it so, and writes the same token ids
    plain = config_file(tmp_path / "plain.toml", gpt_preset(tmp_path / "out"), train_iters=2, eval_iters=0)
    again = cli("predict", str(plain), "--split", "valid", "--out", str(tmp_path / "plain.jsonl"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert records(tmp_path / "plain.jsonl") == predicted


@pytest.mark.slow  # 2 gloo ranks
def test_two_ranks_write_the_same_file_as_one(tmp_path: Path) -> None:
    config = digits_config(tmp_path)
    tests = {"PYTHONPATH": str(Path(__file__).parent)}  # workloads: a user's own module
    assert run_here("run", str(config), cwd=tmp_path, env=tests).returncode == 0
    one = run_here("predict", str(config), "--out", str(tmp_path / "p1.jsonl"), cwd=tmp_path, env=tests)
    assert one.returncode == 0, one.stderr
    # and a GPT's sampled continuations of five prompts, three on one rank and two on the other
    lm = config_file(tmp_path / "lm" / "c.toml", gpt_preset(tmp_path / "lm" / "out"), train_iters=20, eval_iters=0)
    assert run_here("run", str(lm), cwd=tmp_path).returncode == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(5)))
    sample = ["predict", str(lm), "--data", str(prompts), "--temperature", "1.0", "--max-new-tokens", "8"]
    assert run_here(*sample, "--out", str(tmp_path / "g1.jsonl"), cwd=tmp_path).returncode == 0
    greedy = [*sample[:4], "--max-new-tokens", "8"]
    assert run_here(*greedy, "--out", str(tmp_path / "t1.jsonl"), cwd=tmp_path).returncode == 0
    jobs = [
        ["predict", str(config), "--out", str(tmp_path / "p2.jsonl")],
        [*sample, "--out", str(tmp_path / "g2.jsonl")],
        [*sample, "--set", 'distributed.strategy="fsdp"', "--out", str(tmp_path / "g3.jsonl")],  # forwards: collectives
        [*greedy, "--set", "distributed.tp_size=2", "--out", str(tmp_path / "t2.jsonl")],  # the logits: gathered
    ]
    in_one_job(tmp_path, 2, jobs, "predict", env=tests)
    one, two = records(tmp_path / "p1.jsonl"), records(tmp_path / "p2.jsonl")
    assert [r["index"] for r in two] == list(range(201))
    assert [r["prediction"] for r in one] == [r["prediction"] for r in two]
    assert all(a["output"] == pytest.approx(b["output"], abs=1e-5) for a, b in zip(one, two))
    assert records(tmp_path / "g2.jsonl") == records(tmp_path / "g1.jsonl") == records(tmp_path / "g3.jsonl")
    assert records(tmp_path / "t2.jsonl") == records(tmp_path / "t1.jsonl")


@pytest.mark.parametrize(("count", "world", "size"), [(634, 4, 3), (10, 4, 2), (7, 3, 8), (3, 4, 1), (0, 2, 2)])
def test_every_rank_predicts_in_as_many_batches_each_sample_once(count: int, world: int, size: int) -> None:
    """Each sample is one rank's, once; every rank runs the same number of batches (a forward over
    experts spread over the ranks is a collective: a rank with a batch fewer runs a filler)."""
    from coretrain_predict.predictor import this_ranks_chunks

    shares = [this_ranks_chunks(count, rank, world, size) for rank in range(world)]
    assert sorted(i for chunks, _ in shares for chunk in chunks for i in chunk) == list(range(count))
    assert len({len(chunks) + len(fillers) for chunks, fillers in shares}) == 1
    assert all(len(chunk) <= size for chunks, _ in shares for chunk in chunks)


# --------------------------------------------------------------------------- prompts to a causal LM


class KeepModel:
    """The trained model as the run ends: the weights predict restores from the last checkpoint."""

    model: Any = None

    @hookimpl
    def on_train_end(self, run: Any) -> None:
        self.model = run.unwrapped_model.eval()


def predict_prompts(cli: Any, config: Path, prompts: list[Any], *options: str) -> list[dict[str, Any]]:
    """``coretrain predict --data`` of texts (``prompt``) and chats (``messages``): its records."""
    data, out = config.parent / "prompts.jsonl", config.parent / f"gen{len(options)}.jsonl"
    data.write_text("".join(json.dumps({"prompt" if isinstance(p, str) else "messages": p}) + "\n" for p in prompts))
    result = cli("predict", str(config), "--data", str(data), "--out", str(out), *options, cwd=config.parent)
    assert result.returncode == 0, result.stderr
    return records(out)


def test_prompts_to_the_first_party_gpt_on_bytes_get_its_greedy_continuation(tmp_path: Path, cli: Any) -> None:
    """The quickstart's model and data: each prompt's bytes, then the argmax byte after each, its
    context cropped to the last seq_length (32) bytes; sampling is seeded per prompt and draws
    bytes only, not the padded vocabulary's other ids."""
    for name in ("a.txt", "b.txt"):  # a text whose next byte depends on the ones before
        (tmp_path / name).write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    preset = gpt_preset(tmp_path / "out")
    preset["data"]["options"]["globs"] = [str(tmp_path / "*.txt")]
    preset["model"]["options"]["make_vocab_size_divisible_by"] = 384  # 128 ids that are no byte, as Megatron pads
    config = config_file(tmp_path / "c.toml", preset, train_iters=100, eval_iters=0)
    keep = KeepModel()
    assert coretrain.train(config, plugins={"keep": keep}).outcome == "completed"
    long = "the lazy dog\nthe quick brown fox jumps"  # 38 bytes: more than the window
    prompts = ["the quick ", "over the", long, long[-32:]]
    greedy = predict_prompts(cli, config, prompts, "--max-new-tokens", "12")
    assert [(r["index"], r["prompt"]) for r in greedy] == list(enumerate(prompts))
    for record in greedy[:2]:  # one forward over prompt and completion: each new byte was the argmax
        prompt, completion = record["prompt"].encode(), record["completion"].encode()
        assert len(completion) == 12, record
        with torch.no_grad():
            logits = keep.model(torch.tensor([list(prompt + completion)]))[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == list(completion), record
    assert greedy[2]["completion"] == greedy[3]["completion"]  # only the last 32 bytes are seen

    sampled = predict_prompts(cli, config, prompts, "--temperature", "1.0", "--top-p", "0.9")
    assert sampled == predict_prompts(
        cli, config, prompts, "--temperature", "1.0", "--top-p", "0.9", "--batch-size", "1"
    )
    assert [r["completion"] for r in sampled] != [r["completion"] for r in greedy]
    assert predict_prompts(cli, config, prompts, "--max-new-tokens", "12", "--temperature", "0") == greedy
    hot = predict_prompts(cli, config, prompts, "--temperature", "50", "--top-p", "0.9")  # near uniform, yet
    assert all(hot[i]["completion"] != sampled[i]["completion"] for i in range(4))  # never a padding id (no byte)

    (tmp_path / "empty.jsonl").write_text('{"prompt": ""}\n')
    empty = cli("predict", str(config), "--data", "empty.jsonl", "--out", "e.jsonl", cwd=tmp_path)
    assert (
        empty.returncode == 2 and "empty.jsonl: record 1 has neither a 'prompt' text nor a 'messages'" in empty.stderr
    )


def test_a_nanogpt_model_on_token_files_continues_prompts_through_the_runs_tokenizer(
    tmp_path: Path, cli: Any, tokenizer_dir: Path
) -> None:
    """nanoGPT's way: train.bin / val.bin of a tokenizer's ids, a model that returns the last
    position's logits only when called without targets, its vocabulary padded past the
    tokenizer's; ``[tokenizer]`` names the tokenizer, which turns prompts into ids and back."""
    import numpy as np
    from conftest import PROSE
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}<s>assistant:"
    tokenizer.save_pretrained(tmp_path / "tokenizer")  # a chat model's tokenizer
    ids = np.array([i for text in PROSE for i in tokenizer.encode(text + "\n")], dtype=np.uint16)
    ids[: len(ids) * 9 // 10].tofile(tmp_path / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(tmp_path / "val.bin")
    files = {"train_path": str(tmp_path / "train.bin"), "valid_path": str(tmp_path / "val.bin"), "seq_length": 16}
    config = tiny_config(
        tmp_path / "out",
        model={"provider": "workloads:nano_lm", "options": {"vocab_size": len(tokenizer) + 20}},
        data={"provider": "token-file", "options": files},
        train={"train_iters": 30, "eval_iters": 0},
        optimizer={"lr": 0.05},
        tokenizer={"path": str(tmp_path / "tokenizer")},
    )
    write_config(tmp_path / "c.toml", config)
    keep = KeepModel()
    assert coretrain.train(tmp_path / "c.toml", plugins={"keep": keep}).outcome == "completed"
    chat = [{"role": "user", "content": "The lazy"}]  # a record of "messages": rendered by the chat template
    prompts: list[Any] = ["The quick brown", "jumps over the", chat]
    got = predict_prompts(cli, tmp_path / "c.toml", prompts, "--max-new-tokens", "6")

    bigram = keep.model
    for prompt, record in zip(prompts, got):
        given = tokenizer.encode(prompt) if isinstance(prompt, str) else tokenizer.apply_chat_template(prompt)
        given = list(given["input_ids"] if hasattr(given, "keys") else given)
        made = list(given)
        for _ in range(6):  # the bigram's argmax over the tokenizer's ids (not the padding's)
            with torch.no_grad():
                made.append(int(bigram.lm_head(bigram.wte(torch.tensor(made[-1])))[: len(tokenizer)].argmax()))
        new = made[len(given) :]
        new = new[: new.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in new else new
        assert record["prompt"] == prompt and record["completion"] == tokenizer.decode(new, skip_special_tokens=True)


def test_nucleus_keeps_the_fewest_tokens_that_reach_top_p_and_until_ends_at_the_end_token() -> None:
    from coretrain_predict.sampling import nucleus, until

    logits = torch.tensor([0.5, 0.2, 0.25, 0.05]).log()
    assert nucleus(logits, 0.6).tolist() == pytest.approx([0.5 / 0.75, 0.0, 0.25 / 0.75, 0.0])
    assert nucleus(logits, 0.4).tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])  # the first is always kept
    assert nucleus(logits, None).tolist() == pytest.approx([0.5, 0.2, 0.25, 0.05])
    assert until([5, 6, 2, 7, 2], 2) == [5, 6, 2] and until([5, 6], 2) == [5, 6] and until([5, 2], None) == [5, 2]
