"""Rollouts' images checked against the model before they can train.

The trainer recomputes each image's patches from its pixels (primerl_protocol.images.patchify)
and scatters them over the image's run of placeholder tokens in the prompt that the server
expanded. That holds only when the picture is at a size the model's processor keeps (the
resize is not reproduced) and the server gave it exactly the tokens its size makes. A rollout
whose images break either, or that holds images for a model without a vision tower, gets an
error naming the environment, the task, the turn and the image, and never trains; the run
goes on. A task whose own prompt holds such a picture (or one that does not decode) is refused
before any request: its group's rollouts carry the error and no tokens (`refuse_task_images`).
"""

from __future__ import annotations

import logging

from primerl_envs.images import message_images
from primerl_protocol.images import ImageError, ModelImages, kept_size_problem, tokens_problem
from primerl_protocol.rollouts import Rollout, Turn

log = logging.getLogger("primerl.orchestrator")

IMAGE_ERROR = "ImageError"


def image_problem(turn: Turn, vision: ModelImages | None) -> str | None:
    """What is wrong with the images of `turn` for training, or None."""
    if vision is None:
        return f"the prompt holds {len(turn.images)} images but the model has no vision tower" if turn.images else None
    if vision.image_token_id in turn.completion_ids:
        return f"the model sampled the image token (id {vision.image_token_id}), which stands for no picture"
    return tokens_problem(
        turn.prompt_ids, [(i.height, i.width) for i in turn.images], vision.spec, vision.image_token_id
    )


def check_images(rollouts: list[Rollout], vision: ModelImages | None, env: str, task: str) -> int:
    """Set an ImageError on each rollout of `rollouts` (one task's) whose images cannot train;
    how many were refused."""
    refused = 0
    for rollout in rollouts:
        if rollout.error is not None:
            continue
        for i, turn in enumerate(rollout.turns):
            if (problem := image_problem(turn, vision)) is not None:
                rollout.error = f"{IMAGE_ERROR}: environment {env!r}, task {task}, turn {i}: {problem}"
                rollout.reward = 0.0
                refused += 1
                break
    if refused:
        first = next(r.error for r in rollouts if (r.error or "").startswith(IMAGE_ERROR))
        log.warning("%d rollouts will not train: %s", refused, first)
    return refused


def task_images_problem(task, vision: ModelImages | None) -> str | None:
    """What is wrong with the pictures of `task`'s own prompt (verifiers messages at
    task.data.prompt) for training, or None: one that is not an inline RGB picture, one the
    processor would resize, any for a text model."""
    prompt = getattr(getattr(task, "data", None), "prompt", None)
    if not isinstance(prompt, list):
        return None
    images = []
    for message in prompt:
        try:
            images += message_images(message)
        except ImageError as e:
            return f"image {len(images) + 1} of the prompt: {e}"
    if images and vision is None:
        return f"the prompt holds {len(images)} images but the model has no vision tower"
    for k, image in enumerate(images, 1):
        if vision is not None and (problem := kept_size_problem(image.height, image.width, vision.spec)) is not None:
            return f"image {k} of the prompt: {problem}"
    return None


def refuse_task_images(
    task, vision: ModelImages | None, env: str, name: str, sample_ids: list[int], group_id: int, policy_step: int
) -> list[Rollout] | None:
    """The group's rollouts, each with an ImageError and no tokens (tagged with the policy
    served now, so that the group is not taken for a stale one), when `task`'s prompt holds a
    picture that cannot train (task_images_problem); None otherwise."""
    if (problem := task_images_problem(task, vision)) is None:
        return None
    error = f"{IMAGE_ERROR}: environment {env!r}, task {name}: {problem}"
    log.warning("%d rollouts will not train: %s", len(sample_ids), error)
    return [
        Rollout(sample_id=i, group_id=group_id, turns=[], error=error, env=env, policy_step=policy_step)
        for i in sample_ids
    ]
