"""Samples that share a prompt (orchestrator.share_prompts) train exactly as unshared: a step's
samples packed with each prompt once and its completions after it give the trainer's logprob of
every token, the loss, its metrics and every parameter's gradient of the same samples packed
whole (CPU, fp32), for a dense model, a mixture of experts and GPT-OSS (sliding windows shorter
than the prompts, attention sinks); and a trainer that cannot compute such rows exactly (a
recurrent model, context parallelism, the varlen back-end) refuses them, naming the key.

Tolerances. Both sides compute the same functions in fp32 (u = 6e-8) in other orders: each
completion's attention over its prompt's keys in a padded row of its own or a dense mask, the
prompt's gradient summed over its completions before (not after) it reaches the weights. The
per-token logprobs (|logprob| ~ 2..8, where an ulp is 2.4e-7..4.8e-7) agree to two ulps:
1e-6 plus 1e-6 of their size. A gradient is a sum over ~300 tokens whose terms cancel (a norm
weight's gradient is ~50x smaller than its terms), so its difference, relative to its norm, is
~k u with k up to ~25 here (measured up to 1.4e-6; GPT-OSS's sinks, whose gradient cancels to
8e-4, 1.9e-6 of it but 1.6e-9 absolute): 2e-6 of the norm plus 1e-8 leaves a margin, far
below what a completion that sees another changes (rows whose documents are read from positions
alone, so that each completion sees the prompt and the completions before it: logprobs off by
2e-2 to 2.4e-1, checked by hand).
"""

import numpy as np
import pytest
import torch
from primerl_algos.config import LossConfig
from primerl_algos.losses import LossScale
from primerl_algos.packing import build_batches, build_micro_batch, plan_packing, shared_prompts
from primerl_algos.types import Sample
from primerl_models import Transformer
from primerl_models.families import FAMILIES, TinyShape
from primerl_models.packing import PackedSeqs
from primerl_protocol.config import ModelConfig, TransportConfig
from primerl_trainer.config import ParallelConfig, TrainerConfig, TrainerRunConfig
from primerl_trainer.distributed import Dist
from primerl_trainer.engine import token_logprobs
from primerl_trainer.rl import rl_loss, sharing_problem, validate_batch

VOCAB, ROW = 48, 256
CPU = torch.device("cpu")


SHAPE = TinyShape(
    vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, moe_intermediate_size=16
)


def tiny_args(family: str):
    return FAMILIES[family].args_from_hf(FAMILIES[family].tiny_config(SHAPE))


def tiny(family: str) -> Transformer:
    model = Transformer(tiny_args(family))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    return model


def step_samples(seed: int = 0) -> list[Sample]:
    """Three groups of four (prompts of 9 to 16 tokens, completions of 2 to 11, one of them
    multi-turn: environment tokens, then more trained ones), a group-mate whose prompt differs
    in one token, and a sample of another prompt: what one step of the orchestrator packs."""
    rng = np.random.default_rng(seed)
    out: list[Sample] = []

    def add(prompt: list[int], parts: list[tuple[int, bool]]) -> None:
        ids, mask = list(prompt), [False] * len(prompt)
        for n, trained in parts:
            ids += rng.integers(3, VOCAB, n).tolist()
            mask += [trained] * n
        out.append(
            Sample(
                sample_id=len(out),
                token_ids=ids,
                loss_mask=mask,
                inference_logprobs=[float(-rng.uniform(3, 5)) if m else 0.0 for m in mask],
                advantage=float(rng.standard_normal()),
                temperature=float(rng.choice([0.8, 1.0, 1.2])),
            )
        )

    for g in range(3):
        prompt = rng.integers(3, VOCAB, int(rng.integers(9, 17))).tolist()
        for c in range(4):
            add(prompt, [(int(rng.integers(2, 12)), True)] + ([(3, False), (4, True)] if (g, c) == (1, 2) else []))
        if g == 0:
            add(prompt[:-1] + [(prompt[-1] + 1) % VOCAB], [(5, True)])  # one token differs: not shared
    add(rng.integers(3, VOCAB, 7).tolist(), [(6, True)])
    return out


