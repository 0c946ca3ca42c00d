"""Multi-turn rollouts -> training samples, without re-tokenising anything.

Each turn of a rollout carries the exact prompt tokens the model saw and the tokens it sampled.
When a turn's prompt starts with everything before it (the previous sample's prompt and
completions, token for token), the turn extends that sample: the new prompt tokens (tool
output, the user's next message, the chat template's separators) go in with loss mask False,
the completion with loss mask True. When it does not (a chat template that rewrites earlier
turns, e.g. dropping earlier reasoning; a context that was truncated or summarised), a new
sample starts from that turn's full prompt. Either way every sampled token is trained on
exactly once, next to exactly the context it was sampled in.

Images go with their tokens: a turn extends a sample only when its prompt's images start with
the sample's images (the same placeholder tokens can stand for other pictures), and adds the
rest.
"""

from __future__ import annotations

from primerl_protocol.rollouts import Rollout

from primerl_algos.types import Sample


def merge_turns(rollout: Rollout, advantage: float = 0.0) -> list[Sample]:
    """The samples of one rollout (one per run of turns that extend each other)."""
    samples: list[Sample] = []
    tokens: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    images: list = []

    def flush() -> None:
        if tokens:
            samples.append(
                Sample(
                    sample_id=rollout.sample_id,
                    part=len(samples),
                    token_ids=list(tokens),
                    loss_mask=list(mask),
                    inference_logprobs=list(logprobs),
                    advantage=advantage,
                    temperature=rollout.temperature,
                    policy_step=rollout.policy_step,
                    images=list(images),
                )
            )

    for i, turn in enumerate(rollout.turns):
        if len(turn.completion_logprobs) != len(turn.completion_ids):
            raise ValueError(
                f"rollout {rollout.sample_id}, turn {i}: {len(turn.completion_ids)} completion tokens "
                f"but {len(turn.completion_logprobs)} logprobs"
            )
        prompt = turn.prompt_ids
        extends = (
            bool(tokens)
            and len(prompt) >= len(tokens)
            and prompt[: len(tokens)] == tokens
            and turn.images[: len(images)] == images
        )
        new = prompt[len(tokens) :] if extends else prompt
        if not extends:
            flush()
            tokens, mask, logprobs, images = [], [], [], []
        images += turn.images[len(images) :]
        tokens += new + turn.completion_ids
        mask += [False] * len(new) + [True] * len(turn.completion_ids)
        logprobs += [0.0] * len(new) + list(turn.completion_logprobs)
    flush()
    return samples
