"""The trainer's steps are exactly one process's steps on the union of the data.

One launch pair covers it (torchrun, gloo on CPU, real ZeroMQ sockets, fp32, files on disk):

  run A  2 ranks, step 0, rank 1 holding 3x (or more) the loss tokens of rank 0, three of
         them completions of one prompt laid with that prompt once (shared prompts); it
         checkpoints step 0 and stops;
  run B  1 rank, resumes run A's run directory from that 2-rank checkpoint (DCP reshards it)
         and trains step 1 on the whole batch of that step.

The expected values come from this test process: the same initial weights loaded as a plain
module (no FSDP, no packing: each sequence through `Transformer.logits` on its own, logprobs by
log_softmax here), primerl_algos' loss on the concatenation of all ranks' data (the
single-process definition of the loss), torch's clip_grad_norm_ and torch.optim.AdamW with the
config's hyperparameters and the documented warm-up (lr/2 at step 0, lr at step 1).

Tolerances. Both sides are fp32 (unit roundoff u = 2^-24 = 6e-8) and compute the same
functions in different orders: dense document-masked attention over packed rows against one
causal sequence, the chunked log-softmax against the full one, gradients summed over ranks by
FSDP's reduce-scatter and over micro-batches by accumulation against a single backward. Each
difference is a reduction of at most a few hundred terms (64-wide hidden, <= 64 tokens a row,
<= 128 loss tokens), so relative errors of k u with k ~ 10..100, i.e. 1e-6 .. 6e-6, in the loss
and the gradient norm: RTOL = 2e-5 leaves a margin and is still far below what a wrong
normalisation changes (percents).

Weights: AdamW moves an element by lr m/(sqrt(v) + eps) (bias-corrected, eps = 1e-8), so an
absolute error dg of its gradient (clipped) moves the update by about lr dg / (sqrt(v) + eps),
and never by more than 2.01 lr (two updates of opposite sign; at step 2 the bias-corrected
|m|/sqrt(v) can reach 1.0013). A gradient element is a sum whose fp32 error in another order
is ~k u times the sum of its terms' magnitudes, with k up to ~50 (the tokens and micro-batches
an embedding row or a projection sums over) and terms of the order of the clipped gradient's
elements (<= 0.01): G_ERR = 3e-8 bounds dg (the largest seen here is 1e-8). Each side also
rounds w once (half an ulp of |w|): 4 u |w| covers both. Per element, then, the tolerance is
4 u |w| + lr G_ERR / (sqrt(v) + eps), capped at 2.01 lr: ~1e-7 where the gradient is well away from
0 (most elements: the test requires 90% of them to be held to 1e-6 or better), up to the cap
where the gradient cancels to ~eps and its sign is not determined by fp32 (a handful). Step 1
starts from run A's weights (restored bit for bit, which the test checks), not the reference's:
the step-0 elements whose update fp32 leaves undetermined would otherwise move every step-1
gradient near them. Because AdamW's first step is (almost) invariant to the scale of the
gradient, the step-0 weights only catch a wrong *direction*; the logged loss and gradient norm
catch a wrong scale, and step 1 (after resume, the moments restored) depends on the scale
through m/sqrt(v) and on the restored step count through the bias corrections.
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from primerl_algos.config import LossConfig
from primerl_algos.losses import LossInputs, LossScale, compute_loss
from primerl_algos.packing import build_micro_batch
from primerl_models import load_model
from primerl_models.tiny import build_tiny_model
from primerl_protocol import MicroBatch, TrainBatch
from primerl_protocol.weights import verify
from primerl_trainer.config import CheckpointConfig, OptimizerConfig, SchedulerConfig, TrainerConfig, WeightsConfig
from primerl_trainer.testing import FakeOrchestrator, free_port_block, launch_trainer, write_trainer_config

LR = 3e-3
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.999)
MAX_GRAD_NORM = 1.0
ADAM_EPS = 1e-8  # torch's default, which the trainer uses
U = 2.0**-24  # fp32 unit roundoff
RTOL = 2e-5
G_ERR = 3e-8
TIMEOUT_S = 240


# -- data ------------------------------------------------------------------------------------


def make_sequences(seed: int, n: int, completion: tuple[int, int], vocab: int, one_prompt: bool = False) -> list[dict]:
    """`n` samples with random prompt/completion lengths, tokens, advantages (one per sample),
    inference logprobs near the model's (about -log V) and a sampling temperature each;
    `one_prompt`: all of them completions of the same prompt (a GRPO group)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, vocab, int(rng.integers(3, 7))).astype(np.int32)
    out = []
    for _ in range(n):
        p, c = int(rng.integers(3, 7)), int(rng.integers(*completion))
        ids = rng.integers(3, vocab, p + c).astype(np.int32)
        if one_prompt:
            p, ids = len(prompt), np.r_[prompt, ids[p:]]
        mask = np.r_[np.zeros(p, bool), np.ones(c, bool)]
        out.append(
            dict(
                input_ids=ids,
                loss_mask=mask,
                inference_logprobs=np.where(mask, -rng.uniform(3.5, 5.5, p + c), 0.0).astype(np.float32),
                advantages=np.full(p + c, rng.standard_normal(), np.float32),
                temperatures=np.full(p + c, rng.choice([0.8, 1.0, 1.2]), np.float32),
                sample_id=int(seed * 1000 + len(out)),
            )
        )
    return out


