"""Is the run training? Errors in the environments' code and steps that train nothing, made
visible, and a run that cannot go on stopped.

    health = Health(max_error_rate=0.5, patience=5)
    health.observe(step, rollouts, metrics)    # after build_step: logs, adds metrics
    reason = health.stop_reason(step, metrics)  # None, or why the run must stop

- Errors: a rollout's error (a reward function that raised, a harness failure, a time limit)
  is one kind per (environment, exception type, where it was raised: the innermost frame of
  its traceback's root cause, the user's line rather than the wrapper verifiers re-raised it
  as). The first of each kind is logged with its whole traceback; later ones are only
  counted, and the counts logged every SUMMARY_STEPS steps, so a reward function that raises
  on every rollout writes one traceback, not thousands. `rollouts/new_error_kinds` counts the
  kinds first seen at a step (`primerl rl` prints a note pointing to the log).
- The stop: a run whose error rate is above `max_error_rate` for `patience` steps in a row
  stops, naming the rate, the setting and the most common error of those steps with its
  traceback (the orchestrator raises it; the trainer is told to stop, `primerl rl` stops the rest).
- Empty steps: `batch/empty_steps` counts the steps in a row up to this one whose batch trains
  nothing (every rollout filtered); a warning naming the filters every EMPTY_STEPS_WARNING.
- `step_summary(metrics)` is the part of the console line both the orchestrator's log and
  `primerl rl` show: the error rate and the rollouts trained and filtered. Nothing heavy is
  imported here: the launcher uses it.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, deque
from dataclasses import dataclass

log = logging.getLogger("primerl.orchestrator")

SUMMARY_STEPS = 10
"""Errors seen again after their first are counted and logged every this many steps."""
MAX_KINDS = 20
"""Error kinds logged with their traceback per environment; more are counted as one."""
EMPTY_STEPS_WARNING = 5
"""Warn after this many steps in a row that train nothing, and again every as many."""
STOP_TRACEBACK_LINES = 12
"""Lines of the traceback the stop message keeps (its end: where the error was raised)."""

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_CHAINED = re.compile(
    r"\n\s*(?:The above exception was the direct cause of the following exception:|"
    r"During handling of the above exception, another exception occurred:)\s*\n"
)
_TYPE = re.compile(r"[A-Za-z_][\w.]*")

HINTS = {
    "zero_advantage": "every group's rewards were equal, so its advantages were 0 (filters.zero_advantage drops "
    "such groups): the tasks may be too hard or too easy for the model, or the reward constant",
    "errored": "every rollout errored: see the tracebacks in the orchestrator's log",
    "bad_score": "the environment scored every rollout with something that is not a finite number",
    "empty": "no rollout sampled a token",
    "longer_than_row": "every sample was longer than seq_len",
}


@dataclass(frozen=True)
class ErrorKind:
    env: str
    type: str
    where: str | None
    """`file:line in function` of the innermost frame of its root cause (a traceback's first)."""

    def __str__(self) -> str:
        return f"environment {self.env!r}: {self.type}" + (f" at {self.where}" if self.where else "")


def root_cause(traceback: str) -> str:
    """The first traceback of a chain: the exception the others were raised from (verifiers
    raises a TaskError from the exception of a reward function that raised)."""
    return _CHAINED.split(traceback, maxsplit=1)[0]


def _exception_line(block: str) -> str | None:
    """The `Type: message` line of one traceback: the first unindented line after its last frame."""
    lines = block.rstrip().splitlines()
    last = max((i for i, line in enumerate(lines) if _FRAME.search(line)), default=-1)
    return next((line for line in lines[last + 1 :] if line and not line[0].isspace()), None)


def kind_of(env: str, error: str, traceback: str | None) -> ErrorKind:
    """The kind of a rollout's error. With a traceback: the type and the innermost frame of its
    root cause (the user's line, not the wrapper's). Without: the text before the error's first
    ':' when that is a name (else its first 60 characters), and no place."""
    if traceback:
        root = root_cause(traceback)
        frames = _FRAME.findall(root)
        line = _exception_line(root)
        head = (line or "").split(":", 1)[0].strip()
        if frames and _TYPE.fullmatch(head):
            path, number, function = frames[-1]
            return ErrorKind(env, head, f"{path}:{number} in {function}")
    head = error.split(":", 1)[0].strip()
    return ErrorKind(env, head if _TYPE.fullmatch(head) else error[:60], None)


def excerpt(traceback: str, lines: int = STOP_TRACEBACK_LINES) -> str:
    """The end of the root cause's traceback (its last `lines` lines) and, for a chain, the
    exception finally raised."""
    root = root_cause(traceback).rstrip().splitlines()
    cut = len(root) - lines
    out = ([f"  ... ({cut} lines above)"] if cut > 0 else []) + root[-lines:]
    if root_cause(traceback) != traceback and (final := _exception_line(traceback.rsplit("\n\n", 1)[-1])):
        out.append(f"which was raised as: {final}")
    return "\n".join(out)


class Health:
    def __init__(self, max_error_rate: float, patience: int) -> None:
        self.max_error_rate, self.patience = max_error_rate, patience
        self.first: dict[ErrorKind, str] = {}
        """Every kind seen, with its first error's traceback (or its message, without one)."""
        self.since_summary: Counter[ErrorKind] = Counter()
        self.recent: deque[Counter[ErrorKind]] = deque(maxlen=patience)
        """The kinds of each of the last `patience` steps."""
        self.high: list[tuple[int, float]] = []
        """(step, error rate) of the steps in a row above max_error_rate, up to the last one."""
        self.empty_steps = 0

    def observe(self, step: int, rollouts: list, metrics: dict[str, float]) -> None:
        """Log the step's new kinds of error (with their tracebacks), the counts every
        SUMMARY_STEPS steps, and a warning when steps in a row train nothing; add
        `rollouts/new_error_kinds` and `batch/empty_steps` to `metrics`."""
        kinds: Counter[ErrorKind] = Counter()
        new = 0
        for r in rollouts:
            if r.error is None:
                continue
            kind = kind_of(r.env, r.error, r.traceback)
            if kind not in self.first and sum(k.env == r.env for k in self.first) >= MAX_KINDS:
                kind = ErrorKind(r.env, "other", None)  # an environment with ever new kinds: counted as one
            kinds[kind] += 1
            if kind in self.first:
                self.since_summary[kind] += 1
                continue
            new += 1
            self.first[kind] = r.traceback or r.error
            shown = r.error if len(r.error) <= 500 else r.error[:500] + "..."
            raised_at = f"raised at {kind.where}; " if kind.where else ""
            log.error(
                "step %d: a rollout of environment %r errored: %s (%sthe first of its kind; later ones are "
                "counted every %d steps)%s",
                step,
                r.env,
                shown,
                raised_at,
                SUMMARY_STEPS,
                f"\n{r.traceback.rstrip()}" if r.traceback else "",
            )
        self.recent.append(kinds)
        metrics["rollouts/new_error_kinds"] = float(new)
        if (step + 1) % SUMMARY_STEPS == 0 and self.since_summary:
            counts = "; ".join(f"{kind}: {n}" for kind, n in self.since_summary.most_common())
            log.warning(
                "rollout errors seen again over the last %d steps (first tracebacks above): %s", SUMMARY_STEPS, counts
            )
            self.since_summary.clear()
        self.empty_steps = self.empty_steps + 1 if not metrics.get("batch/samples") else 0
        metrics["batch/empty_steps"] = float(self.empty_steps)
        if note := empty_steps_note(metrics, step):
            log.warning("%s", note)

    def stop_reason(self, step: int, metrics: dict[str, float]) -> str | None:
        """Why the run must stop after `step`: its error rate and those of the steps before it
        were all above max_error_rate, `patience` steps in a row (None: it goes on)."""
        rate = metrics.get("rollouts/error_rate", 0.0)
        if rate <= self.max_error_rate:
            self.high = []
            return None
        self.high.append((step, rate))
        if len(self.high) < self.patience:
            return None
        window = sum(self.recent, Counter())
        ((kind, count),) = window.most_common(1)
        rates = ", ".join(f"{r:.0%}" for _, r in self.high[-self.patience :])
        first = self.high[-self.patience][0]
        return (
            f"stopping the run: more than {self.max_error_rate:.0%} of the rollouts errored at each of steps "
            f"{first}-{step} ({rates}; orchestrator.max_error_rate = {self.max_error_rate:g} for "
            f"orchestrator.error_patience = {self.patience} steps). The most common error of those steps "
            f"({count} of {sum(window.values())} errored rollouts), {kind}:\n{excerpt(self.first[kind])}"
        )


def empty_steps_note(m: dict[str, float], step: int) -> str | None:
    """A warning when `step` (with metrics `m`) is the EMPTY_STEPS_WARNING-th (2x, 3x, ...) in
    a row that trained nothing, naming the filters that dropped its rollouts."""
    empty = int(m.get("batch/empty_steps", 0))
    if not empty or empty % EMPTY_STEPS_WARNING:
        return None
    reasons = {k.removeprefix("filter/"): v for k, v in m.items() if k.startswith("filter/") and v}
    top = max(reasons, key=lambda k: reasons[k], default=None)
    dropped = ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])) or "nothing"
    return (
        f"{empty} steps in a row trained nothing (step {step}: {m.get('rollouts/count', 0):.0f} rollouts, "
        f"dropped by filter: {dropped})" + (f"; {HINTS[top]}" if top in HINTS else "")
    )


def step_summary(m: dict[str, float]) -> str:
    """'errors 12.5% | trained 14/16': the step's error rate and its rollouts that train (the
    others were filtered or longer than a row); empty when `m` has neither."""
    parts = []
    if "rollouts/error_rate" in m:
        parts.append(f"errors {m['rollouts/error_rate']:.1%}")
    if "rollouts/trained" in m:
        parts.append(f"trained {m['rollouts/trained']:.0f}/{m.get('rollouts/count', 0):.0f}")
    return " | ".join(parts)


def console_notes(m: dict[str, float], log_path: str) -> list[str]:
    """What `primerl rl` prints under a line of metrics.jsonl (`m`, with its `step`): new kinds
    of rollout error (their tracebacks are in `log_path`) and steps in a row that trained nothing."""
    notes = []
    if new := int(m.get("rollouts/new_error_kinds", 0)):
        notes.append(
            f"warning: {new} new kind(s) of rollout error at step {m['step']} (errors "
            f"{m.get('rollouts/error_rate', 0):.1%}); the first traceback of each kind is in {log_path}"
        )
    if empty := empty_steps_note(m, int(m["step"])):  # a whole number (metrics.jsonl's `step`)
        notes.append(f"warning: {empty}")
    return notes
