"""verifiers traces -> primerl rollouts (and through primerl-algos' merging, training samples).

A trace records every model call (`trace.calls`) and a message graph whose nodes hold the
exact tokens each message added (`node.token_ids`, with `node.mask` True on sampled tokens and
`node.logprobs` for them). Each call becomes one `Turn`: its prompt is every token on the path
from the root to its assistant node plus that node's template scaffold; its completion is the
node's sampled span. `primerl_algos.merging.merge_turns` then joins turns that extend each other
into one sample and starts a new one where the chat template rewrote the history.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from primerl_protocol.images import ImageError
from primerl_protocol.rollouts import BAD_SCORE, TRACEBACK_CHARS, Rollout, Turn

from primerl_envs.compat import BAD_SCORES
from primerl_envs.images import message_images

LIMITS = {"max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens"}
"""verifiers' stop conditions that cut a rollout short (a task's own @stop ends it normally)."""


MAX_LOGPROB = 1e-4
"""Largest logprob accepted from a server (0 up to rounding)."""


class TraceError(ValueError):
    """A trace whose tokens cannot make training data (names the trace and the call)."""


def trace_turns(trace) -> list[Turn]:
    """One Turn per model call of `trace`, in call order, with the images of its prompt."""
    nodes = trace.nodes
    turns: list[Turn] = []
    for index, call in enumerate(trace.calls):
        if call.node is None:
            continue  # a call that failed before committing a message
        node = nodes[call.node]
        mask = node.mask
        sampled = [i for i, m in enumerate(mask) if m]
        if not sampled:
            continue  # nothing sampled (e.g. an empty reply): nothing to train on
        first, last = sampled[0], sampled[-1]
        if last - first + 1 != len(sampled):
            raise TraceError(f"trace {trace.id}, call {index}: sampled tokens are not one contiguous span")
        logprobs = list(node.logprobs or [])
        if len(logprobs) != len(sampled):
            raise TraceError(
                f"trace {trace.id}, call {index}: {len(sampled)} sampled tokens but "
                f"{len(logprobs)} logprobs (was the client a training client?)"
            )
        wrong = next(
            (lp for lp in logprobs if not (isinstance(lp, (int, float)) and math.isfinite(lp) and lp <= MAX_LOGPROB)),
            None,
        )
        if wrong is not None:  # a server's answer is checked like any other input
            raise TraceError(
                f"trace {trace.id}, call {index}: the server gave the logprob {wrong!r}, not a finite number <= 0"
            )
        prefix: list[int] = []
        path: list[int] = []
        parent = node.parent
        while parent is not None:
            path.append(parent)
            parent = nodes[parent].parent
        images = []
        for nid in reversed(path):
            prefix.extend(nodes[nid].token_ids)
            try:
                images += message_images(nodes[nid].message)
            except ImageError as e:
                raise TraceError(
                    f"trace {trace.id}, call {index}: image {len(images) + 1} of the prompt: {e}"
                ) from None
        prefix.extend(node.token_ids[:first])
        turns.append(
            Turn(
                prompt_ids=prefix,
                completion_ids=list(node.token_ids[first : last + 1]),
                completion_logprobs=logprobs,
                images=images,
            )
        )
    return turns


def task_name(trace) -> str:
    """The task of `trace` as errors name it: its key (a content hash unless the taskset names its tasks)."""
    task = getattr(trace, "task", None)
    key = getattr(task, "key", None) or getattr(task, "hash", None)
    return repr(key) if key else "(unnamed)"


def _error_text(errors: Iterable) -> str | None:
    parts = [f"{e.type}: {e.message}" for e in errors]
    if not parts:
        return None
    text = "; ".join(parts)
    return text if len(text) <= 2000 else text[:2000] + "..."


def first_traceback(errors: Iterable) -> str | None:
    """The traceback of the first error that has one (verifiers keeps them for every error but
    a failed model call), cut to TRACEBACK_CHARS characters (both ends kept)."""
    text = next((e.traceback for e in errors if getattr(e, "traceback", None)), None)
    if text is None or len(text) <= TRACEBACK_CHARS:
        return text
    half = TRACEBACK_CHARS // 2
    return f"{text[:half]}\n  ... ({len(text) - 2 * half} characters cut) ...\n{text[-half:]}"


def _scores(trace, errored: bool) -> tuple[dict[str, float], list[str]]:
    """(the trace's named rewards and metrics that are finite numbers, what was wrong with the
    others). Environments are not trusted to return numbers: see compat.install. A reward left
    unscored is only wrong in a trace without errors (an error stops scoring midway)."""
    metrics: dict[str, float] = {}
    bad = list(trace.info.get(BAD_SCORES) or []) if isinstance(trace.info, dict) else []
    for name, reward in trace.rewards.items():
        if reward is None:
            if not errored:
                bad.append(f"reward {name!r} was never scored")
        elif not (math.isfinite(reward.score) and math.isfinite(reward.value)):
            bad.append(f"reward {name!r} is {reward.score!r} (weight {reward.weight!r}), not a finite number")
        else:
            metrics[f"reward/{name}"] = float(reward.score)
    for name, value in trace.metrics.items():
        if value is not None and not math.isfinite(value):
            bad.append(f"metric {name!r} is {value!r}, not a finite number")
        elif value is not None:
            metrics[name] = float(value)
    if not bad and not math.isfinite(trace.reward):
        bad.append(f"the total reward is {trace.reward!r}, not a finite number")
    return metrics, list(dict.fromkeys(bad))  # a NaN recorded for a non-number is named once


def episode_metrics(trace) -> dict[str, float]:
    """How the episode went, for every environment: model turns, tool calls, tool results that
    report an error (by the convention of primerl's harness and toolsets: text that starts with
    "error"), and whether a limit (turns, tokens, time) cut it."""
    assistant = trace.assistant_messages
    errors = 0
    for message in trace.tool_messages:
        content = message.content
        text = content if isinstance(content, str) else " ".join(getattr(p, "text", "") or "" for p in content or [])
        errors += text.lstrip().lower().startswith("error")
    return {
        "episode/turns": float(len(assistant)),
        "episode/tool_calls": float(sum(len(m.tool_calls or []) for m in assistant)),
        "episode/tool_errors": float(errors),
        "episode/cut_by_limit": float(trace.is_timeout or trace.stop_condition in LIMITS),
    }


def trace_to_rollout(
    trace,
    *,
    sample_id: int,
    group_id: int,
    env: str,
    temperature: float = 1.0,
    policy_step: int = 0,
) -> Rollout:
    """A rollout from one finished trace: tokens per turn, reward, metrics, error, truncation.

    A trace that errored (reward function raised, harness failed, time limit) keeps its tokens
    for inspection but carries `error`, so filters drop it before training. So does one whose
    environment scored it with something that is not a finite number (NaN, infinity, text,
    None), with an error of type BadScore naming the environment, the score and the value:
    that rollout never trains, whatever the filters say.
    """
    error = _error_text(trace.errors)
    if error is None and not trace.ok:
        error = "trace did not complete"
    try:
        turns = trace_turns(trace)
    except TraceError as e:
        turns, error = [], f"TraceError: environment {env!r}, task {task_name(trace)}: {e}"
    if error is None and not turns:
        error = "no sampled tokens in the trace (no model call completed)"
    metrics, bad = _scores(trace, errored=error is not None)
    metrics |= episode_metrics(trace)
    if bad:  # first: the filters drop such a rollout even when errored ones are kept
        error = f"{BAD_SCORE}: environment {env!r}: " + "; ".join(bad) + (f"; {error}" if error else "")
    truncated = (
        trace.is_timeout
        or trace.stop_condition in LIMITS
        or any(call.finish_reason == "length" for call in trace.calls)
    )
    return Rollout(
        sample_id=sample_id,
        group_id=group_id,
        turns=turns,
        reward=float(trace.reward) if error is None else 0.0,
        temperature=temperature,
        policy_step=policy_step,
        truncated=truncated,
        error=error,
        traceback=first_traceback(trace.errors) if error is not None else None,
        env=env,
        metrics=metrics,
    )
