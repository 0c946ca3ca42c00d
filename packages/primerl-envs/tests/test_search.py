"""The search taskset: BM25 over a local corpus finds each generated question's document first,
the tools answer as the model reads them, answers are graded by SQuAD's exact match and token
F1 (expected values computed by hand), and bad question files are named."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path

import pytest
from primerl_search import (
    SearchTools,
    SearchToolsConfig,
    exact_match,
    extract_answer,
    load_corpus,
    read_questions,
    search,
    token_f1,
)
from primerl_search.generated import _names, write_corpus


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus")), 20, seed=2)


def test_the_document_holding_each_answer_ranks_first(generated):
    corpus = generated[0]["corpus"]
    ids, texts = load_corpus(corpus)
    assert len(ids) == 20 + 11  # a document per person and per town
    for row in generated:
        (best, score), *_ = search(corpus, row["question"], 5)
        name = row["question"].rstrip("?").split()[-1]  # whose document holds the answer
        assert best in (f"people/{name.lower()}.txt", f"towns/{name.lower()}.txt") and score > 0, (row, best)
        assert row["answers"][0] in texts[ids.index(best)]
    assert search(corpus, "the of and", 5) == []  # stopwords only: no query


def test_the_tools_list_hits_and_open_documents(generated):
    corpus = generated[0]["corpus"]
    tools = SearchTools(SearchToolsConfig(corpus=corpus, top_k=3, max_chars=30))
    ids, texts = load_corpus(corpus)
    hits = asyncio.run(tools.search("weaver smith potter baker glassblower tanner cooper mason"))
    assert len(hits.splitlines()) == 3 and hits.startswith("[people/")
    doc = hits.split("]")[0][1:]
    opened = asyncio.run(tools.open(f"[{doc}]"))
    assert opened.startswith(texts[ids.index(doc)][:30]) and opened.endswith("[cut at 30 characters]")
    assert asyncio.run(tools.open("people/nobody.txt")).startswith("error: no document")
    # the taskset's server takes each rollout's corpus from its state; with neither, the call says so
    with pytest.raises(ValueError, match="no corpus"):
        asyncio.run(SearchTools(SearchToolsConfig()).search("weaver"))


def test_grading_by_exact_match_and_token_f1():
    assert exact_match("The Potter.", ["potter"]) == 1.0 and exact_match("potters", ["potter"]) == 0.0
    # "a blue potter" -> ["blue", "potter"] against ["potter"]: precision 1/2, recall 1, F1 2/3
    assert token_f1("a blue potter", ["smith", "potter"]) == pytest.approx(2 / 3)
    assert token_f1("", ["potter"]) == 0.0 and token_f1("x", ["the"]) == 0.0
    assert extract_answer("so \\boxed{x} no, \\boxed{Zorqux}") == "Zorqux"
    assert extract_answer("I think.\nAnswer: Belran\nbye") == "Belran"
    assert extract_answer("Belran") == "Belran"


def test_question_files_load_and_bad_lines_are_named(tmp_path, generated):
    corpus = Path(generated[0]["corpus"])
    row = {"question": "q?", "answers": ["a"], "corpus": str(corpus)}
    good = tmp_path / "q.jsonl"
    good.write_text(json.dumps(row) + "\n")
    assert read_questions(good)[0]["corpus"] == str(corpus)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n" + json.dumps({**row, "answers": []}) + "\n")
    with pytest.raises(ValueError, match=r"(?s)bad.jsonl:2: .*answers.*at least 1 item"):
        read_questions(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt or .md documents"):
        load_corpus(str(tmp_path / "empty"))


def test_names_are_as_before_for_small_counts_and_any_count_ends_distinct(tmp_path):
    # drawn by the 2-3 syllable generator before counts past its 3,600 names were allowed
    assert _names(random.Random(0), 6) == ["Belfirqux", "Firhullun", "Lunhulfir", "Pelbel", "Tikpel", "Vasmodra"]
    got = []  # 5,000 names, and 1,200 questions (4,203 names): both never ended before
    done = threading.Thread(
        target=lambda: got.extend([_names(random.Random(0), 5000), write_corpus(str(tmp_path), 1200)]), daemon=True
    )
    done.start()
    done.join(timeout=60)
    assert not done.is_alive(), "the names ran out"
    names, rows = got
    assert len(set(names)) == 5000
    ids, _ = load_corpus(str(tmp_path))
    assert len(ids) == 1200 + 601 and len(rows) == 1200  # a document per person and per town