def pack(seqs: list[dict]) -> MicroBatch:
    """One packed row of `seqs`; none: the orchestrator's padding row (one untrained token). A
    sample whose prompt (its untrained first tokens) is the first sample's is laid without it,
    after the first (orchestrator.share_prompts: MicroBatch.prefix_lens)."""
    if not seqs:
        return build_micro_batch([])
    first = seqs[0]
    p = int(first["loss_mask"].argmax())
    shared = [
        j > 0 and int(s["loss_mask"].argmax()) == p and np.array_equal(s["input_ids"][:p], first["input_ids"][:p])
        for j, s in enumerate(seqs)
    ]
    cut = [p if share else 0 for share in shared]
    cat = lambda key: np.concatenate([s[key][n:] for s, n in zip(seqs, cut)])  # noqa: E731
    return MicroBatch(
        input_ids=cat("input_ids"),
        loss_mask=cat("loss_mask"),
        inference_logprobs=cat("inference_logprobs"),
        advantages=cat("advantages"),
        temperatures=cat("temperatures"),
        seq_lens=np.array([len(s["input_ids"]) - n for s, n in zip(seqs, cut)], np.int32),
        sample_ids=np.array([s["sample_id"] for s in seqs], np.int64),
        policy_steps=np.zeros(len(seqs), np.int32),
        prefix_lens=np.array(cut, np.int32),
        parents=np.array([0 if n else -1 for n in cut], np.int32),
    )


def train_batches(step: int, ranks: list[list[list[dict]]]) -> list[TrainBatch]:
    """TrainBatches of `step`: ranks[r] = rank r's micro-batches, each a list of samples."""
    everything = [s for rank in ranks for mb in rank for s in mb]
    tokens = int(sum(s["loss_mask"].sum() for s in everything))
    return [
        TrainBatch(
            step=step,
            rank=r,
            num_ranks=len(ranks),
            micro_batches=[pack(mb) for mb in mbs],
            num_loss_tokens=tokens,
            num_sequences=len(everything),
        )
        for r, mbs in enumerate(ranks)
    ]


def step0_split(vocab: int) -> list[list[list[dict]]]:
    """Step 0 on 2 ranks: rank 0 a row of 2 short samples and a padding row, rank 1 two rows
    of 3 long ones, the first row's three completions of one prompt, laid with the prompt once
    (orchestrator.share_prompts; the reference computes each sample whole). Every rank gets the
    same number of rows, as the orchestrator's packing guarantees (FSDP runs collectives in each
    forward and backward: ranks must take as many)."""
    short = make_sequences(0, 2, (4, 7), vocab)
    group = make_sequences(1, 3, (9, 13), vocab, one_prompt=True)
    long = make_sequences(3, 3, (9, 13), vocab)
    return [[short, []], [group, long]]


def step1_split(vocab: int) -> list[list[list[dict]]]:
    """Step 1 on 1 rank: other samples, two rows."""
    seqs = make_sequences(2, 6, (4, 13), vocab)
    return [[seqs[:3], seqs[3:]]]


