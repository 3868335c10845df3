"""SFT rollout: assistant-only loss masks from the chat template, its errors, and an SFT run of train.py on CPU."""

import os
import subprocess
from pathlib import Path

import pytest
from support.sft import CONVERSATION, expected_tokens_and_mask, initial_sft_loss, write_conversations
from transformers import AutoTokenizer

from slime.ray.rollout import samples_to_train_data
from slime.rollout.sft_rollout import generate_rollout, load_chat_tokenizer
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.mask_utils import tokenize_conversation
from slime.utils.misc import load_function
from slime.utils.types import Status

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


# Like Qwen3's template: only the final assistant turn gets an (empty) think block.
LAST_TURN_THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.last %}"
    "<|im_start|>assistant\n<think></think>{{ message['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def masked_runs(tokens, mask):
    """The maximal runs of tokens with mask 1, in order."""
    runs, current = [], []
    for token, keep in zip(tokens, mask, strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[:6]], ids=["ends-with-assistant", "ends-with-tool"])
def test_mask_is_one_exactly_on_assistant_turns(tokenizer, messages):
    tokens, mask, response = tokenize_conversation(tokenizer, messages)
    assert (tokens, mask) == expected_tokens_and_mask(tokenizer, messages)
    # The sequence is the template's rendering of the whole conversation, tokenized as one text.
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokens == tokenizer(full, add_special_tokens=False)["input_ids"]
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(run) for run in masked_runs(tokens, mask)] == [f"{c}<|im_end|>\n" for c in assistant]
    assert response == full[full.index(assistant[0]) :]


def test_tool_definitions_and_template_kwargs_reach_the_template(tokenizer):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\n{{ tools[0]['name'] }}{{ suffix }}<|im_end|>\n{% endif %}"
        + tok.chat_template
    )
    messages = CONVERSATION[1:3]
    tokens, mask, _ = tokenize_conversation(
        tok, messages, tools=[{"name": "calc"}], chat_template_kwargs={"suffix": "!"}
    )
    system = tok("<|im_start|>system\ncalc!<|im_end|>\n", add_special_tokens=False)["input_ids"]
    plain_tokens, plain_mask = expected_tokens_and_mask(tok, messages)
    assert tokens == system + plain_tokens and mask == [0] * len(system) + plain_mask


def test_last_turn_think_template_masks_each_turn_as_rendered(tokenizer):
    """A Qwen3-like template adds <think></think> to the final assistant turn only: every turn is trained as it
    appears in the whole conversation."""
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = LAST_TURN_THINK_TEMPLATE
    tokens, mask, _ = tokenize_conversation(tok, CONVERSATION[:3])
    assert tok.decode(masked_runs(tokens, mask)[0]) == "<think></think>The answer is \\boxed{46}.<|im_end|>\n"
    tokens, mask, _ = tokenize_conversation(tok, CONVERSATION)
    assert [tok.decode(run) for run in masked_runs(tokens, mask)] == [
        "The answer is \\boxed{46}.<|im_end|>\n",
        "3<|im_end|>\n",
        "<think></think>the quick brown fox<|im_end|>\n",
    ]


def sft_args(model_dir, data_path, *extra):
    return parse_args([
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(data_path), "--input-key", "messages",
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--rollout-batch-size", "2", "--num-rollout", "2", "--loss-type", "sft_loss",
        "--disable-compute-advantages-and-returns", "--debug-train-only", *extra,
    ])  # fmt: skip


def make_data_source(args):
    return load_function(args.data_source_path)(args)


def test_rollout_returns_training_samples_in_data_order(tiny_model_dir, tokenizer, tmp_path):
    conversations = [CONVERSATION, CONVERSATION[1:3], CONVERSATION[:5]]
    data = write_conversations(tmp_path / "sft.jsonl", [{"messages": c} for c in conversations])
    args = sft_args(tiny_model_dir, data)
    data_source = make_data_source(args)

    first, second = generate_rollout(args, 0, data_source), generate_rollout(args, 1, data_source)
    groups = first.samples + second.samples
    assert [len(group) for group in groups] == [1, 1, 1, 1]
    samples = [group[0] for group in groups]
    for sample, messages in zip(samples, conversations + conversations[:1], strict=True):
        tokens, mask = expected_tokens_and_mask(tokenizer, messages)
        first_trainable = mask.index(1)
        assert sample.tokens == tokens
        assert sample.response_length == len(tokens) - first_trainable
        assert sample.loss_mask == mask[first_trainable:]
        assert sample.reward == 0 and sample.status == Status.COMPLETED
    assert [s.rollout_id for s in samples] == [0, 0, 1, 1]
    assert first.metrics["rollout/trainable_tokens"] == sum(sum(s.loss_mask) for s in samples[:2]) / 2

    # The rollout manager's conversion into train data accepts the samples as they are.
    train_data = samples_to_train_data(args, samples)
    assert train_data["loss_masks"] == [s.loss_mask for s in samples]
    assert train_data["rewards"] == [0.0] * 4


