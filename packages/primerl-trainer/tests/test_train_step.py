"""What one `Session.train_step` changes, on the real session (FSDP2 on a one-rank gloo group in
this process, CPU, fp32, tiny models written to disk):

- the vision tower of a vision-language model trains with `trainer.freeze_vision = false` (its
  parameters get gradients, are in the optimizer and move) and stays as it was with true;
- a step whose loss is finite but whose gradient norm is not takes no optimizer step: weights,
  AdamW's state and the schedule are unchanged, the step is counted as skipped, and the next
  step trains as usual.
"""

import base64
import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from primerl_algos.types import Sample
from primerl_models.tiny import build_tiny_model, build_tiny_vlm
from primerl_protocol.config import ModelConfig, TransportConfig, WandbConfig
from primerl_protocol.images import ModelImages
from primerl_trainer.config import (
    CheckpointConfig,
    OptimizerConfig,
    SchedulerConfig,
    SFTDataConfig,
    SFTRunConfig,
    TrainerConfig,
    WeightsConfig,
)
from primerl_trainer.engine import Session
from primerl_trainer.sft import my_rows, nll_loss
from primerl_trainer.sft_data import load_samples
from primerl_trainer.testing import free_port_block
from torch.distributed.tensor import DTensor

ROW_TOKENS = 256


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank gloo group for the sessions of a test, torn down afterwards (environment restored)."""
    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_block(1))
    ).items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def session(folder, run_dir, **trainer) -> Session:
    """An SFT session on `folder` (fp32, no checkpoints); `trainer`: TrainerConfig fields."""
    trainer = {"optimizer": OptimizerConfig(lr=1e-2, weight_decay=0.0), **trainer}
    cfg = SFTRunConfig(
        model=ModelConfig(name=str(folder)),
        seq_len=ROW_TOKENS,
        max_steps=4,
        run_dir=str(run_dir),
        transport=TransportConfig(trainer_ranks=1),
        wandb=WandbConfig(mode="disabled"),
        data=SFTDataConfig(path="unused"),
        trainer=TrainerConfig(
            dtype="float32", checkpoint=CheckpointConfig(interval=0), weights=WeightsConfig(dtype="float32"), **trainer
        ),
    )
    return Session(cfg, job="sft")


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def weights(s: Session) -> dict[str, torch.Tensor]:
    return {name: whole(p) for name, p in s.model.named_parameters()}


def gradients_at_the_optimizer_step(s: Session) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient as AdamW is about to step (filled in by train_step)."""
    grads = {}

    def hook(_opt, _args, _kwargs):
        grads.update({name: None if p.grad is None else whole(p.grad) for name, p in s.model.named_parameters()})

    s.opt.register_step_pre_hook(hook)
    return grads


# -- the vision tower ----------------------------------------------------------------------


def png_url(side: int, seed: int) -> str:
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_rows(path, vlm_dir, s: Session):
    """This rank's rows of two image + text samples (256 x 256: the smallest square the tiny
    VLM's processor keeps), as `primerl sft` reads them, and their loss tokens."""
    import transformers

    rows = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "ab "},
                        {"type": "image_url", "image_url": {"url": png_url(256, seed)}},
                        {"type": "text", "text": " cd"},
                    ],
                },
                {"role": "assistant", "content": "bad"},
            ]
        }
        for seed in range(2)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    samples, _ = load_samples(str(path), tokenizer, ROW_TOKENS, ModelImages(s.image_spec, s.args.vision.image_token_id))
    assert all(sample.images for sample in samples)
    return my_rows(samples, ROW_TOKENS, 0, 1)


def vision_step(tmp_path, vlm_dir, freeze: bool):
    """One SFT step on image rows: (tower parameter names, weights before, gradients at the
    optimizer step, weights after, names of the optimizer's parameters)."""
    s = session(vlm_dir, tmp_path / f"run-{freeze}", freeze_vision=freeze)
    rows, tokens = image_rows(tmp_path / f"d-{freeze}.jsonl", vlm_dir, s)
    optimized = {id(p) for group in s.opt.param_groups for p in group["params"]}
    in_optimizer = {name for name, p in s.model.named_parameters() if id(p) in optimized}
    before, grads = weights(s), gradients_at_the_optimizer_step(s)
    stats = s.train_step(rows, nll_loss(tokens, s.d.device, None, s.image_spec))
    assert stats["step_skipped"] == 0 and np.isfinite(stats["loss"])
    after = weights(s)
    s.metrics.close()
    tower = [name for name in before if name.startswith("visual.")]
    assert tower
    return tower, before, grads, after, in_optimizer