def train_on(model: Transformer, samples: list[Sample], loss: LossConfig, shared: bool, in_forward: bool = True):
    """The trainer's forward and backward over the samples packed into rows of ROW tokens (with
    or without shared prompts; the loss's gradients in the forward or through the logprobs'
    backward): (per-sample logprobs, loss, metric sums, parameter gradients, row tokens, the rows)."""
    lengths = [len(s) for s in samples]
    plan = plan_packing(lengths, ROW, shared=shared_prompts(samples, ROW) if shared else ())
    (batch,) = build_batches(samples, plan, step=0)
    scale = LossScale(tokens=batch.num_loss_tokens, sequences=batch.num_sequences)
    model.zero_grad(set_to_none=True)
    total, sums, logprobs = 0.0, {}, {}
    for mb in batch.micro_batches:
        value, metrics = rl_loss(loss, scale, CPU, in_forward=in_forward)(model, mb)
        value.backward()
        total += float(value.detach())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        with torch.no_grad():
            pi, _ = token_logprobs(model, mb, CPU)
        at = mb.cu_seqlens()
        for s in range(len(mb.seq_lens)):
            # the sample's tokens from its second on (a row's documents start without context)
            skip = 1 if mb.prefix_lens[s] == 0 else 0
            logprobs[int(mb.sample_ids[s])] = pi[at[s] + skip : at[s + 1]]
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs, total, sums, grads, sum(mb.num_tokens for mb in batch.micro_batches), batch.micro_batches