def test_copies_of_a_conversation_share_its_tokens(tiny_model_dir, tmp_path):
    data = write_conversations(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}] * 2)
    args = sft_args(tiny_model_dir, data, "--n-samples-per-prompt", "2")
    (group, _) = generate_rollout(args, 0, make_data_source(args)).samples
    assert group[0].tokens == group[1].tokens and group[0].loss_mask == group[1].loss_mask
    assert group[0].index != group[1].index and group[1].status == Status.COMPLETED


@pytest.mark.parametrize(
    "record, extra, message",
    [
        ({"messages": "What is 1 + 2?"}, [], r"--input-key \('messages'\).*found str: 'What is 1 \+ 2\?'"),
        ({"messages": ["hi", "there"]}, [], r"--input-key \('messages'\).*found list: \['hi', 'there'\]"),
        ({"messages": []}, [], r"--input-key \('messages'\).*found list: \[\]"),
        ({"messages": CONVERSATION}, ["--apply-chat-template"], "drop --apply-chat-template"),
        ({"messages": CONVERSATION[:2]}, [], r"no assistant turn .*\['system', 'user'\]"),
    ],
    ids=["text", "not-dicts", "empty", "pre-rendered", "no-assistant"],
)
def test_bad_conversations_fail_with_a_clear_error(tiny_model_dir, tmp_path, record, extra, message):
    data = write_conversations(tmp_path / "sft.jsonl", [record] * 2)
    args = sft_args(tiny_model_dir, data, *extra)
    with pytest.raises(ValueError, match=message) as error:
        generate_rollout(args, 0, make_data_source(args))
    assert "sample 0" in str(error.value)


def test_tokenizer_without_chat_template_is_refused(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "no_template")
    assert AutoTokenizer.from_pretrained(tmp_path / "no_template").chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        load_chat_tokenizer(str(tmp_path / "no_template"))


def test_evaluation_is_refused(tiny_model_dir, tmp_path):
    data = write_conversations(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}] * 2)
    args = sft_args(tiny_model_dir, data)
    with pytest.raises(ValueError, match="no evaluation mode.*--eval-function-path"):
        generate_rollout(args, 0, make_data_source(args), evaluation=True)


def test_policy_loss_without_advantages_is_refused_at_parse_time(tiny_model_dir, tmp_path):
    data = write_conversations(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}] * 2)
    with pytest.raises(ArgumentValidationError, match="--loss-type policy_loss needs"):
        sft_args(tiny_model_dir, data, "--loss-type", "policy_loss")


def test_sft_recipe_names_this_rollout_function():
    script = REPO / "scripts" / "run-qwen3-4B-sft.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    result = subprocess.run(
        ["bash", str(script)], env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True, check=True
    )
    argv = result.stdout.splitlines()
    assert load_function(argv[argv.index("--rollout-function-path") + 1]) is generate_rollout
    assert argv[argv.index("--input-key") + 1] == "messages"
    assert "--disable-compute-advantages-and-returns" in argv and "--debug-train-only" in argv


def _megatron_sft_worker(rank: int, world_size: int, model_dir: str, data_path: str) -> dict:
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.ray.rollout import split_train_data_by_dp

    args = sft_args(
        model_dir, data_path, "--train-backend", "megatron", "--global-batch-size", "2", "--calculate-per-token-loss",
        "--rollout-data-postprocess-path", "support.sft.refuse_advantages",
    )  # fmt: skip
    samples = [s for group in generate_rollout(args, 0, make_data_source(args)).samples for s in group]
    (shard,) = split_train_data_by_dp(args, samples_to_train_data(args, samples), 1)
    actor = MegatronTrainRayActor(world_size, rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    actor.init(args, "actor")
    return actor.train(0, shard)


def test_megatron_actor_trains_sft_samples_without_advantages(tiny_model_dir, tokenizer, tmp_path):
    pytest.importorskip("megatron.core")
    from support.megatron_cpu import run_in_processes

    messages = CONVERSATION[:5]
    data = write_conversations(tmp_path / "sft.jsonl", [{"messages": messages}] * 2)
    (metrics,) = run_in_processes(_megatron_sft_worker, 1, args=(str(tiny_model_dir), str(data)))
    # One step on two copies of one conversation: the loss is the untrained model's NLL on its assistant tokens.
    assert metrics["train/loss"] == pytest.approx(initial_sft_loss(tiny_model_dir, tokenizer, messages), rel=1e-4)