# -- the reference: one plain process --------------------------------------------------------


def reference_logprobs(model, s: dict) -> torch.Tensor:
    """pi[t] = log p(token t | tokens < t) at token t's temperature, 0 at t = 0."""
    ids = torch.from_numpy(s["input_ids"].astype(np.int64))
    logits = model.logits(ids[None], torch.arange(len(ids))[None])[0]
    temps = torch.from_numpy(s["temperatures"])
    logp = torch.log_softmax(logits[:-1] / temps[1:, None], dim=-1)
    return torch.cat([logp.new_zeros(1), logp.gather(1, ids[1:, None])[:, 0]])


def reference_step(model, opt, seqs: list[dict], lr: float) -> tuple[float, float, dict]:
    """One step on all `seqs`: (loss, gradient norm before clipping, AdamW's bias-corrected
    sqrt(v) of each parameter after the step)."""
    x = LossInputs(
        logprobs=torch.cat([reference_logprobs(model, s) for s in seqs]),
        inference_logprobs=torch.from_numpy(np.concatenate([s["inference_logprobs"] for s in seqs])),
        advantages=torch.from_numpy(np.concatenate([s["advantages"] for s in seqs])),
        loss_mask=torch.from_numpy(np.concatenate([s["loss_mask"] for s in seqs])),
        seq_lens=torch.tensor([len(s["input_ids"]) for s in seqs]),
    )
    scale = LossScale(tokens=int(x.loss_mask.sum()), sequences=len(seqs))
    loss, _ = compute_loss(x, LossConfig(), scale)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    denom = {}
    for name, p in model.named_parameters():
        state = opt.state[p]
        denom[name] = (state["exp_avg_sq"] / (1 - BETAS[1] ** int(state["step"]))).sqrt()
    return float(loss.detach()), float(norm), denom


def flatten(split) -> list[dict]:
    return [s for rank in split for mb in rank for s in mb]


# -- the runs ---------------------------------------------------------------------------------

TRAINER = TrainerConfig(
    dtype="float32",
    optimizer=OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, max_grad_norm=MAX_GRAD_NORM),
    scheduler=SchedulerConfig(warmup_steps=1),
    checkpoint=CheckpointConfig(interval=1, keep=1),
    weights=WeightsConfig(dtype="float32", keep=2),
)


def run(tmp: Path, name: str, model_dir: Path, run_dir: Path, ranks: int, max_steps: int, feed) -> tuple[list, str]:
    """Launch the trainer on `ranks` ranks; `feed(orch)` talks to it; returns what feed returns and the log."""
    port = free_port_block(ranks + 1)
    cfg = write_trainer_config(
        tmp / f"{name}.toml", model_dir, run_dir, port, max_steps, TRAINER, recv_timeout_s=TIMEOUT_S
    )
    log_file = tmp / f"{name}.log"
    orch = FakeOrchestrator("127.0.0.1", port + 1, port, ranks)
    proc = launch_trainer(cfg, ranks, log_file)
    try:
        got = feed(orch)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"trainer {name} did not exit:\n{log_file.read_text()}")
    finally:
        if proc.poll() is None:
            proc.kill()
        orch.close()
    log = log_file.read_text()
    assert rc == 0, log
    return got, log


