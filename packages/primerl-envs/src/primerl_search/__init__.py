"""search: answer a question from a local corpus with search and open tools (BrowseComp-like,
offline).

A corpus is a folder of text documents (`*.txt`, `*.md`; the document's id is its path in the
folder, its title its first line). The toolset (`SearchTools`, one server for the taskset's
rollouts) indexes it with BM25 (`bm25s`), once per corpus, and offers `search(query)` (the
`top_k` best documents: id, title, a snippet) and `open(doc_id)` (the text, cut at
`max_chars`). Tasks come from JSONL (`questions = "path.jsonl"`: `question`, `answers` (a list;
any one counts), `corpus` (relative to the file's folder)), or are generated (`num_tasks = N`:
a corpus of made-up places and people, each fact stated in one document among distractors).

The answer is the last reply's `\\boxed{...}`, else what follows its last "Answer:", else the
whole reply; it is graded against each reference answer after SQuAD's normalisation (lower
case, no punctuation or articles, single spaces) by exact match and token F1 (the best over
the references). Reward: F1 (`reward = "f1"`, the default) or exact match (`"exact"`); both
are metrics, with the searches and opens made.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from pathlib import Path
from typing import Literal

import verifiers.v1 as vf
from primerl_envs.tasks import read_jsonl
from pydantic import Field

from primerl_search.tools import SearchState, SearchTools, SearchToolsConfig, load_corpus, search

__all__ = [
    "SearchData",
    "SearchTaskset",
    "SearchTools",
    "SearchToolsConfig",
    "exact_match",
    "extract_answer",
    "load_corpus",
    "search",
    "token_f1",
]

PROMPT = """Answer the question using the search tools over the document collection: `search` finds \
documents, `open` reads one. Finish with your answer as \\boxed{{answer}}.

Question: {question}"""


def normalize(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact_match(prediction: str, answers: list[str]) -> float:
    return float(any(normalize(prediction) == normalize(a) for a in answers))


def token_f1(prediction: str, answers: list[str]) -> float:
    best = 0.0
    predicted = normalize(prediction).split()
    for answer in answers:
        truth = normalize(answer).split()
        common = sum((Counter(predicted) & Counter(truth)).values())
        if common:
            precision, recall = common / len(predicted), common / len(truth)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def extract_answer(reply: str) -> str:
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", reply)
    if boxed:
        return boxed[-1]
    if "Answer:" in reply:
        rest = reply.rsplit("Answer:", 1)[1].strip()
        return rest.splitlines()[0] if rest else ""
    return reply


class SearchData(vf.TaskData):
    question: str
    answers: list[str] = Field(min_length=1)
    """The reference answers (any one counts)."""
    corpus: str


class SearchTaskConfig(vf.TaskConfig):
    tools: SearchToolsConfig = SearchToolsConfig()
    reward: Literal["f1", "exact"] = "f1"


class SearchTask(vf.Task[SearchData, SearchState, SearchTaskConfig]):
    async def setup(self, trace: vf.Trace, runtime) -> None:
        state = trace.state
        assert isinstance(state, SearchState), "SearchTask's rollouts carry a SearchState"
        state.corpus = self.data.corpus  # the taskset's one tool server reads it with each call

    def _graded(self, trace: vf.Trace) -> tuple[float, float]:
        answer = extract_answer(trace.last_reply or "")
        return exact_match(answer, self.data.answers), token_f1(answer, self.data.answers)

    @vf.metric
    async def answer(self, trace: vf.Trace) -> dict[str, float]:
        em, f1 = self._graded(trace)
        state = trace.state
        return {
            "exact_match": em,
            "f1": f1,
            "searches": float(getattr(state, "searches", 0)),
            "opens": float(getattr(state, "opens", 0)),
            "tool_errors": float(getattr(state, "tool_errors", 0)),
        }

    @vf.reward(weight=1.0)
    async def graded(self, trace: vf.Trace) -> float:
        em, f1 = self._graded(trace)
        config = self.config
        return em if isinstance(config, SearchTaskConfig) and config.reward == "exact" else f1


class SearchConfig(vf.TasksetConfig):
    questions: str | None = None
    """A JSONL file of questions (question, answers, corpus)."""
    num_tasks: int = 100
    """How many generated questions when `questions` is unset."""
    corpus_dir: str | None = None
    """Where the generated corpus goes
    (default: `<temp>/primerl-search-<seed>-<num_tasks>-uid<uid>`, one per user and settings).
    Written whole into a sibling folder and renamed into place; a run that finds it complete
    with the same data reuses it, so runs of the same settings share it and never delete it
    under each other. A folder of other generated data (other settings) is replaced, one with
    files not generated here refused (primerl_envs.folders)."""
    seed: int = 0
    task: SearchTaskConfig = SearchTaskConfig()


class SearchTaskset(vf.Taskset[SearchTask, SearchConfig]):  # pyright: ignore[reportInvalidTypeArguments] (its State is SearchState; verifiers' bound is invariant)
    @classmethod
    def toolsets(cls, config: SearchConfig) -> list[vf.Toolset]:
        """One tool server for the taskset's rollouts (verifiers' taskset-scoped server: each call
        carries its rollout's state), not one a rollout (tools.py says why)."""
        return [SearchTools(config.task.tools)]  # pyright: ignore[reportReturnType] (verifiers' generics are invariant)

    def load(self):
        cfg = self.config
        if cfg.questions:
            rows = read_questions(Path(cfg.questions))
        elif cfg.num_tasks > 0:
            from primerl_search.generated import write_corpus

            rows = write_corpus(cfg.corpus_dir, cfg.num_tasks, cfg.seed)
        else:
            raise ValueError("search: set questions = 'file.jsonl', or num_tasks > 0 generated questions")
        for i, row in enumerate(rows):
            corpus = str(Path(row["corpus"]).resolve())
            load_corpus(corpus)  # a corpus without documents fails here, naming it
            data = SearchData.model_validate(
                {
                    "id": row.get("id") or f"search-{i}",
                    "prompt": PROMPT.format(question=row["question"]),
                    "question": row["question"],
                    "answers": row["answers"],
                    "corpus": corpus,
                }
            )
            yield SearchTask(data, cfg.task)


def read_questions(path: Path) -> list[dict]:
    """The questions of a JSONL file, each checked (a bad line raises ValueError naming it); a
    relative `corpus` is taken from the file's folder."""
    return read_jsonl(path, SearchData, "a search question", relative=("corpus",))
