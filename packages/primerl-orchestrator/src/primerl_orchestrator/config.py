"""Config section of primerl-orchestrator: the rollout loop and evals."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec
from primerl_algos.config import AdvantageConfig, FilterConfig
from primerl_envs.config import EnvsConfig
from primerl_inference.config import InferenceConfig
from primerl_protocol import rundir
from primerl_protocol.config import Config, ModelConfig, NonNegative, Positive, SharedConfig

UNTRUNCATED = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}
"""The sampling truncations, each switched off (sent explicitly with every training request)."""


class SamplingConfig(Config):
    """Sampling parameters of training rollouts.

    The trainer's importance ratios compare its own logprobs with the ones the servers
    sampled from, so both must describe the same distribution: softmax(logits / temperature)
    over the whole vocabulary. The servers return logprobs after temperature scaling
    (primerl-inference starts vLLM with `--logprobs-mode processed_logprobs`) and every
    request sends top_p = 1, top_k = -1 and min_p = 0 explicitly, so a model's
    generation_config.json cannot truncate the distribution behind the trainer's back.
    Truncated sampling is refused here: the trainer does not model it.
    """

    temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """Sampling temperature (> 0); the trainer computes its logprobs at the same temperature."""
    max_tokens: Positive = 1024
    """Most tokens generated per turn."""
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling threshold: must stay 1.0 for RL (the trainer scores the full distribution)."""
    top_k: int = -1
    """Top-k sampling: must stay -1 (off) for RL, for the same reason."""
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """Min-p sampling: must stay 0.0 (off) for RL, for the same reason."""

    def __post_init__(self) -> None:
        if self.temperature == 0:
            raise ValueError(
                "temperature 0 (greedy) cannot train: every rollout of a group would be the same "
                "(no advantage) and the trainer's logprobs at temperature 0 are undefined; use a "
                "temperature > 0 (greedy evals are set by orchestrator.eval.temperature)"
            )
        truncated = [f"{k} = {getattr(self, k)}" for k, off in UNTRUNCATED.items() if getattr(self, k) != off]
        if truncated:
            raise ValueError(
                f"{', '.join(truncated)}: truncated sampling is not supported for RL: the servers would "
                "sample from (and report logprobs of) a truncated distribution while the trainer scores "
                "the full one at the same temperature, so every importance ratio would be wrong; "
                "leave top_p = 1.0, top_k = -1 and min_p = 0.0 and tune the temperature instead"
            )

    def request(self) -> dict[str, float | int]:
        """What every training request sends: the temperature and the truncations, all off."""
        return {"temperature": self.temperature, **UNTRUNCATED}


class EvalSettings(Config):
    """Online evals during training, and the defaults of `primerl eval`."""

    interval: NonNegative = 0
    """Run the eval environments every this many steps (0: never during training)."""
    num_samples: Positive = 1
    """Rollouts per eval task (k of avg@k and pass@k)."""
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Sampling temperature for evals."""
    max_tokens: Positive | None = None
    """Most tokens generated per turn in evals (default: orchestrator.sampling.max_tokens, or
    1024 for `primerl eval`)."""
    max_tasks: Positive | None = None
    """Evaluate on the first this many tasks of each eval environment (default: all of them;
    needed for endless tasksets)."""
    pass_threshold: float = 1.0
    """A rollout with at least this reward counts as solving its task (pass@k)."""

    def __post_init__(self) -> None:
        # Refused rather than sampled k times greedily: k greedy rollouts are one answer k times,
        # so avg@k and pass@k would only repeat pass@1 under another name (and vLLM refuses a
        # group's one request with n > 1 at temperature 0: every rollout errored).
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(
                f"num_samples = {self.num_samples} with temperature = 0 (greedy): the {self.num_samples} rollouts of "
                f"a task would all be the same answer, so avg@{self.num_samples} and pass@{self.num_samples} would "
                f"only repeat pass@1; set temperature > 0 (e.g. 1.0) to sample {self.num_samples} different "
                "rollouts, or num_samples = 1 for a greedy eval"
            )


class SamplesConfig(Config):
    """Rollouts kept as text for people to read (run_dir/orchestrator/rollouts.jsonl, W&B table).

    Each line of the file: prompt, completion, rewards, advantage, policy step, error (a
    primerl_protocol.rollouts.RolloutSample); with W&B on, the same rows are the run's
    `samples` table at that step."""

    interval: NonNegative = 10
    """Keep samples of every this many steps' rollouts, from step 0 (0: never)."""
    num_groups: Positive = 2
    """Groups kept per such step (each with all of its group_size rollouts)."""
    max_mb: Annotated[float, msgspec.Meta(gt=0)] = 100.0
    """Most megabytes the rollouts files take: when rollouts.jsonl reaches half of it, it
    becomes rollouts.old.jsonl (replacing the older one) and a new one starts."""