def test_freeze_vision_false_trains_the_tower_and_true_leaves_it(tmp_path, one_rank):
    vlm_dir = build_tiny_vlm(tmp_path / "vlm", tokenizer="chars", alphabet="abcdefghij :")
    tower, before, grads, after, in_optimizer = vision_step(tmp_path, vlm_dir, freeze=False)
    text = [name for name in before if name.startswith("layers.") and name.endswith("proj.weight")]
    assert text
    for name in tower:
        assert name in in_optimizer, name
        assert grads[name] is not None and bool(grads[name].abs().sum() > 0), f"{name}: no gradient"
        assert not torch.equal(before[name], after[name]), f"{name} did not move"
    for name in text:
        assert not torch.equal(before[name], after[name]), name

    tower, before, grads, after, in_optimizer = vision_step(tmp_path, vlm_dir, freeze=True)
    for name in tower:
        assert name not in in_optimizer and grads[name] is None, name
        assert torch.equal(before[name], after[name]), f"{name} moved while frozen"
    for name in text:
        assert not torch.equal(before[name], after[name]), name  # the rest still trains


# -- a non-finite gradient norm --------------------------------------------------------------


class InfiniteGradient(torch.autograd.Function):
    """The identity forward; backward, the incoming gradient times inf (`everywhere`) or with its
    first element set to +inf."""

    @staticmethod
    def forward(ctx, x, everywhere: bool):
        ctx.everywhere = everywhere
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.everywhere:
            return grad * float("inf"), None
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad, None


def nan_norm(loss_fn):
    """The same loss; its gradient inf, which the model's backward turns into NaNs (inf - inf)."""

    def fn(model, mb):
        loss, metrics = loss_fn(model, mb)
        return InfiniteGradient.apply(loss, True), metrics

    return fn


@contextlib.contextmanager
def inf_norm(s: Session):
    """One element of the embeddings' output gets gradient +inf: the embedding table's gradient
    (a scatter-add of those rows) holds an inf and no NaN, so the norm is +inf."""
    handle = s.model.embed_tokens.register_forward_hook(lambda _m, _args, out: InfiniteGradient.apply(out, False))
    try:
        yield
    finally:
        handle.remove()


def text_rows(vocab: int):
    rng = np.random.default_rng(3)
    samples = []
    for i in range(6):
        n = int(rng.integers(8, 20))
        samples.append(
            Sample(
                sample_id=i,
                token_ids=rng.integers(3, vocab, n).tolist(),
                loss_mask=[False] * 3 + [True] * (n - 3),
                inference_logprobs=[0.0] * n,
            )
        )
    return my_rows(samples, 64, 0, 1)


def optimizer_state(s: Session) -> dict:
    return {
        (name, key): whole(v) for name, p in s.model.named_parameters() for key, v in s.opt.state.get(p, {}).items()
    }


def test_a_finite_loss_with_a_non_finite_gradient_norm_takes_no_optimizer_step(tmp_path, one_rank):
    folder = build_tiny_model(tmp_path / "model", "qwen3", hidden_size=32, num_layers=2)
    # warm-up: the schedule moves the learning rate at every step it takes
    s = session(folder, tmp_path / "run", scheduler=SchedulerConfig(warmup_steps=3))
    rows, tokens = text_rows(s.args.vocab_size)
    loss_fn = nll_loss(tokens, s.d.device)

    first = s.train_step(rows, loss_fn)
    assert first["step_skipped"] == 0 and np.isfinite(first["grad_norm"])
    w0, state0, lr0, sched0 = weights(s), optimizer_state(s), s.sched.get_last_lr(), s.sched.last_epoch
    assert state0 and all(int(v) == 1 for (_, key), v in state0.items() if key == "step")

    # two bad steps: a gradient norm of +inf, then one of NaN
    with inf_norm(s):
        bad = [s.train_step(rows, loss_fn)]
    bad.append(s.train_step(rows, nan_norm(loss_fn)))
    assert math.isinf(bad[0]["grad_norm"]) and math.isnan(bad[1]["grad_norm"])
    for k, stats in enumerate(bad, start=1):
        assert np.isfinite(stats["loss"]) and stats["loss"] < first["loss"]  # the loss after one step
        assert stats["step_skipped"] == 1 and stats["steps_skipped"] == k
    assert s.steps_skipped == 2
    w1, state1 = weights(s), optimizer_state(s)
    assert all(torch.equal(w0[n], w1[n]) for n in w0), [n for n in w0 if not torch.equal(w0[n], w1[n])]
    assert state1.keys() == state0.keys() and all(torch.equal(state0[k], state1[k]) for k in state0)
    assert s.sched.last_epoch == sched0 and s.sched.get_last_lr() == lr0
    assert all(p.grad is None for p in s.model.parameters())  # nothing left over for the next step

    # the next step trains as if the bad ones had not happened: the same loss as they saw,
    # AdamW's second step at the schedule's second value
    good = s.train_step(rows, loss_fn)
    assert good["step_skipped"] == 0 and good["steps_skipped"] == 2 and np.isfinite(good["grad_norm"])
    assert good["loss"] == bad[0]["loss"] == bad[1]["loss"] and good["lr"] == lr0[0]
    assert all(int(v) == 2 for (_, key), v in optimizer_state(s).items() if key == "step")
    assert any(not torch.equal(w0[n], whole(p)) for n, p in s.model.named_parameters())
    s.metrics.close()
