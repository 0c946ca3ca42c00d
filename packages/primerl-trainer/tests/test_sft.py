"""SFT: data reading, assistant-only masks, and a 2-rank gloo run that lowers the loss."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from primerl_models.tiny import build_tiny_model
from primerl_protocol.rundir import read_checkpoint
from primerl_trainer.sft_data import DataError, load_samples, read_rows, tokenize
from primerl_trainer.testing import free_port_block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("model"), "qwen3", hidden_size=64, num_layers=2, alphabet="abcdefghij :", init_std=0.05
    )


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_only_the_assistants_tokens_are_trained(tokenizer):
    msgs = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "cd"},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "fg"},
    ]
    ids, mask = tokenize(tokenizer, msgs, "test")
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(msgs, tokenize=False)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "cd<|im_end|>\nfg<|im_end|>\n"


def test_rows_from_jsonl_parquet_and_folders(tmp_path):
    rows = [
        {"prompt": "ab", "completion": "ba"},
        {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "c"}]},
    ]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:1]) + "\n")
    pq.write_table(pa.Table.from_pylist([rows[0]]), tmp_path / "d" / "b.parquet")
    assert read_rows(str(tmp_path / "d")) == [rows[0], rows[0]]
    assert read_rows(str(tmp_path / "d" / "b.parquet")) == [rows[0]]


def test_bad_data_is_named(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{not json\n')
    with pytest.raises(DataError, match="bad.jsonl, line 2: not JSON"):
        read_rows(str(bad))
    bad.write_text('{"question": "a"}\n')
    with pytest.raises(
        DataError, match=r"row 0: a row needs `messages`, or `prompt` and `completion`; it has \['question'\]"
    ):
        load_samples(str(bad), tokenizer, 64)
    # file paths that do not exist are named as such, whether or not `datasets` is installed
    # (it would otherwise try them as Hub dataset names and answer about the Hub)
    for missing in (tmp_path / "missing.jsonl", tmp_path / "missing"):
        with pytest.raises(DataError, match=f"^{missing}: no such file$"):
            read_rows(str(missing))
    # a name, tried with `datasets` (offline here) if installed: a DataError either way
    with pytest.raises(DataError, match="^no-such-org/no-such-set: no such file, and `datasets` "):
        read_rows("no-such-org/no-such-set")


def test_samples_longer_than_a_row_are_dropped_and_counted(tmp_path, tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "a", "completion": "b"})
        + "\n"
        + json.dumps({"prompt": "a" * 80, "completion": "b"})
        + "\n"
    )
    samples, dropped = load_samples(str(data), tokenizer, 64)
    assert len(samples) == 1 and dropped["longer_than_seq_len"] == 1


def reversal_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 8)))
        rows.append({"prompt": word, "completion": word[::-1]})
    return rows


def sft_config(tmp_path, model_dir, run_dir, max_steps: int, interval: int = 6, extra: str = ""):
    cfg = tmp_path / f"sft-{run_dir.name}-{max_steps}.toml"
    cfg.write_text(f"""
seq_len = 128
max_steps = {max_steps}
run_dir = "{run_dir}"
[model]
name = "{model_dir}"
[wandb]
mode = "disabled"
[data]
path = "{tmp_path / "train.jsonl"}"
eval_path = "{tmp_path / "eval.jsonl"}"
batch_size = 16
eval_interval = 6
[trainer]
dtype = "float32"
[trainer.optimizer]
lr = 3e-3
[trainer.checkpoint]
interval = {interval}
[trainer.weights]
dtype = "float32"
{extra}""")
    return cfg


def run_sft(cfg, killed_after_checkpoint: int | None = None):
    """`primerl sft` on 2 ranks; with `killed_after_checkpoint`, every rank dies (exit 137) the
    moment that step's checkpoint is whole (faulty_trainer_entry.py)."""
    entry = ["-m", "primerl.sft_entry"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if killed_after_checkpoint is not None:
        entry = [str(Path(__file__).with_name("faulty_trainer_entry.py")), "sft"]
        env["PRIMERL_TEST_KILLED_AFTER_CHECKPOINT"] = str(killed_after_checkpoint)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port_block(1)}",
        *entry,
        "@",
        str(cfg),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert (out.returncode != 0) == (killed_after_checkpoint is not None), out.stdout + out.stderr
    return out


def write_data(tmp_path):
    for name, n, seed in (("train", 96, 0), ("eval", 16, 1)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in reversal_rows(n, seed)))


