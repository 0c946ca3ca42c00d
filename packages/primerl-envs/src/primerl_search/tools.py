"""The search taskset's tools: BM25 over a folder of documents (`bm25s`), served by verifiers
(`python -m primerl_search.tools`) once for the taskset, not once per rollout: the server
indexes each corpus once and answers every rollout's calls, each with the rollout's own state
(its corpus, its counts), which verifiers passes with each call. (Per rollout, each episode
started a server process, ~185 MiB and ~5 s of CPU on the 2-core machine, verifiers imported,
and built its own index of the whole corpus: 256 of each for a step of the search example.)"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import verifiers.v1 as vf

MAX_DOCS = 200_000


class SearchState(vf.State):
    corpus: str = ""
    """The rollout's corpus folder (its task's, set by `SearchTask.setup`)."""
    searches: int = 0
    opens: int = 0
    tool_errors: int = 0


class SearchToolsConfig(vf.ToolsetConfig):
    corpus: str = ""
    """The corpus folder for calls whose rollout state names none (the tools used alone)."""
    top_k: int = 5
    snippet_chars: int = 200
    max_chars: int = 4000


@functools.cache
def load_corpus(folder: str) -> tuple[list[str], list[str]]:
    """(ids, texts) of a corpus folder's documents, in path order (ValueError when it has none)."""
    root = Path(folder)
    paths = sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
    if not paths:
        raise ValueError(f"corpus {folder!r}: no .txt or .md documents")
    if len(paths) > MAX_DOCS:
        raise ValueError(f"corpus {folder!r}: {len(paths)} documents, more than {MAX_DOCS}")
    return [str(p.relative_to(root)) for p in paths], [p.read_text(errors="replace") for p in paths]


@functools.cache
def documents(folder: str) -> dict[str, str]:
    """A corpus's text by document id (built once per process: the taskset's one server answers
    every rollout's calls, so no call rebuilds it or scans the ids)."""
    return dict(zip(*load_corpus(folder)))


@functools.cache
def load_index(folder: str):
    """The BM25 index of a corpus (built once per process)."""
    import bm25s

    _, texts = load_corpus(folder)
    index = bm25s.BM25()
    index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    return index


def search(folder: str, query: str, top_k: int) -> list[tuple[str, float]]:
    """The `top_k` best (doc id, score) for `query`, best first (no document: an empty list)."""
    import bm25s

    ids, _ = load_corpus(folder)
    tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
    ids_of_query = cast(Any, tokens).ids  # tokenize's default (return_ids=True) is a Tokenized(ids, vocab)
    if not any(len(t) for t in ids_of_query):  # nothing but stopwords or punctuation
        return []
    found, scores = load_index(folder).retrieve(tokens, k=min(top_k, len(ids)), show_progress=False)
    return [(ids[int(i)], float(s)) for i, s in zip(found[0], scores[0]) if s > 0]


class SearchTools(vf.Toolset[SearchToolsConfig, SearchState]):
    TOOL_PREFIX = None

    def _corpus(self) -> str:
        corpus = self.state.corpus or self.config.corpus
        if not corpus:
            raise ValueError("search: no corpus (the rollout's state and the toolset's config name none)")
        return corpus

    async def setup(self) -> None:
        if self.config.corpus:
            load_index(self.config.corpus)  # before the first call; a rollout's corpus: at its first call

    @vf.tool
    async def search(self, query: str) -> str:
        """The documents that best match `query`: id, title and the start of the text."""
        self.state.searches += 1
        corpus = self._corpus()
        hits = search(corpus, query, self.config.top_k)
        if not hits:
            return "no documents match"
        by_id = documents(corpus)
        lines = []
        for doc_id, _ in hits:
            title, _, body = by_id[doc_id].partition("\n")
            lines.append(f"[{doc_id}] {title.strip()}: {' '.join(body.split())[: self.config.snippet_chars]}")
        return "\n".join(lines)

    @vf.tool
    async def open(self, doc_id: str) -> str:
        """The text of the document `doc_id` (as `search` names it)."""
        text = documents(self._corpus()).get(doc_id.strip().strip("[]"))
        if text is None:
            self.state.tool_errors += 1
            return f"error: no document {doc_id!r}"
        self.state.opens += 1
        more = f"\n[cut at {self.config.max_chars} characters]" if len(text) > self.config.max_chars else ""
        return text[: self.config.max_chars] + more


if __name__ == "__main__":
    SearchTools.run()
