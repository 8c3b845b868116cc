"""Context parallelism: each sequence split over 2 gloo ranks (load-balanced chunks; keys and
values gathered, traded for heads or passed around a ring) trains the losses of one rank, with
DDP and as CP 2 × FSDP 2 and CP 2 × HSDP on 4 ranks, and resumes on DP 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import config_file, gpt_preset, in_one_job, metrics_rows, run_train, train_llama

from coretrain import UserError

TRAIN = {"micro_batch_size": 4, "train_iters": 12, "log_interval": 3, "eval_iters": 1, "eval_interval": 6}


def write(tmp_path: Path, name: str, distributed: dict[str, Any], **options: Any) -> Path:
    preset = gpt_preset(tmp_path / name)
    preset["model"]["options"] |= {"n_layer": 2}
    preset["data"]["options"] |= options
    return config_file(tmp_path / f"{name}.toml", preset, {"distributed": distributed}, **TRAIN)


def losses(out: Path) -> list[tuple[int, float]]:
    return [(row["step"], row.get("loss", row.get("valid/loss"))) for row in metrics_rows(out)]


@pytest.mark.slow  # 2 and 4 gloo ranks
def test_sequences_split_over_two_ranks_train_like_one_rank_and_resume_on_data_parallel(tmp_path: Path) -> None:
    assert run_train(str(write(tmp_path, "one", {})), cwd=tmp_path).returncode == 0
    # CP 2 with DDP, and CP 2 → DP 2 (the same global batch: one micro-batch of 2 per rank), in
    # one job (its start-up paid once); CP 2 × FSDP 2 on 4 ranks
    split = write(tmp_path, "cp_then_dp", {"cp_size": 2})
    jobs = [
        ["run", str(write(tmp_path, "cp", {"cp_size": 2}))],
        ["run", str(split), "--set", "train.exit_interval=6"],
        ["run", str(split), "--set", "distributed.cp_size=1", "--set", "train.micro_batch_size=2"],
    ]
    job = in_one_job(tmp_path, 2, jobs, "cp")
    assert "each sequence of 32 positions over 2 ranks, 16 positions each" in job.stderr
    assert "so it follows the ranks" not in job.stderr  # CP 2 → DP 2 kept the batch of 4: resume-checks says nothing
    # CP 2 × FSDP 2, CP 2 × HSDP (2 replicas of 1 shard: FSDP over shard × context ranks), CP 2 × TP 2
    layouts = {"cp_fsdp": {"cp_size": 2, "strategy": "fsdp"}, "cp_hsdp": {"cp_size": 2, "dp_replicate": 2}}
    four = [["run", str(write(tmp_path, n, d)), "--set", "train.micro_batch_size=2"] for n, d in layouts.items()]
    # heads over TP, each rank's positions over CP and again over TP: one data-parallel rank, micro-batches of 4
    four.append(["run", str(write(tmp_path, "cp_tp", {"cp_size": 2, "tp_size": 2}))])
    in_one_job(tmp_path, 4, four, "cp4")
    one = losses(tmp_path / "one")
    for name in ("cp", "cp_then_dp", "cp_fsdp", "cp_hsdp", "cp_tp"):
        split_losses = losses(tmp_path / name)
        assert [s for s, _ in split_losses] == [s for s, _ in one]
        assert all(b == pytest.approx(a, rel=1e-5) for (_, a), (_, b) in zip(one, split_losses)), (name, split_losses)


@pytest.mark.parametrize(
    ("seq_length", "tp", "message"),
    [
        (30, 1, r"cp_size \(2\) must cut the sequence length \(30\) into 2 × cp_size equal chunks"),
        (24, 5, r"distributed.tp_size \(5\) must divide each rank's 12 positions"),
    ],
)
def test_a_sequence_the_chunks_or_tensor_parallelism_cannot_divide_is_one_error(
    seq_length: int, tp: int, message: str
) -> None:
    from types import SimpleNamespace

    from coretrain_context_parallel import ContextParallel
    from coretrain_gpt.model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=256, block_size=30, n_layer=1, n_head=2, n_embd=8, dropout=0.0, bias=False))
    run = SimpleNamespace(
        config=SimpleNamespace(distributed=SimpleNamespace(cp_size=2)),
        datasets=SimpleNamespace(seq_length=seq_length),
        dist=SimpleNamespace(tp_size=tp),
    )
    run.model = model
    with pytest.raises(UserError, match=message):
        ContextParallel().configure_model(run=run)  # type: ignore[arg-type]


@pytest.mark.slow  # 2 and 4 gloo ranks
def test_a_hugging_face_llama_split_over_two_ranks_trains_like_one_rank(tmp_path: Path) -> None:
    """Through transformers' own attention registry: rotary positions per chunk, grouped-query
    attention (4 query heads on 2 key/value heads) over every rank's keys and values."""
    pytest.importorskip("transformers")
    train_llama(tmp_path, {"one": {}, "cp": {"cp_size": 2}, "cp_tp": {"cp_size": 2, "tp_size": 2}}, TRAIN)
    runs = {name: losses(tmp_path / name) for name in ("one", "cp", "cp_tp")}
    for name in ("cp", "cp_tp"):  # CP 2, and CP 2 × TP 2 with transformers' own plan on 4 ranks
        assert [s for s, _ in runs[name]] == [s for s, _ in runs["one"]]
        assert all(b == pytest.approx(a, rel=1e-5) for (_, a), (_, b) in zip(runs["one"], runs[name])), runs