@pytest.mark.slow
def test_sft_on_two_ranks_lowers_the_loss(tmp_path, model_dir):
    write_data(tmp_path)
    run_dir = tmp_path / "run"
    run_sft(sft_config(tmp_path, model_dir, run_dir, 12, extra="keep = 1\nkeep_every = 6"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["trainer/loss"] for r in rows]
    assert len(losses) == 12
    # A smoke check (the margin is not derived); the exact per-step check is the RL trainer's
    # (test_exact_steps.py), whose steps run the same FSDP2 forward, backward and optimizer.
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    evals = [r["trainer/eval_loss"] for r in rows if "trainer/eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    # published at the checkpoints (steps 5 and 11): keep = 1, and keep_every = 6 keeps step_5
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_11", "step_5"]
    assert (run_dir / "weights" / "step_11" / "primerl.json").exists()
    assert (run_dir / "checkpoints" / "step_11" / "meta.json").exists()


@pytest.mark.slow
def test_sft_resumes_with_the_next_batch(tmp_path, model_dir):
    """8 steps straight vs 8 killed the moment step 3's checkpoint is whole, then resumed: same
    losses (data position, RNG, optimizer), and step 3's metrics row was written before its
    checkpoint (a row without a checkpoint is trained again; a checkpoint without its row would
    lose the row for good). Then again with the newest checkpoint unreadable."""
    write_data(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_sft(sft_config(tmp_path, model_dir, straight, 8, interval=4))
    run_sft(sft_config(tmp_path, model_dir, resumed, 8, interval=4), killed_after_checkpoint=3)

    def losses(run_dir):
        return [json.loads(line)["trainer/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    assert len(losses(resumed)) == 4  # steps 0-3
    out = run_sft(sft_config(tmp_path, model_dir, resumed, 8, interval=4))
    assert "resumed from" in out.stdout + out.stderr and "continuing at step 4" in out.stdout + out.stderr
    a, b = losses(straight), losses(resumed)
    assert len(a) == len(b) == 8
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-6, (a, b)
    # the newest checkpoint (step 7) made unreadable: the rerun falls back to step 3 with a
    # warning and trains steps 4-7 again, exactly, rewriting step 7 whole
    newest = resumed / "checkpoints" / "step_7"
    (newest / "meta.json").write_bytes(b"\x00\xff garbage")
    out = run_sft(sft_config(tmp_path, model_dir, resumed, 8, interval=4))
    log = out.stdout + out.stderr
    assert f"checkpoint {newest} is not usable" in log and "step_3; continuing at step 4" in log, log
    c = losses(resumed)
    assert len(c) == 12 and max(abs(x - y) for x, y in zip(a[4:], c[8:])) < 1e-6, (a, c)
    assert read_checkpoint(newest)["step"] == 7


LORA = """
[trainer.lora]
rank = 8
alpha = 16.0
targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""


@pytest.mark.slow
def test_sft_with_lora_trains_only_the_adapters_resumes_exactly_and_publishes_either_way(tmp_path, model_dir):
    """2 ranks (FSDP2 over frozen weights and adapters): the loss falls; 4 + 4 steps with a
    restart give the same losses as 8 straight (adapters and their optimizer state restored).
    The straight run publishes merged weights: equal to the source's bit for bit wherever no
    adapter sits (k_proj, norms, embeddings), different where one does. The resumed run
    publishes its adapter (the default), gathered from both ranks' shards: merged onto the
    source by PEFT's rules, it is the straight run's merged weights (1e-6)."""
    from primerl_protocol.weights import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MARKER
    from primerl_trainer.adapters import merge_adapter
    from safetensors.torch import load_file

    write_data(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    merged = LORA + 'publish = "merged"\n'
    run_sft(sft_config(tmp_path, model_dir, straight, 8, interval=4, extra=merged))
    run_sft(sft_config(tmp_path, model_dir, resumed, 4, interval=4, extra=LORA))
    run_sft(sft_config(tmp_path, model_dir, resumed, 8, interval=4, extra=LORA))

    def losses(run_dir):
        return [json.loads(line)["trainer/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    a, b = losses(straight), losses(resumed)
    assert len(a) == len(b) == 8 and max(abs(x - y) for x, y in zip(a, b)) < 1e-6, (a, b)
    assert sum(a[-2:]) / 2 < sum(a[:2]) / 2, a

    def tensors(folder):
        return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}

    source, published = tensors(model_dir), tensors(straight / "weights" / "step_7")
    assert sorted(source) == sorted(published)  # merged: no adapter tensors, the model's names
    adapted = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, tensor in source.items():
        if any(f".{t}." in name for t in adapted):
            assert not torch.equal(published[name], tensor), name
        else:
            assert torch.equal(published[name], tensor), name
    adapter = resumed / "weights" / "step_7"
    assert sorted(p.name for p in adapter.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS, MARKER]
    from_adapter = merge_adapter(source, adapter)
    for name, tensor in published.items():
        torch.testing.assert_close(from_adapter[name], tensor, atol=1e-6, rtol=0, msg=name)
