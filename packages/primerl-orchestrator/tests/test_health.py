"""Errors in environments' code and steps that train nothing (primerl_orchestrator.health):
the first traceback of each kind logged once and the rest counted, the error-rate stop at its
exact edge, and the warning after steps in a row that train nothing, through the real batch
builder (`Orchestrator._build`). The whole loop with a reward function that raises is
test_loop_errors.py."""

import logging
import traceback

import pytest
from primerl_orchestrator.batching import Group, rollout_metrics
from primerl_orchestrator.config import OrchestratorConfig, OrchRunConfig
from primerl_orchestrator.health import EMPTY_STEPS_WARNING, MAX_KINDS, SUMMARY_STEPS, Health, kind_of
from primerl_orchestrator.loop import Orchestrator
from primerl_orchestrator.testing import run_builder
from primerl_protocol.config import ModelConfig
from primerl_protocol.rollouts import Rollout, Turn

TURN = Turn(prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_logprobs=[-0.5, -0.5])


def divide(x):
    return x / 0  # the line a traceback of "zero" ends at


def raised(kind: str) -> tuple[str, str]:
    """(error text as a rollout carries it, traceback) of a real exception."""
    try:
        divide(1) if kind == "zero" else {}["missing"]
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", traceback.format_exc()


def errored(env: str, kind: str, sample_id: int = 0) -> Rollout:
    error, tb = raised(kind)
    return Rollout(sample_id=sample_id, group_id=0, turns=[TURN], error=error, traceback=tb, env=env)


def clean(sample_id: int = 0, reward: float = 1.0) -> Rollout:
    return Rollout(sample_id=sample_id, group_id=0, turns=[TURN], reward=reward, env="a")


def test_the_first_traceback_of_each_kind_is_logged_once_and_the_rest_counted_every_10_steps(caplog):
    health = Health(max_error_rate=1.0, patience=5)
    # each step: 3 ZeroDivisionErrors and 1 KeyError in env a, 2 ZeroDivisionErrors in env b, 2 clean
    step_rollouts = [errored("a", "zero")] * 3 + [
        errored("a", "key"),
        errored("b", "zero"),
        errored("b", "zero"),
        clean(),
        clean(),
    ]
    new_kinds = []
    with caplog.at_level(logging.INFO, logger="primerl.orchestrator"):
        for step in range(2 * SUMMARY_STEPS):
            metrics = {"batch/samples": 2.0}
            health.observe(step, step_rollouts, metrics)
            new_kinds.append(metrics["rollouts/new_error_kinds"])
    assert new_kinds == [3] + [0] * (2 * SUMMARY_STEPS - 1)
    # 120 errors, 3 tracebacks: one per (environment, type, place), each at step 0, with its frame
    firsts = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(firsts) == 3
    shown = sorted(r.getMessage().splitlines()[0] for r in firsts)
    where = f"{__file__}:{divide.__code__.co_firstlineno + 1} in divide"
    assert shown[0] == (
        "step 0: a rollout of environment 'a' errored: KeyError: 'missing' (raised at "
        f"{__file__}:{raised.__code__.co_firstlineno + 3} in raised; the first of its kind; later ones "
        "are counted every 10 steps)"
    )
    assert shown[1].startswith(
        f"step 0: a rollout of environment 'a' errored: ZeroDivisionError: division by zero (raised at {where};"
    )
    assert shown[2].startswith("step 0: a rollout of environment 'b' errored: ZeroDivisionError")
    assert all("Traceback (most recent call last)" in r.getMessage() for r in firsts)
    # the others: counted, one line every 10 steps (after steps 9 and 19), none between
    counts = [(r.getMessage(), r.levelno) for r in caplog.records if r.levelno == logging.WARNING]
    assert len(counts) == 2
    assert counts[0][0] == (
        "rollout errors seen again over the last 10 steps (first tracebacks above): "
        f"environment 'a': ZeroDivisionError at {where}: 29; environment 'b': ZeroDivisionError at {where}: 19; "
        f"environment 'a': KeyError at {__file__}:{raised.__code__.co_firstlineno + 3} in raised: 9"
    )
    assert f"environment 'a': ZeroDivisionError at {where}: 30;" in counts[1][0]


def test_an_environment_with_ever_new_kinds_of_error_logs_at_most_max_kinds_tracebacks(caplog):
    health = Health(max_error_rate=1.0, patience=5)
    rollouts = [
        Rollout(sample_id=i, group_id=0, turns=[], error=f"Error{i}: no", env="a") for i in range(MAX_KINDS + 5)
    ]
    with caplog.at_level(logging.ERROR, logger="primerl.orchestrator"):
        health.observe(0, rollouts, {"batch/samples": 0.0})
    assert len(caplog.records) == MAX_KINDS + 1  # the 21st and later are one kind, "other"
    assert "errored: Error20: no" in caplog.records[-1].getMessage()
    assert kind_of("a", "trace did not complete", None).type == "trace did not complete"


def step_of(n: int, failed: int) -> list[Rollout]:
    """`n` rollouts of which `failed` raised a ZeroDivisionError."""
    return [errored("a", "zero", i) for i in range(failed)] + [clean(i) for i in range(failed, n)]