def grad_norms(out: Path) -> list[float]:
    return [row["grad_norm"] for row in metrics_rows(out) if "grad_norm" in row]


@pytest.mark.slow  # 2 and 4 gloo ranks
def test_every_cp_comm_type_trains_like_one_rank(tmp_path: Path) -> None:
    """Megatron's cp_comm_type: all-to-all over heads (a2a) and the ring (p2p, its own backward)
    give one rank's losses and gradient norms, the ring on 4 ranks too (blocks a causal mask
    hides wholly); a2a with heads the ranks cannot divide, and p2p with attention dropout, are
    one error each."""
    assert run_train(str(write(tmp_path, "one", {})), cwd=tmp_path).returncode == 0

    def comm(name: str, kind: str, distributed: dict[str, Any]) -> str:
        path = write(tmp_path, name, distributed)
        path.write_text(path.read_text() + f'\n[plugins.context-parallel]\ncp_comm_type = "{kind}"\n')
        return str(path)

    two = [["run", comm("a2a", "a2a", {"cp_size": 2})], ["run", comm("p2p", "p2p", {"cp_size": 2})]]
    two.append(
        {"args": ["run", comm("dropout", "p2p", {"cp_size": 2}), "--set", "model.options.dropout=0.1"], "expect": 2}
    )
    in_one_job(tmp_path, 2, two, "comm2")
    four = [["run", comm("p2p4", "p2p", {"cp_size": 4})]]
    four.append({"args": ["run", comm("a2a_tp", "a2a", {"cp_size": 2, "tp_size": 2})], "expect": 2})  # 1 head a rank
    in_one_job(tmp_path, 4, four, "comm4")
    errors = (tmp_path / "comm2.stderr").read_text() + (tmp_path / "comm4.stderr").read_text()
    assert 'cp_comm_type = "p2p": attention dropout is not supported' in errors
    assert 'cp_comm_type = "a2a" splits the 1 attention heads a rank holds over distributed.cp_size (2)' in errors
    for name in ("a2a", "p2p", "p2p4"):
        assert [loss for _, loss in losses(tmp_path / name)] == pytest.approx(
            [loss for _, loss in losses(tmp_path / "one")], rel=1e-5
        ), name
        assert grad_norms(tmp_path / name) == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-5), name
