"""The RL trainer end to end on CPU: torchrun with 2 gloo ranks, real ZeroMQ sockets, a test
double of the orchestrator (FakeOrchestrator), a tiny model built locally."""

import contextlib
import json
import math
import subprocess
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from primerl_models import load_model
from primerl_models.tiny import build_tiny_model
from primerl_protocol import Encoder, Shutdown
from primerl_protocol.weights import verify
from primerl_trainer.config import CheckpointConfig, OptimizerConfig, TrainerConfig, WeightsConfig
from primerl_trainer.distributed import Dist
from primerl_trainer.metrics import NAMESPACES
from primerl_trainer.rl import validate_batch
from primerl_trainer.testing import (
    FakeOrchestrator,
    free_port_block,
    launch_trainer,
    synthetic_batches,
    write_trainer_config,
)

RANKS = 2
STOP_TIMEOUT_S = 120
"""Only to catch a hang: a trainer that must stop does so in seconds, or waits for half an hour."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), "qwen3", hidden_size=64, num_layers=2, init_std=0.05)


TRAINER = TrainerConfig(
    dtype="float32",
    optimizer=OptimizerConfig(lr=3e-3),
    checkpoint=CheckpointConfig(interval=3, keep=5),
    weights=WeightsConfig(dtype="float32", keep=2),
)


@contextlib.contextmanager
def trainer_running(
    tmp_path,
    model_dir,
    run_dir,
    max_steps,
    name="trainer",
    entry=("-m", "primerl.trainer_entry"),
    env=None,
    trainer=TRAINER,
    **extra,
):
    """The trainer under torchrun (output in `tmp_path/name.log`) and the fake orchestrator it
    talks to; killed if it still runs at the end."""
    port = free_port_block(RANKS + 1)
    cfg = write_trainer_config(tmp_path / f"{name}.toml", model_dir, run_dir, port, max_steps, trainer, **extra)
    orch = FakeOrchestrator("127.0.0.1", port + 1, port, RANKS)
    proc = launch_trainer(cfg, RANKS, tmp_path / f"{name}.log", entry, env)
    try:
        yield proc, orch
    finally:
        if proc.poll() is None:
            proc.kill()
        orch.close()


def wait_exit(proc, log: Path) -> int:
    try:
        return proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the trainer still runs {STOP_TIMEOUT_S}s after it should have stopped:\n{log.read_text()}")


def run_trainer(tmp_path, model_dir, run_dir, steps, max_steps=None, feed=None, **extra):
    """Start the trainer, feed it `steps` (batches from `feed`), wait for it to exit."""
    name = "trainer"
    ready = []
    with trainer_running(tmp_path, model_dir, run_dir, max_steps or steps, name, **extra) as (proc, orch):
        for step in range(steps):
            if feed:
                feed(step, orch)
            else:
                batches = synthetic_batches(step, RANKS, 98)
                # what the orchestrator sends along with rank 0's batch
                batches[0].metrics = {"reward/mean": step / 10}
                batches[0].state = {"next_group": 4 * (step + 1)}
                orch.send(batches)
            ready.append(orch.wait_policy())
        rc = proc.wait(timeout=180)
    return rc, ready, (tmp_path / f"{name}.log").read_text()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("straight")
    run_dir = tmp / "run"
    # every 3rd step's weights kept besides the newest 2
    trainer = msgspec.structs.replace(TRAINER, weights=WeightsConfig(dtype="float32", keep=2, keep_every=3))
    rc, ready, log = run_trainer(tmp, model_dir, run_dir, steps=6, wandb="offline", trainer=trainer)
    assert rc == 0, log
    return run_dir, ready, log


@pytest.mark.slow
def test_rl_steps_lower_the_loss_on_a_fixed_batch(straight_run):
    run_dir, ready, _ = straight_run
    losses = [m["trainer/loss"] for m in metrics(run_dir)]
    assert len(losses) == 6
    # A smoke check (the margin is not derived): that the steps are exactly a single process's
    # steps on the same data is proved by test_exact_steps.py.
    assert losses[-1] < losses[0] - 0.05, losses
    assert [r.step for r in ready] == list(range(6))


@pytest.mark.slow
def test_published_weights_are_complete_verified_and_pruned(straight_run):
    run_dir, ready, _ = straight_run
    # keep = 2, and keep_every = 3: step_2 (the weights after 3 steps; step_5 is among the newest)
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_2", "step_4", "step_5"]
    meta = verify(ready[-1].location)
    assert meta["checksum"] == ready[-1].checksum
    assert (Path(ready[-1].location) / "tokenizer.json").exists()


@pytest.mark.slow
def test_published_weights_load_in_transformers_with_the_trainer_logits(straight_run):
    import transformers
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_dir, ready, _ = straight_run
    final = Path(ready[-1].location)
    # The trainer's own final state, from its sharded checkpoint (step 5).
    flat = run_dir.parent / "final.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / "step_5", flat)
    trainer_state = torch.load(flat, weights_only=False)["model"]
    ours = load_model(final)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, trainer_state[name]), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    ids = torch.randint(0, 98, (1, 20))
    with torch.no_grad():
        ours.load_state_dict(trainer_state)
        torch.testing.assert_close(
            hf(input_ids=ids).logits, ours.logits(ids, torch.arange(20)[None]), atol=1e-4, rtol=0
        )


@pytest.mark.slow
def test_metrics_go_to_jsonl_and_offline_wandb(straight_run):
    run_dir, _, log = straight_run
    first = metrics(run_dir)[0]
    for key in (
        "trainer/loss",
        "trainer/mismatch_kl",
        "trainer/entropy",
        "trainer/grad_norm",
        "trainer/lr",
        "trainer/tokens_per_s",
        "time/fwd_bwd",
        "time/publish",
        "time/data",
        "time/optimizer",
    ):
        assert key in first, key
    # one scheme (docs/metrics.md): every key has a namespace of the documented list
    assert {k.split("/")[0] for k in first if k != "step"} <= set(NAMESPACES), sorted(first)
    # the orchestrator's metrics of each step, logged on the same step
    assert [m["reward/mean"] for m in metrics(run_dir)] == pytest.approx([s / 10 for s in range(6)])
    assert "step 0 | loss" in log  # the console line
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))


def test_validate_batch_names_the_problem_and_the_sample():
    d = Dist(rank=1, world_size=RANKS, local_rank=1, device=torch.device("cpu"))

    def problem(step=0, rank=1, change=lambda mb: None):
        batch = synthetic_batches(step, RANKS, 98)[rank]
        change(batch.micro_batches[1])  # micro-batch 1 of rank 1: samples 1100 and 1101, 16 tokens each
        return validate_batch(batch, 0, d, vocab_size=98, max_row_tokens=64)

    assert problem() is None
    assert problem(step=2) == "got a batch for step 2 while expecting step 0: a step was skipped"
    assert problem(rank=0) == "batch for rank 0 of 2 arrived at rank 1 of 2"
    assert problem(change=lambda mb: mb.input_ids.__setitem__(3, 5000)) == (
        "micro-batch 1, sample 1100: token id 5000 is outside the vocabulary [0, 98)"
    )
    assert problem(change=lambda mb: mb.advantages.__setitem__(17, np.nan)) == (
        "micro-batch 1, sample 1101: advantages holds nan at token 17, not a finite number"
    )
    assert problem(change=lambda mb: mb.inference_logprobs.__setitem__(8, -np.inf)) == (
        "micro-batch 1, sample 1100: inference_logprobs holds -inf at token 8, not a finite number"
    )
    assert problem(change=lambda mb: mb.temperatures.__setitem__(20, 0.0)) == (
        "micro-batch 1, sample 1101: temperatures holds 0.0 at token 20, not a positive finite number"
    )
    assert problem(change=lambda mb: mb.loss_mask.__setitem__(16, True)) == (
        "micro-batch 1, sample 1101: its first token is marked for training but has no context"
    )
    empty = synthetic_batches(0, RANKS, 98)[1]
    empty.micro_batches = []
    assert validate_batch(empty, 0, d, 98, 64) == "batch for step 0 has no micro-batches"


def test_validate_batch_checks_each_samples_images_against_its_image_tokens():
    """A row's images are matched to its samples' runs of image tokens in order (a 32 x 64
    picture, patches of 16 merged 2 x 2: 2 tokens). Images for a text model, a sample with
    fewer runs than its images, a run of the wrong length: refused, naming the sample."""
    from primerl_protocol.images import ImageSpec

    d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    vision = (ImageSpec(patch_size=16, merge_size=2, min_pixels=1024), 97)

    def problem(ids_of_samples, sizes, vision=vision, cp=1):
        batch = synthetic_batches(0, 1, 98)[0]
        mb = batch.micro_batches[0]
        ids = np.concatenate([np.array(x, np.int32) for x in ids_of_samples])
        fields = {name: getattr(mb, name) for name in mb.__struct_fields__}
        n, lens = len(ids), np.array([len(x) for x in ids_of_samples], np.int32)
        fields |= dict(
            input_ids=ids,
            loss_mask=np.zeros(n, bool),
            inference_logprobs=np.zeros(n, np.float32),
            advantages=np.zeros(n, np.float32),
            temperatures=np.ones(n, np.float32),
            seq_lens=lens,
            sample_ids=np.arange(len(lens), dtype=np.int64) + 10,
            policy_steps=np.zeros(len(lens), np.int32),
            prefix_lens=np.zeros(len(lens), np.int32),
            parents=np.full(len(lens), -1, np.int32),
            image_sizes=np.array(sizes, np.int32).reshape(-1, 2),
            image_pixels=np.zeros(sum(h * w * 3 for h, w in sizes), np.uint8),
        )
        batch.micro_batches = [type(mb)(**fields)]
        return validate_batch(batch, 0, d, 98, 64, vision, cp)

    assert problem([[1, 97, 97, 2], [3, 97, 97, 4, 97, 97]], [(32, 64), (32, 64), (64, 32)]) is None
    assert problem([[1, 97, 97, 2]], [(32, 64)], vision=None) == (
        "micro-batch 0, the row holds 1 images but the model has no vision tower"
    )
    assert problem([[1, 97, 97, 2], [3, 4]], [(32, 64), (32, 64)]) == (
        "micro-batch 0, the row holds 2 images but its samples have 1 runs of image tokens"
    )
    assert problem([[1, 97, 2], [3, 97, 97]], [(32, 64), (32, 64)]) == (
        "micro-batch 0, sample 10: image 1 (32 x 64 pixels) makes 2 image tokens but its run has 1"
    )
    assert problem([[1, 97, 97, 2]], [(32, 64)], cp=2) == (
        "micro-batch 0 holds images, and rows with images are not split over context-parallel ranks yet: "
        "set trainer.parallel.cp = 1 (it is 2)"
    )


@pytest.mark.slow
def test_a_refused_batch_stops_every_rank_and_tells_the_orchestrator_why(tmp_path, model_dir):
    """The orchestrator sends no batch twice: waiting for another would wait for ever."""
    run_dir = tmp_path / "run"
    with trainer_running(tmp_path, model_dir, run_dir, max_steps=10, recv_timeout_s=600) as (proc, orch):
        # Arrays of mismatched lengths, as a buggy peer would frame them, to rank 0: the socket
        # drops it (it is not a batch) and the rank waits for its batch.
        header, payload = Encoder().encode(synthetic_batches(0, RANKS, 98)[0])
        tree = msgspec.msgpack.decode(header)
        tree["micro_batches"][0]["advantages"][2] = [31]
        orch.senders[0].socket.send_multipart([msgspec.msgpack.encode(tree), payload])
        for step in range(3):
            orch.send(synthetic_batches(step, RANKS, 98))
            assert orch.wait_policy().step == step
        bad = synthetic_batches(3, RANKS, 98)
        bad[1].micro_batches[1].input_ids[3] = 5000  # out of the vocabulary, on rank 1
        orch.send(bad)
        stopped = orch.next_policy_message()
        rc = wait_exit(proc, tmp_path / "trainer.log")
    log = (tmp_path / "trainer.log").read_text()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    why = f"refused the batch for step 3: rank 1: micro-batch 1, sample 1100: token id 5000 is outside the vocabulary [0, {vocab})"
    assert isinstance(stopped, Shutdown) and stopped.sender == "trainer", stopped
    assert why in stopped.reason
    assert rc != 0 and why in log
    assert "malformed TrainBatch on socket 'batches/rank0' at field `micro_batches[0]`" in log
    assert len(metrics(run_dir)) == 3  # steps 0-2; nothing of step 3 was trained
    assert json.loads((run_dir / "checkpoints" / "step_2" / "meta.json").read_text())["step"] == 2  # kept


@pytest.mark.slow
def test_a_full_disk_on_rank_0_stops_every_rank_and_tells_the_orchestrator(tmp_path, model_dir):
    """Rank 0 cannot write step 1's weights, while rank 1 goes on to wait for step 2's batch:
    both must stop (not wait in a barrier, or for a batch, for half an hour)."""
    run_dir = tmp_path / "run"
    entry = (str(Path(__file__).with_name("faulty_trainer_entry.py")),)
    with trainer_running(
        tmp_path,
        model_dir,
        run_dir,
        max_steps=10,
        entry=entry,
        recv_timeout_s=600,
        env={"PRIMERL_TEST_FULL_DISK_AT_WRITE": "2"},
    ) as (proc, orch):
        for step in range(2):
            orch.send(synthetic_batches(step, RANKS, 98))
        assert orch.wait_policy().step == 0
        stopped = orch.next_policy_message()
        rc = wait_exit(proc, tmp_path / "trainer.log")
    log = (tmp_path / "trainer.log").read_text()
    assert isinstance(stopped, Shutdown) and stopped.sender == "trainer", stopped
    assert "rank 0 failed at step 1: OSError: [Errno 28] No space left on device" in stopped.reason
    assert rc != 0 and "No space left on device" in log


@pytest.mark.slow
def test_a_shutdown_to_one_rank_stops_every_rank_with_a_final_checkpoint(tmp_path, model_dir):
    """Rank 0 is told to stop; rank 1, waiting for a batch that will not come, stops with it."""
    run_dir = tmp_path / "run"
    with trainer_running(tmp_path, model_dir, run_dir, max_steps=10, recv_timeout_s=600) as (proc, orch):
        orch.send(synthetic_batches(0, RANKS, 98))
        assert orch.wait_policy().step == 0
        orch.senders[0].send(Shutdown(sender="orchestrator", reason="the run is done"))
        rc = wait_exit(proc, tmp_path / "trainer.log")
    log = (tmp_path / "trainer.log").read_text()
    assert rc == 0, log
    assert "stopping: the orchestrator is shutting down (the run is done; told rank 0)" in log
    meta = json.loads((run_dir / "checkpoints" / "step_0" / "meta.json").read_text())
    assert (meta["step"], meta["data"]["next_step"]) == (0, 1)


@pytest.mark.slow
def test_non_finite_and_empty_steps_move_no_weights_and_publish_nothing_new(tmp_path, model_dir, straight_run):
    """Step 1: advantages of 3e38 are finite (so the batch passes), but their sum overflows:
    the loss is -inf. Step 2: no token to learn from (the filters left nothing; AdamW's decay
    and momentum would still move the weights). Neither may take an optimizer step or publish
    new weights; step 3 trains as if they never happened (the batch is the same every step, so
    its loss equals the straight run's step 1)."""

    def feed(step, orch):
        batches = synthetic_batches(step, RANKS, 98)
        for b in batches:
            for mb in b.micro_batches:
                if step == 1:
                    mb.advantages[:] = 3e38
                if step == 2:
                    mb.loss_mask[:] = False
            if step == 2:
                b.num_loss_tokens = 0
        orch.send(batches)

    rc, ready, log = run_trainer(tmp_path, model_dir, tmp_path / "run", steps=4, feed=feed)
    assert rc == 0, log
    assert [r.step for r in ready] == [0, 1, 2, 3]
    for r in ready[1:3]:  # announced again
        assert (r.location, r.checksum) == (ready[0].location, ready[0].checksum)
    assert (
        not (tmp_path / "run" / "weights" / "step_1").exists()
        and not (tmp_path / "run" / "weights" / "step_2").exists()
    )
    rows = metrics(tmp_path / "run")
    assert not math.isfinite(rows[1]["trainer/loss"]) and "step skipped: the loss is not finite" in log
    assert [m["trainer/step_skipped"] for m in rows] == [0, 1, 0, 0] and rows[-1]["trainer/steps_skipped"] == 1
    assert [m["trainer/step_empty"] for m in rows] == [0, 0, 1, 0]
    straight = metrics(straight_run[0])
    np.testing.assert_allclose(
        [rows[0]["trainer/loss"], rows[3]["trainer/loss"]],
        [straight[0]["trainer/loss"], straight[1]["trainer/loss"]],
        atol=1e-6,
        rtol=0,
    )
    assert rows[3]["trainer/lr"] == straight[1]["trainer/lr"]  # the schedule did not move either
    final = load_model(ready[3].location)
    assert all(bool(torch.isfinite(t).all()) for t in final.state_dict().values())