def test_the_run_stops_after_patience_steps_in_a_row_strictly_above_max_error_rate():
    health = Health(max_error_rate=0.5, patience=3)
    # 12/20 = 60% twice, then exactly 50% (not above: the count starts again), then 60, 60, 75
    verdicts = []
    for step, failed in enumerate([12, 12, 10, 12, 12, 15]):
        rollouts = step_of(20, failed)
        metrics = rollout_metrics(rollouts) | {"batch/samples": 1.0}
        health.observe(step, rollouts, metrics)
        verdicts.append(health.stop_reason(step, metrics))
    assert verdicts[:5] == [None] * 5
    where = f"{__file__}:{divide.__code__.co_firstlineno + 1} in divide"
    assert verdicts[5].startswith(
        "stopping the run: more than 50% of the rollouts errored at each of steps 3-5 (60%, 60%, 75%; "
        "orchestrator.max_error_rate = 0.5 for orchestrator.error_patience = 3 steps). The most common error of "
        f"those steps (39 of 39 errored rollouts), environment 'a': ZeroDivisionError at {where}:\n"
    )
    assert verdicts[5].endswith(
        'return x / 0  # the line a traceback of "zero" ends at\n           ~~^~~\nZeroDivisionError: division by zero'
    )
    # max_error_rate = 1.0: never, even when every rollout errors
    never = Health(max_error_rate=1.0, patience=1)
    rollouts = step_of(4, 4)
    metrics = rollout_metrics(rollouts) | {"batch/samples": 0.0}
    never.observe(0, rollouts, metrics)
    assert metrics["rollouts/error_rate"] == 1.0 and never.stop_reason(0, metrics) is None


def equal_group(group_id: int, reward: float = 1.0, step: int = 0) -> Group:
    """A group of 2 rollouts with equal rewards (zero advantages: the filter drops it), or with
    rewards 1 and 0 when `reward` is None."""
    rewards = [reward, reward] if reward is not None else [1.0, 0.0]
    rollouts = [
        Rollout(sample_id=group_id * 2 + i, group_id=group_id, turns=[TURN], reward=r, policy_step=step, env="toy")
        for i, r in enumerate(rewards)
    ]
    return Group(group_id, "toy", group_id, rollouts)


def build_steps(tmp_path, groups: list[Group]) -> list[dict]:
    """The real builder over `groups` (one a step); each step's metrics as the trainer got them."""
    cfg = OrchRunConfig(
        model=ModelConfig(name="m"),
        seq_len=64,
        max_steps=len(groups),
        run_dir=str(tmp_path),
        orchestrator=OrchestratorConfig(batch_size=2, group_size=2, max_async_level=len(groups)),
    )
    return [batch.metrics for batch in run_builder(Orchestrator(cfg), groups)]


def test_steps_that_train_nothing_are_counted_shown_and_warned_about_after_5_in_a_row(tmp_path, caplog):
    n = 2 * EMPTY_STEPS_WARNING + 1
    groups = [equal_group(g) for g in range(n)] + [equal_group(n, reward=None)]  # the last one trains
    with caplog.at_level(logging.INFO, logger="primerl.orchestrator"):
        metrics = build_steps(tmp_path, groups)
    assert [m["batch/empty_steps"] for m in metrics] == list(range(1, n + 1)) + [0]
    assert all(m["rollouts/trained"] == 0 and m["rollouts/filtered"] == 2 for m in metrics[:-1])
    assert metrics[-1]["rollouts/trained"] == 2 and metrics[-1]["rollouts/filtered"] == 0
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "primerl.orchestrator"
    ]
    assert warnings == [
        f"{k} steps in a row trained nothing (step {k - 1}: 2 rollouts, dropped by filter: zero_advantage 2); every "
        "group's rewards were equal, so its advantages were 0 (filters.zero_advantage drops such groups): the tasks "
        "may be too hard or too easy for the model, or the reward constant"
        for k in (5, 10)
    ]
    # each step's line says what trained
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == n + 1
    assert "| errors 0.0% | trained 0/2 |" in lines[0] and "| errors 0.0% | trained 2/2 |" in lines[-1]


@pytest.mark.parametrize("advantage", ["grpo", "drgrpo", "rloo", "maxrl"])
@pytest.mark.parametrize("zero_advantage", [True, False])
def test_group_size_1_is_refused_at_config_load_and_2_is_accepted(advantage, zero_advantage):
    from primerl_protocol.config import ConfigError, validate

    def load(group_size):
        return validate(
            OrchestratorConfig,
            {
                "batch_size": 8,
                "group_size": group_size,
                "advantage": {"type": advantage},
                "filters": {"zero_advantage": zero_advantage},
            },
        )

    why = (
        "every group is dropped: every step would be empty"
        if zero_advantage
        else "every sample trains with advantage 0: no gradient"
    )
    with pytest.raises(
        ConfigError,
        match=rf'group_size = 1 with advantage.type = "{advantage}" can never train: .*'
        rf"filters.zero_advantage = {str(zero_advantage).lower()} {why}; "
        r"use group_size >= 2",
    ):
        load(1)
    assert load(2).group_size == 2