def state_of(folder) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_model(folder).state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A (2 ranks, step 0) then run B (1 rank, resumed, step 1), and the reference."""
    tmp = tmp_path_factory.mktemp("exact")
    model_dir = build_tiny_model(tmp / "model", "qwen3", hidden_size=64, num_layers=2, init_std=0.05)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    run_dir = tmp / "run"
    split0, split1 = step0_split(vocab), step1_split(vocab)
    batches0, batches1 = train_batches(0, split0), train_batches(1, split1)

    def feed_a(orch):
        orch.send(batches0)
        return [orch.wait_policy()]

    ready_a, log_a = run(tmp, "a", model_dir, run_dir, ranks=2, max_steps=1, feed=feed_a)
    weights_a = state_of(ready_a[0].location)
    ckpt_a = json.loads((run_dir / "checkpoints" / "step_0" / "meta.json").read_text())
    # What a crash leaves behind: weights published after the last checkpoint (here a copy of
    # step 0's folder as step 7), a history the resumed run leaves.
    shutil.copytree(run_dir / "weights" / "step_0", run_dir / "weights" / "step_7")

    def feed_b(orch):
        restored = orch.wait_policy()  # a resumed trainer first publishes the weights it restored
        restored_exists = Path(restored.location).is_dir()
        restored_state = state_of(restored.location) if restored_exists else None
        orch.send(batches1)
        return [restored, restored_exists, restored_state, orch.wait_policy()]

    (restored, restored_exists, restored_state, ready_b), log_b = run(
        tmp, "b", model_dir, run_dir, ranks=1, max_steps=2, feed=feed_b
    )

    # The reference: one process, both steps, all the data.
    model = load_model(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ref0 = reference_step(model, opt, flatten(split0), lr=LR / 2)  # warm-up: lr (0 + 1) / (1 + 1)
    ref_weights0 = {k: v.clone() for k, v in model.state_dict().items()}
    # Step 1 continues from run A's weights (the optimizer's moments stay the reference's own);
    # the module docstring says why.
    model.load_state_dict(weights_a)
    ref1 = reference_step(model, opt, flatten(split1), lr=LR)
    ref_weights1 = {k: v.clone() for k, v in model.state_dict().items()}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return dict(
        run_dir=run_dir,
        split0=split0,
        rows=rows,
        log_a=log_a,
        log_b=log_b,
        ckpt_a=ckpt_a,
        weights_a=weights_a,
        ready_a=ready_a[0],
        restored=restored,
        restored_exists=restored_exists,
        restored_state=restored_state,
        ready_b=ready_b,
        initial=initial,
        ref=(ref0, ref1),
        ref_weights=(ref_weights0, ref_weights1),
    )


def assert_weights_close(got: dict, want: dict, before: dict, denom: dict, lr: float, what: str) -> None:
    """`got` is the reference's `want` after a step at `lr` from `before`, to the tolerance of
    the module docstring: per element 4 u |w| + lr G_ERR / (sqrt(v) + eps), with `denom` the
    reference's AdamW sqrt(v) after the step, never more than the 2.01 lr two updates can differ."""
    assert got.keys() == want.keys()
    worst, where, tight, total = 0.0, "", 0, 0
    for k in want:
        diff = (got[k] - want[k]).abs()
        tol = (4 * U * want[k].abs() + lr * G_ERR / (denom[k] + ADAM_EPS)).clamp(max=2.01 * lr)
        i = int((diff / tol).argmax())
        if float((diff / tol).flatten()[i]) > worst:
            worst = float((diff / tol).flatten()[i])
            where = (
                f"{k}[{i}]: {float(got[k].flatten()[i]):.9g} vs {float(want[k].flatten()[i]):.9g} "
                f"(was {float(before[k].flatten()[i]):.9g}, sqrt(v) {float(denom[k].flatten()[i]):.3g})"
            )
        tight, total = tight + int((tol <= 1e-6).sum()), total + diff.numel()
        moved = float((want[k] - before[k]).abs().max())
        assert moved > lr / 10, f"{what}: the reference step hardly moved {k} ({moved:.3g}): the comparison is void"
    assert worst <= 1.0, (
        f"{what}: weights differ from the single-process reference by up to {worst:.3g}x the tolerance, at {where}"
    )
    assert tight >= 0.9 * total, f"{what}: only {tight} of {total} elements are held to 1e-6 or better"