@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(type="gspo")], ids=["aipo-tokens", "gspo-sequence"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gpt_oss"])
def test_shared_prompts_give_the_unshared_logprobs_loss_and_gradients(family, loss):
    model = tiny(family)
    samples = step_samples()
    # the reference: unshared rows, the loss's gradients through the logprobs' backward; the
    # shared rows with trainer.loss_in_forward's default (in the forward, for a token-local loss)
    want, want_loss, want_sums, want_grads, want_tokens, _ = train_on(
        model, samples, loss, shared=False, in_forward=False
    )
    got, got_loss, got_sums, got_grads, got_tokens, rows = train_on(model, samples, loss, shared=True)

    # rows hold each prompt once: 3 groups of 4 share theirs (3 x 3 prompts fewer)
    assert any(mb.shares_prompts for mb in rows)
    prompts = {s.sample_id: s.loss_mask.index(True) for s in samples}
    saved = sum(prompts[int(mb.sample_ids[i])] for mb in rows for i in np.flatnonzero(mb.prefix_lens))
    assert sum(int(mb.prefix_lens.astype(bool).sum()) for mb in rows) == 9
    assert got_tokens == want_tokens - saved == sum(len(s) for s in samples) - saved

    for s in samples:  # every token the shared row holds, the first after the prompt included
        n = len(got[s.sample_id])
        torch.testing.assert_close(got[s.sample_id], want[s.sample_id][-n:], atol=1e-6, rtol=1e-6)
    assert got_loss == pytest.approx(want_loss, rel=1e-6, abs=1e-9)
    assert got_sums.keys() == want_sums.keys() and got_sums["loss_tokens"] == want_sums["loss_tokens"]
    for k in want_sums:
        assert got_sums[k] == pytest.approx(want_sums[k], rel=1e-5, abs=1e-6), k
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert g.norm() > 0, name
        err = float((got_grads[name] - g).norm())
        assert err <= 2e-6 * float(g.norm()) + 1e-8, (
            f"{name}: the gradient differs from the unshared one by {err:.2g} ({err / float(g.norm()):.2g} of its norm)"
        )


def shared_batch(vocab: int = VOCAB):
    """A TrainBatch of one row whose second sample shares the first's prompt (15 tokens)."""
    samples = step_samples()[:2]
    n = samples[0].loss_mask.index(True)
    row = build_micro_batch(samples, prefix_lens=[0, n], parents=[-1, 0])
    from primerl_protocol import TrainBatch

    return TrainBatch(
        step=0,
        rank=0,
        num_ranks=1,
        micro_batches=[row],
        num_loss_tokens=int(row.loss_mask.sum()),
        num_sequences=2,
    )


def run_config(**trainer) -> TrainerRunConfig:
    return TrainerRunConfig(
        model=ModelConfig(name="tiny"), transport=TransportConfig(trainer_ranks=2), trainer=TrainerConfig(**trainer)
    )


@pytest.mark.parametrize(
    "family, trainer, why",
    [
        ("qwen3_5", {}, "layer 0 mixes tokens with GatedDeltaNet, which is recurrent"),
        ("nemotron_h", {}, "mixes tokens with Mamba2, which is recurrent"),
        ("glm_moe_dsa", {}, "mixes tokens with MLA, which attends over whole documents only"),
        (
            "qwen3",
            {"parallel": ParallelConfig(cp=2)},
            "not split over context-parallel ranks (trainer.parallel.cp = 2)",
        ),
        ("qwen3", {"attention": "varlen"}, "trainer.attention = 'varlen' cannot attend to a shared prompt"),
    ],
)
def test_a_trainer_that_cannot_branch_from_a_prompt_refuses_shared_rows_naming_the_key(family, trainer, why):
    """The batch is refused before anything trains (every rank stops, naming the key to set);
    the model itself refuses such rows too."""
    args = tiny_args(family)
    problem = sharing_problem(run_config(**trainer), args)
    assert problem is not None and why in problem, problem
    d = Dist(rank=0, world_size=1, local_rank=0, device=CPU)
    refused = validate_batch(shared_batch(), 0, d, vocab_size=VOCAB, max_row_tokens=ROW, sharing=problem)
    assert refused is not None
    assert refused.startswith("micro-batch 0, its samples share a prompt (orchestrator.share_prompts), but ")
    assert refused.endswith("set orchestrator.share_prompts = false")
    if not trainer:
        model = Transformer(args)
        mb = shared_batch().micro_batches[0]
        with pytest.raises(ValueError, match="rows whose documents share a prompt cannot be computed exactly"):
            token_logprobs(model, mb, CPU)
    assert sharing_problem(run_config(), tiny_args("gpt_oss")) is None  # windows, sinks: attention all the same


def test_a_shared_prompt_that_is_trained_is_refused():
    """Trained once for all the samples that share it, it would not be the unshared loss."""
    d = Dist(rank=0, world_size=1, local_rank=0, device=CPU)
    batch = shared_batch()
    assert validate_batch(batch, 0, d, vocab_size=VOCAB, max_row_tokens=ROW) is None
    mb = batch.micro_batches[0]
    mb.loss_mask = mb.loss_mask.copy()
    mb.loss_mask[3] = True
    assert validate_batch(batch, 0, d, vocab_size=VOCAB, max_row_tokens=ROW) == (
        "micro-batch 0, sample 1 shares the first 15 tokens of sample 0, and some of them are trained: a shared "
        "prompt must not be"
    )


def test_a_completion_that_continues_its_prompt_is_not_a_new_document():
    """The trainer builds the row's documents from its samples, not from positions (which
    continue from the prompt in a completion): the second sample is a document of its own."""
    mb = shared_batch().micro_batches[0]
    seqs = PackedSeqs.from_segments(mb.seq_lens, mb.prefix_lens, mb.parents)
    assert seqs.num_docs == 2 and seqs.branched
    assert PackedSeqs.from_position_ids(torch.from_numpy(mb.position_ids().astype(np.int64))[None]).num_docs == 1