class OrchestratorConfig(Config):
    """The asynchronous rollout loop."""

    batch_size: Positive = 256
    """Rollouts per trainer step (tasks per step x group_size)."""
    group_size: Positive = 8
    """Rollouts per task; advantages compare rollouts within a group."""
    max_async_level: NonNegative = 1
    """Batches are built only from rollouts of policies at most this many steps old (0: on-policy)."""
    max_in_flight: Positive = 512
    """Most rollouts in flight across all inference servers."""
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    """Sampling parameters of training rollouts."""
    advantage: AdvantageConfig = msgspec.field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    filters: FilterConfig = msgspec.field(default_factory=FilterConfig)
    """Rollout and group filters."""
    eval: EvalSettings = msgspec.field(default_factory=EvalSettings)
    """Online evals."""
    max_retries: NonNegative = 2
    """Times a rollout is run again on another server when its server failed."""
    send_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    """Longest wait for the trainer to take a batch before the orchestrator gives up."""
    max_error_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    """Stop the run when more than this share of a step's rollouts errored (a reward function
    that raised, a harness failure, a time limit, a server that failed after its retries) for
    `error_patience` steps in a row, naming the most common error and its traceback (1.0: never)."""
    error_patience: Positive = 5
    """Steps in a row above `max_error_rate` before the run stops."""
    samples: SamplesConfig = msgspec.field(default_factory=SamplesConfig)
    """Rollouts kept as text (the rollouts file and the W&B samples table)."""
    share_prompts: bool | None = None
    """Pack the samples of one prompt (a group's completions) as that prompt once and each
    completion after it, attending to the prompt and to itself only: the trainer computes each
    prompt once instead of group_size times, with the same logprobs, loss and gradients
    (docs/algorithms.md, "Shared prompts"). Exact only where every layer's mixer is attention:
    refused for models with recurrent layers (Qwen3.5, Nemotron-H) or MLA (GLM-5), with
    trainer.parallel.cp > 1 and with trainer.attention = "varlen". Unset: `primerl rl` (and
    --slurm) turn it on where it is exact, off elsewhere; an orchestrator started on its own
    packs unshared."""

    def __post_init__(self) -> None:
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
        if self.group_size == 1:
            # compute_advantages gives a group whose rewards are all equal zero advantages, under
            # every estimator (plugins too): a group of one always is.
            zero = self.filters.zero_advantage
            raise ValueError(
                f'group_size = 1 with advantage.type = "{self.advantage.type}" can never train: advantages '
                "compare the rollouts of a group, so a group of one rollout has advantage 0, and with "
                + (
                    "filters.zero_advantage = true every group is dropped: every step would be empty"
                    if zero
                    else "filters.zero_advantage = false every sample trains with advantage 0: no gradient"
                )
                + "; use group_size >= 2 (and batch_size a multiple of it)"
            )


class OrchRunConfig(SharedConfig):
    """The orchestrator's root config (`primerl-orch`; `primerl_orchestrator.loop.Orchestrator`)."""

    orchestrator: OrchestratorConfig = msgspec.field(default_factory=OrchestratorConfig)
    """Rollout loop: batch and group size, off-policy bound, sampling, advantages, filters."""
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    """Where the inference servers are."""
    envs: EnvsConfig = msgspec.field(default_factory=EnvsConfig)
    """Training and eval environments."""


class EvalRunConfig(SharedConfig):
    """The root config of evals outside a run (`primerl_orchestrator.evals.eval_run`)."""

    UNUSED: ClassVar[tuple[str, ...]] = ("max_steps", "transport", "wandb", "envs.train", "eval.interval")
    """Keys this root shares with a run's configs (so that one file serves both) that evals never
    read; `--help` and docs/config-reference.md mark them."""

    model: ModelConfig | None = None
    """The model to evaluate (policy 0); with `run` and no model, the run's own.
    The run's model is read from RUN/configs/rl.toml, which `primerl rl` writes."""
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    """vLLM servers that generate the eval rollouts."""
    envs: EnvsConfig = msgspec.field(default_factory=EnvsConfig)
    """The eval environments (`envs.eval`)."""
    eval: EvalSettings = msgspec.field(default_factory=EvalSettings)
    """Samples per task and sampling temperature."""
    run: str | None = None
    """Evaluate each published step in this run directory (RUN/weights/step_N) instead of `model`."""

    def __post_init__(self) -> None:
        """What `primerl eval` needs, checked when the config loads, before any server starts."""
        if not self.envs.eval:
            raise ValueError("envs.eval: no eval environments: add at least one [[envs.eval]] entry")
        if self.model is None:
            if self.run is None:
                raise ValueError(
                    "model.name: no model to evaluate: set model.name, or run = RUN_DIR to evaluate "
                    "the steps a run published (on the run's model)"
                )
            table, source = rundir.run_model(self.run)
            try:
                self.model = msgspec.convert(table, ModelConfig)
            except msgspec.ValidationError as err:
                raise ValueError(f"model: the run's [model] in {source} is not a model config ({err})") from None
