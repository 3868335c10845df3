"""examples/search-r1: query extraction, BM25 retrieval over the shipped corpus, the exact-match reward, and a
train.py run in which a tiny model taught one search trajectory searches, reads and answers."""

import asyncio
import json
import sys

import pytest
from support.runs import REPO, run_training, saved_samples, small_run_flags
from support.tiny_model import teach_tiny_model
from transformers import AutoTokenizer

from slime.agent.multi_turn import extract_tag
from slime.utils.types import Sample, Status

EXAMPLE = REPO / "examples" / "search-r1"
sys.path.insert(0, str(EXAMPLE))
import generate_with_search  # noqa: E402

QA = [json.loads(line) for line in (EXAMPLE / "qa.jsonl").read_text().splitlines()]
CORPUS = [json.loads(line) for line in (EXAMPLE / "corpus.jsonl").read_text().splitlines()]


def question(row: dict) -> str:
    return row["prompt"][-1]["content"].split("Question: ")[-1]


def test_the_query_is_the_last_complete_search():
    turn = "<think>I need the capital.</think> <search> capital of Australia </search>"
    assert extract_tag(turn, "search") == "capital of Australia"
    assert extract_tag("<think>I know it.</think> <answer> Canberra </answer>", "search") is None
    assert extract_tag("<search> capital of", "search") is None  # cut off before its closing tag


def test_every_answer_of_the_qa_set_is_retrieved_for_its_question():
    assert len(CORPUS) >= 30 and len(QA) >= 10
    for row in QA:
        holding = [p["title"] for p in CORPUS if row["label"].lower() in f"{p['title']} {p['text']}".lower()]
        assert holding, f"no passage holds {row['label']!r}"
        top = generate_with_search.search(question(row), k=3)
        assert any(p["title"] in holding for p in top), (question(row), [p["title"] for p in top])
    # The best passage comes first; a query with no indexed word finds nothing.
    assert generate_with_search.search("deepest lake on Earth")[0]["title"] == "Lake Baikal"
    assert generate_with_search.search("zebra xylophone") == [] and generate_with_search.search("the of") == []


def test_information_lists_the_passages():
    text = generate_with_search.information("chemical symbol of gold")
    assert text.startswith("\n\n<information>Doc 1 (Title: Gold) Gold is a dense") and text.endswith(
        "</information>\n\n"
    )
    assert generate_with_search.information("zebra") == "\n\n<information>No results.</information>\n\n"


def test_reward_is_exact_match_of_the_answer_after_normalization():
    def reward(response: str, label) -> float:
        return asyncio.run(generate_with_search.reward_func(None, Sample(response=response, label=label)))

    assert (
        reward(
            "<search> x </search><information>...</information> <answer> the Amazon river. </answer>", "Amazon River"
        )
        == 1.0
    )
    assert reward("<answer>Canberra</answer>", ["Sydney", "canberra"]) == 1.0
    assert reward("<answer> Sydney </answer> then <answer> Canberra </answer>", "Canberra") == 1.0  # the last one
    assert reward("<answer> Canberra, Australia </answer>", "Canberra") == 0.0  # exact, not contained
    assert reward("Canberra", "Canberra") == 0.0  # no answer tag
    # An answer inside retrieved passages is not the model's.
    assert reward("<information><answer> Canberra </answer></information>", "Canberra") == 0.0


@pytest.mark.slow
def test_train_py_searches_reads_and_answers(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))
    monkeypatch.setenv("SEARCH_R1_TOPK", "1")  # one passage keeps the sequence inside the tiny model's 512 positions
    row = QA[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    search = "<search> capital of Australia </search>"
    information = "\n\n<information>Doc 1 (Title: Canberra) " + CORPUS[2]["text"] + "</information>\n\n"
    answer = "<answer> Canberra </answer>"
    model = teach_tiny_model(
        tiny_model_dir, tmp_path / "model", [(prompt, 0), (search, 1), (information, 0), (answer + "<|im_end|>", 1)]
    )
    data = tmp_path / "qa.jsonl"
    data.write_text((json.dumps(row) + "\n") * 2)
    save = tmp_path / "run"
    history = run_training(
        "train.py", save, *small_run_flags(model, data, save), "--num-rollout", "2",
        "--custom-generate-function-path", "generate_with_search.generate",
        "--custom-rm-path", "generate_with_search.reward_func",
        "--max-turns", "2", "--rollout-max-response-len", "48", "--rollout-temperature", "0.1",
        # The example reads SEARCH_R1_TOPK in the rollout process: the workers of a local cluster inherit this
        # environment, those of a running one (the session cluster, `ray job submit`) only what the job's runtime env
        # says.
        own_cluster=True,
    )  # fmt: skip
    assert [h["rollout_id"] for h in history] == [0, 1] and [h["rollout/reward"] for h in history] == [1.0, 1.0]
    # The trainer's log-probs of the sampled tokens match the engine's only if each turn saw this very sequence.
    assert all(h["train/train_rollout_logprob_max_abs_diff"] <= 1e-4 for h in history)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    expected_mask = [1] * len(ids(search)) + [0] * len(ids(information)) + [1] * len(ids(answer))
    for rollout_id in (0, 1):
        samples = saved_samples(save, rollout_id)
        assert len(samples) == 4
        for s in samples:
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
            assert tokenizer.decode(s.tokens[: -s.response_length]) == prompt
            # Turn 1 stops at </search>, the passage goes in unmasked-out, turn 2 stops at </answer>.
            assert tokenizer.decode(s.tokens[-s.response_length :]) == search + information + answer
            assert s.loss_mask == expected_mask and s.status == Status.COMPLETED
            assert s.reward == 1.0 and s.metadata["search_calls"] == 1
            assert all(lp == 0 for lp, keep in zip(s.rollout_log_probs, s.loss_mask) if not keep)
