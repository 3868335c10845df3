"""Prompt dataset loading: JSONL / Parquet reading, errors, chat templates, length filtering, shuffling."""

import json
from argparse import Namespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.flags import slime_flags
from transformers import AutoTokenizer

from slime.utils.data import Dataset, load_dataset, read_records

# Renders tools and a custom kwarg, so the tests can see both reach the template.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for tool in tools %} {{ tool['name'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>{% endif %}{% endif %}"
)


def make_args(**overrides) -> Namespace:
    args = slime_flags(
        prompt_data=None,
        input_key="input",
        label_key=None,
        metadata_key="metadata",
        tool_key="tools",
        apply_chat_template=False,
        apply_chat_template_kwargs=None,
        rollout_max_prompt_len=None,
        rollout_seed=42,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


RECORDS = [
    {"input": "What is 1 + 2?", "label": "3", "metadata": {"source": "a", "level": 1}},
    {"input": "What is 10 + 5?", "label": "15", "metadata": {"source": "b", "level": 2}},
    {"input": "the quick brown fox", "label": "dog", "metadata": {"source": "c", "level": 3}},
]


def test_jsonl_and_parquet_give_the_same_samples(tmp_path):
    jsonl = write_jsonl(tmp_path / "data.jsonl", RECORDS)
    parquet = str(tmp_path / "data.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS), parquet)
    args = make_args(label_key="label")

    def summary(path):
        return [(s.prompt, s.label, s.metadata) for s in load_dataset(path, args).samples]

    expected = [(r["input"], r["label"], r["metadata"]) for r in RECORDS]
    assert summary(jsonl) == expected
    assert summary(parquet) == expected
    assert read_records(parquet) == read_records(jsonl) == RECORDS


def test_json_suffix_is_read_as_json_lines_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS[0]) + "\n\n   \n" + json.dumps(RECORDS[1]) + "\n")
    assert read_records(str(path)) == RECORDS[:2]


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    # Line 2 is blank, so the broken record is on physical line 3.
    path.write_text(json.dumps(RECORDS[0]) + "\n\n" + '{"input": "oops",\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 3") as info:
        read_records(str(path))
    assert '{"input": "oops",' in str(info.value)


def test_non_object_jsonl_line_is_rejected(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"line 1: expected a JSON object, got list"):
        read_records(str(path))


def test_missing_file_names_path_and_flag(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl") as info:
        read_records(missing)
    assert "--prompt-data" in str(info.value)
    with pytest.raises(FileNotFoundError, match="--eval-prompt-data aime"):
        read_records(missing, flag="--eval-prompt-data aime")


def test_unsupported_extension_lists_supported_ones(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("input\nhello\n")
    with pytest.raises(ValueError, match=r"\.jsonl.*\.parquet"):
        read_records(str(path))


def test_missing_input_key_names_key_location_and_keys_present(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": "ok"}, {"question": "no input here", "answer": "1"}])
    with pytest.raises(KeyError) as info:
        load_dataset(path, make_args())
    message = str(info.value)
    for part in ["'input'", "data.jsonl", "line 2", "['answer', 'question']", "--input-key"]:
        assert part in message


def test_missing_label_key_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": "ok", "answer": "1"}])
    with pytest.raises(KeyError, match="--label-key"):
        load_dataset(path, make_args(label_key="label"))


def test_input_key_and_messages_prompt(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "data.jsonl", [{"question": messages}, {"question": "plain"}])
    samples = load_dataset(path, make_args(input_key="question")).samples
    # Without --apply-chat-template the prompt stays as the record holds it.
    assert samples[0].prompt == messages
    assert samples[1].prompt == "plain"
    assert samples[0].label is None


def test_metadata_as_dict_or_json_string(tmp_path):
    records = [
        {"input": "a", "metadata": {"k": 1}},
        {"input": "b", "metadata": json.dumps({"k": 2, "nested": [1, 2]})},
        {"input": "c"},
    ]
    samples = load_dataset(write_jsonl(tmp_path / "data.jsonl", records), make_args()).samples
    assert [s.metadata for s in samples] == [{"k": 1}, {"k": 2, "nested": [1, 2]}, {}]


def test_metadata_bad_json_string_names_location(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": "a", "metadata": "{not json"}])
    with pytest.raises(ValueError, match=r"data\.jsonl, line 1: 'metadata' is a string but not valid JSON"):
        load_dataset(path, make_args())


def test_chat_template_matches_tokenizer(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "think"}, {"role": "user", "content": "What is 1 + 2?"}]
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": "What is 12 + 34?"}, {"input": messages}])
    samples = load_dataset(path, make_args(apply_chat_template=True), tokenizer).samples
    as_user = [{"role": "user", "content": "What is 12 + 34?"}]
    assert samples[0].prompt == tokenizer.apply_chat_template(as_user, add_generation_prompt=True, tokenize=False)
    assert samples[1].prompt == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # By hand from the tiny model's template.
    assert samples[0].prompt == "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n"


def test_tools_and_template_kwargs_reach_the_template(tmp_path, tokenizer):
    tokenizer.chat_template = TOOLS_TEMPLATE
    tools = [{"name": "calculator"}, {"name": "search"}]
    records = [{"input": "hi", "tools": tools}, {"input": "hi", "tools": json.dumps(tools)}, {"input": "no tools"}]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    args = make_args(apply_chat_template=True, apply_chat_template_kwargs={"enable_thinking": True})
    samples = load_dataset(path, args, tokenizer).samples
    expected = (
        "<|im_start|>system\ntools: calculator search<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>"
    )
    assert samples[0].prompt == expected
    assert samples[1].prompt == expected
    assert samples[0].metadata["tools"] == tools
    assert samples[2].prompt == "<|im_start|>user\nno tools<|im_end|>\n<|im_start|>assistant\n<think>"
    assert "tools" not in samples[2].metadata


def test_chat_template_needs_tokenizer_with_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": "hi"}])
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        load_dataset(path, make_args(apply_chat_template=True))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        load_dataset(path, make_args(apply_chat_template=True), tokenizer)


def test_max_prompt_len_drops_long_prompts(tmp_path, tokenizer, caplog):
    prompts = ["hi", "What is 12 + 34?", "the quick brown fox jumps over the lazy dog " * 3, "0123456789", "x" * 50]
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": p} for p in prompts])
    templated = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in templated]
    limit = sorted(lengths)[2]  # keeps the three shortest (ties included)
    expected = [t for t, n in zip(templated, lengths) if n <= limit]
    assert 0 < len(expected) < len(prompts)

    with caplog.at_level("INFO", logger="slime.utils.data"):
        dataset = load_dataset(path, make_args(apply_chat_template=True, rollout_max_prompt_len=limit), tokenizer)
    assert [s.prompt for s in dataset.samples] == expected
    assert f"dropped {len(prompts) - len(expected)} of {len(prompts)}" in caplog.text

    # Untemplated message prompts are measured through the template, as the engine will see them.
    message_records = [{"input": [{"role": "user", "content": p}]} for p in prompts]
    path = write_jsonl(tmp_path / "messages.jsonl", message_records)
    dataset = load_dataset(path, make_args(rollout_max_prompt_len=limit), tokenizer)
    assert [s.prompt[0]["content"] for s in dataset.samples] == [p for p, n in zip(prompts, lengths) if n <= limit]

    with pytest.raises(ValueError, match="every prompt .* is longer than --rollout-max-prompt-len=1"):
        load_dataset(path, make_args(rollout_max_prompt_len=1), tokenizer)


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl' holds no records"):
        load_dataset(str(path), make_args())


def test_overrides_replace_args_settings(tmp_path):
    path = write_jsonl(tmp_path / "eval.jsonl", [{"problem": "p", "answer": "a"}])
    dataset = load_dataset(path, make_args(), input_key="problem", label_key="answer")
    assert (dataset.samples[0].prompt, dataset.samples[0].label) == ("p", "a")


def test_shuffle_is_a_deterministic_permutation_per_seed_and_epoch():
    records = [{"input": f"prompt {i}"} for i in range(30)]

    def order(seed, epoch_id):
        dataset = Dataset(records, seed=seed)
        dataset.shuffle(epoch_id)
        return [dataset[i].prompt for i in range(len(dataset))]

    in_file_order = [r["input"] for r in records]
    assert [Dataset(records)[i].prompt for i in range(30)] == in_file_order
    assert sorted(order(42, 0)) == sorted(in_file_order)
    assert order(42, 0) != in_file_order
    assert order(42, 0) == order(42, 0)
    assert order(42, 0) != order(7, 0)
    assert order(42, 0) != order(42, 1)

    # The order of an epoch does not depend on which epochs were shuffled before.
    dataset = Dataset(records, seed=42)
    dataset.shuffle(3)
    dataset.shuffle(0)
    assert [dataset[i].prompt for i in range(30)] == order(42, 0)