@pytest.mark.slow
def test_unequal_token_counts_train_like_one_process_on_the_union(runs):
    """Rank 0 holds 1/4 or less of the loss tokens: the global token normalisation must give
    the loss, the gradient norm and the weights of one process on all the tokens (a mean of
    per-rank means, say, would weigh rank 0's tokens 3x too much and pass with equal counts)."""
    local = [sum(int(s["loss_mask"].sum()) for mb in rank for s in mb) for rank in runs["split0"]]
    assert local[1] >= 3 * local[0], local
    group = runs["split0"][1][0]
    prompt = int(group[0]["loss_mask"].argmax())
    assert pack(group).prefix_lens.tolist() == [0, prompt, prompt]  # rank 1's first row shares its prompt
    (loss, norm, _), _ = runs["ref"]
    row = runs["rows"][0]
    assert row["step"] == 0 and row["trainer/lr"] == pytest.approx(LR / 2, rel=1e-12)
    assert row["trainer/loss"] == pytest.approx(loss, rel=RTOL, abs=1e-7), (row["trainer/loss"], loss)
    assert row["trainer/grad_norm"] == pytest.approx(norm, rel=RTOL), (row["trainer/grad_norm"], norm)
    assert_weights_close(
        runs["weights_a"], runs["ref_weights"][0], runs["initial"], runs["ref"][0][2], LR / 2, "step 0 (2 ranks)"
    )
    assert runs["ckpt_a"]["world_size"] == 2


@pytest.mark.slow
def test_resume_on_one_rank_from_a_two_rank_checkpoint_continues_the_same_run(runs):
    """The 2-rank checkpoint of step 0 is resharded onto 1 rank: the weights it republishes are
    run A's, bit for bit, and step 1 (whose AdamW update depends on the restored moments and
    step count, and whose lr on the restored schedule) is the single-process reference's step 1."""
    assert "written by 2 ranks, resuming on 1" in runs["log_b"], runs["log_b"]
    assert "resumed from" in runs["log_b"]
    assert runs["restored"].step == 0 and runs["restored_exists"], runs["restored"]
    for name, tensor in runs["weights_a"].items():
        assert torch.equal(runs["restored_state"][name], tensor), name
    _, (loss, norm, _) = runs["ref"]
    rows = runs["rows"]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["trainer/lr"] == pytest.approx(LR, rel=1e-12)
    assert rows[1]["trainer/loss"] == pytest.approx(loss, rel=RTOL, abs=1e-7), (rows[1]["trainer/loss"], loss)
    assert rows[1]["trainer/grad_norm"] == pytest.approx(norm, rel=RTOL), (rows[1]["trainer/grad_norm"], norm)
    final = runs["ready_b"]
    assert final.step == 1 and Path(final.location).is_dir(), final
    assert verify(final.location)["checksum"] == final.checksum
    assert_weights_close(
        state_of(final.location),
        runs["ref_weights"][1],
        runs["weights_a"],
        runs["ref"][1][2],
        LR,
        "step 1 (resumed on 1 rank)",
    )
    # checkpoint.keep = 1: step 1's checkpoint replaced step 0's
    assert sorted(p.name for p in (runs["run_dir"] / "checkpoints").iterdir()) == ["step_1"]


@pytest.mark.slow
def test_a_resumed_run_keeps_the_weights_it_announces(runs):
    """Weights published after the last checkpoint (step 7 of a run that then died) are a
    history the resumed run left: with weights.keep = 2 it must not push out the folders the
    run publishes and announces (step 0 again, then step 1), nor stay to be served."""
    names = sorted(p.name for p in (runs["run_dir"] / "weights").iterdir())
    assert names == ["step_0", "step_1"], names


def test_the_publisher_never_prunes_the_folder_it_announces(tmp_path):
    """A resumed run publishes its restored step 3 again while weights of steps 4 and 5 (the
    history it left) are still there: with keep = 2 counting those, the folder of step 3 would
    be removed right after it was written, and the PolicyReady would name a deleted folder."""
    from primerl_models import read_config
    from primerl_trainer.distributed import Dist
    from primerl_trainer.publish import FolderPublisher

    model_dir = build_tiny_model(tmp_path / "model", "qwen3", hidden_size=32, num_layers=1)
    run_dir = tmp_path / "run"
    d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = load_model(model_dir)
    first = FolderPublisher(run_dir, model_dir, read_config(model_dir), 2, torch.float32, d)
    for step in range(6):
        first.publish(model, step)
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_4", "step_5"]
    resumed = FolderPublisher(run_dir, model_dir, read_config(model_dir), 2, torch.float32, d)
    for step in (3, 4):
        ready = resumed.publish(model, step)
        assert verify(ready.location)["step"] == step, step
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_3", "step_4"]
