"""Search-R1 on slime: the model searches a local BM25 index while it answers, and is rewarded for the right answer.

    --custom-generate-function-path generate_with_search.generate
    --custom-rm-path generate_with_search.reward_func

A turn that ends with `<search> query </search>` gets the top passages back as `<information> ... </information>`
(loss mask 0) and the model goes on; a turn with `<answer> ... </answer>`, or none of the two, ends the sample.
The loop, the context budget and `--max-turns` come from `slime.agent.multi_turn`.

The index is built once per process with `bm25s` from `corpus.jsonl` next to this file (one
`{"id", "title", "text"}` per line); `SEARCH_R1_CORPUS` points at another one, `SEARCH_R1_TOPK` sets how many
passages come back (default 3).
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path

import bm25s

from slime.agent.multi_turn import append_observation, extract_tag, model_turn, start_episode
from slime.rollout.rm_hub.f1 import normalize_text
from slime.utils.types import Sample

CORPUS = Path(os.environ.get("SEARCH_R1_CORPUS", Path(__file__).with_name("corpus.jsonl")))
TOP_K = int(os.environ.get("SEARCH_R1_TOPK", "3"))
# Turns stop right after an action; the default rollout sends no_stop_trim, so the closing tag stays in the text.
STOP = ["</search>", "</answer>"]


@functools.cache
def _index(path: Path) -> tuple[bm25s.BM25, list[dict]]:
    if not path.is_file():
        raise FileNotFoundError(f"search corpus {path} not found; set SEARCH_R1_CORPUS to a JSONL file of passages")
    passages = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize([f"{p['title']} {p['text']}" for p in passages], show_progress=False), show_progress=False
    )
    return retriever, passages


def search(query: str, k: int = TOP_K) -> list[dict]:
    """The `k` passages of the corpus that match `query` best (BM25), best first."""
    retriever, passages = _index(CORPUS)
    tokens = bm25s.tokenize([query], show_progress=False)
    if not tokens.vocab:  # only stop words: nothing to match
        return []
    ids, scores = retriever.retrieve(tokens, k=min(k, len(passages)), show_progress=False)
    return [passages[i] for i, score in zip(ids[0], scores[0]) if score > 0]


def information(query: str) -> str:
    """The observation for a search: the passages, numbered, inside `<information>`."""
    found = search(query)
    docs = "\n".join(f"Doc {n} (Title: {p['title']}) {p['text']}" for n, p in enumerate(found, 1)) or "No results."
    return f"\n\n<information>{docs}</information>\n\n"


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """Custom generate function: model turns and searches until an answer, `--max-turns` or the context runs out."""
    episode = start_episode(args, sample)
    params = {**sampling_params, "stop": [*(sampling_params.get("stop") or []), *STOP]}
    searches = 0
    while not episode.done:
        text = await model_turn(args, episode, params)
        query = extract_tag(text, "search")
        if query is None or extract_tag(text, "answer") is not None or episode.done:
            break
        started = time.perf_counter()
        observation = information(query)
        sample.non_generation_time += time.perf_counter() - started
        searches += 1
        if not append_observation(episode, observation):
            break
    sample.metadata = {**sample.metadata, "search_calls": searches}
    return sample


def model_text(response: str) -> str:
    """The response without the `<information>` blocks the search put in."""
    return re.sub(r"<information>.*?</information>", "", response, flags=re.DOTALL)


def exact_match(prediction: str | None, label: str | list[str]) -> float:
    """1.0 when `prediction` equals the label (or one of the labels) after SQuAD normalization, else 0.0."""
    labels = label if isinstance(label, list) else [label]
    if prediction is None:
        return 0.0
    return float(any(normalize_text(prediction) == normalize_text(str(answer)) for answer in labels))


async def reward_func(args, sample: Sample, **kwargs) -> float:
    """Exact match of the model's last `<answer>` with `sample.label`."""
    return exact_match(extract_tag(model_text(sample.response), "answer"), sample.label)
