"""Code written for upstream slime runs unchanged: the names it imports, with upstream's meaning, and a train.py
run driven by four plugin files shaped like upstream's examples (multi-turn generate, reward, filter, rollout)."""

import argparse
import asyncio
import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from support.chat_templates import CONVERSATION, template_tokenizers
from transformers import AutoTokenizer

from slime.rollout import sglang_rollout
from slime.utils.arguments import parse_args
from slime.utils.data import read_file
from slime.utils.http_utils import HTTPRequestError, find_free_port, post
from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.misc import SingletonMeta
from slime.utils.timer import Timer, inverse_timer, timer
from slime.utils.types import Sample, Status


# ---- Sample ---------------------------------------------------------------------------------------------------
def test_sample_status_and_upstream_fields():
    assert Sample.Status is Status and Sample.Status.TRUNCATED.value == "truncated"
    sample = Sample(index=3, status=Sample.Status.COMPLETED)
    assert (sample.teacher_log_probs, sample.session_id, sample.non_generation_time, sample.metadata) == (
        None,
        None,
        0.0,
        {},
    )
    sample.teacher_log_probs, sample.session_id, sample.non_generation_time = [-0.5, -1.0], "s-1", 2.5
    restored = Sample.from_dict(sample.to_dict())
    assert restored == sample and restored.status is Status.COMPLETED
    assert "Status" not in sample.to_dict()  # the alias is not a field


def test_get_reward_value_takes_upstream_args_or_a_key():
    no_key, score_key = argparse.Namespace(reward_key=None), argparse.Namespace(reward_key="score")
    scalar, scored = Sample(index=0, reward=0.25), Sample(index=1, reward={"score": 1, "acc": 0.0})
    assert scalar.get_reward_value(no_key) == 0.25 and scalar.get_reward_value() == 0.25
    assert scored.get_reward_value(score_key) == 1.0 and scored.get_reward_value("score") == 1.0
    # Upstream's args form with no --reward-key hands back the dict itself (a reward post-process reads it).
    assert scored.get_reward_value(no_key) == {"score": 1, "acc": 0.0}
    assert Sample(index=2, status=Status.ABORTED).get_reward_value(score_key) == 0.0


@pytest.mark.reliability("--reward-key names an entry the reward dict lacks", "ValueError naming the key and keys")
def test_get_reward_value_missing_key_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--reward-key 'score' is not in its reward, which has keys \['acc'\]"):
        Sample(index=1, reward={"acc": 1.0}).get_reward_value(argparse.Namespace(reward_key="score"))
    with pytest.raises(ValueError, match="pass --reward-key"):
        Sample(index=1, reward={"acc": 1.0}).get_reward_value(None)


# ---- MultiTurnLossMaskGenerator -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers():
    return template_tokenizers()


# What each template writes for one assistant turn, from its known layout: the masked text must be exactly this.
ASSISTANT_TURN = {"tiny": "{}<|im_end|>\n", "qwen2.5": "{}<|im_end|>\n", "llama3": "{}<|eot_id|>"}


@pytest.mark.parametrize("style", ["tiny", "qwen2.5", "llama3"])
def test_loss_mask_is_one_exactly_on_assistant_turns(tokenizers, style):
    tokenizer = tokenizers[style]
    generator = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type="llama" if style == "llama3" else "qwen")
    token_ids, loss_mask = generator.get_loss_mask(CONVERSATION)
    # The sequence is the template's rendering of the whole conversation.
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(token_ids) == full and len(loss_mask) == len(token_ids)
    assistant = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    expected_turns = [ASSISTANT_TURN[style].format(content) for content in assistant]
    assert generator.get_text_from_loss_mask(token_ids, loss_mask) == expected_turns
    # Everything outside those turns is context: the masked-in tokens are those turns' tokens and nothing else.
    assert sum(loss_mask) == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in expected_turns)
    first = full.index(assistant[0])
    (response_length,) = generator.get_response_lengths([loss_mask])
    assert tokenizer.decode(token_ids[-response_length:]) == full[first:]


@pytest.mark.reliability("get_text_from_loss_mask with a mask shorter than the ids", "ValueError with both lengths")
def test_response_lengths_and_masked_text(tokenizers):
    generator = MultiTurnLossMaskGenerator(tokenizers["tiny"])
    assert generator.get_response_lengths([[0, 0, 1, 0, 1], [0, 0], [1]]) == [3, 0, 1]
    ids = tokenizers["tiny"]("the quick brown fox", add_special_tokens=False)["input_ids"]
    mask = [1] + [0] * (len(ids) - 2) + [1]
    assert generator.get_text_from_loss_mask(ids, mask) == [
        tokenizers["tiny"].decode(ids[:1]),
        tokenizers["tiny"].decode(ids[-1:]),
    ]
    with pytest.raises(ValueError, match="token ids but .* loss mask entries"):
        generator.get_text_from_loss_mask(ids, mask[:-1])


@pytest.mark.reliability("unknown --loss-mask-type, or a tokenizer with no chat template", "ValueError naming the fix")
def test_mask_generator_refuses_unknown_type_and_missing_template(tokenizers, tiny_model_dir):
    with pytest.raises(ValueError, match=r"unknown loss mask type 'chatgpt' \(--loss-mask-type\)"):
        MultiTurnLossMaskGenerator(tokenizers["tiny"], tokenizer_type="chatgpt")
    bare = AutoTokenizer.from_pretrained(tiny_model_dir)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        MultiTurnLossMaskGenerator(bare)


def test_qwen3_style_template_masks_every_turn_as_rendered(tiny_model_dir):
    """A template that adds <think></think> to the last assistant turn only: each turn is masked as it appears."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    generator = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type="qwen3")
    token_ids, loss_mask = generator.get_loss_mask(CONVERSATION[:3])
    assert generator.get_text_from_loss_mask(token_ids, loss_mask) == [
        "<think>\n\n</think>\n\nThe answer is 46.<|im_end|>\n"
    ]
    token_ids, loss_mask = generator.get_loss_mask(CONVERSATION[:5])
    assert generator.get_text_from_loss_mask(token_ids, loss_mask) == [
        "The answer is 46.<|im_end|>\n",
        "<think>\n\n</think>\n\nthe quick brown fox<|im_end|>\n",
    ]


# ---- http_utils.post ------------------------------------------------------------------------------------------
class FlakyServer:
    """A real aiohttp server on loopback: /flaky answers 503 `failures` times, then echoes; /bad answers 400."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0
        self.port = find_free_port()

    async def flaky(self, request):
        self.calls += 1
        if self.calls <= self.failures:
            return web.Response(status=503, text="warming up")
        return web.json_response({"echo": await request.json(), "calls": self.calls})

    async def bad(self, request):
        self.calls += 1
        return web.Response(status=400, text="bad payload")

    async def __aenter__(self):
        app = web.Application()
        app.add_routes([web.post("/flaky", self.flaky), web.post("/bad", self.bad)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


@pytest.mark.reliability("post() to a server that answers 503 once", "retried a second later; the answer comes back")
def test_post_retries_a_busy_server_and_returns_json():
    async def main():
        async with FlakyServer(failures=1) as server:
            return await post(f"http://127.0.0.1:{server.port}/flaky", {"x": 1})

    assert asyncio.run(main()) == {"echo": {"x": 1}, "calls": 2}


@pytest.mark.reliability("post() to an endpoint answering 400", "HTTPRequestError at once, no retries")
def test_post_raises_on_a_client_error_without_retrying():
    async def main():
        async with FlakyServer(failures=0) as server:
            with pytest.raises(HTTPRequestError, match="HTTP 400: bad payload"):
                await post(f"http://127.0.0.1:{server.port}/bad", {"x": 1}, max_retries=5)
            return server.calls

    assert asyncio.run(main()) == 1


# ---- data.read_file, Timer, SingletonMeta ---------------------------------------------------------------------
@pytest.mark.reliability("read_file on a path that does not exist", "FileNotFoundError naming the path")
def test_read_file_yields_records_from_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": "1 + 1", "label": "2"}, {"prompt": "2 + 2", "label": "4"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert list(read_file(str(tmp_path / "d.jsonl"))) == rows
    assert list(read_file(str(tmp_path / "d.parquet"))) == rows
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_file(str(tmp_path / "missing.jsonl")))


@pytest.fixture
def fresh_timer():
    Timer.forget_instance()
    yield Timer()
    Timer.forget_instance()


def test_timer_sums_named_blocks(fresh_timer, monkeypatch):
    clock = iter([10.0, 12.5, 20.0, 21.0, 30.0, 30.25, 31.0, 34.0])
    monkeypatch.setattr("slime.utils.timer.time.perf_counter", lambda: next(clock))

    @timer
    def step():
        pass

    with timer("reward"):
        pass
    with Timer().context("reward"):
        pass
    step()
    Timer().start("train")
    Timer().end("train")
    assert Timer() is fresh_timer and fresh_timer.log_dict() == {"reward": 3.5, "step": 0.25, "train": 3.0}
    fresh_timer.reset("reward")
    assert fresh_timer.log_dict() == {"step": 0.25, "train": 3.0}
    fresh_timer.reset()
    assert fresh_timer.log_dict() == {}


def test_inverse_timer_leaves_out_the_paused_block(fresh_timer, monkeypatch):
    clock = iter([0.0, 1.0, 5.0, 6.0])
    monkeypatch.setattr("slime.utils.timer.time.perf_counter", lambda: next(clock))
    with timer("rollout"), inverse_timer("rollout"):
        pass  # 1 s timed, then paused from 1.0 to 5.0, then 1 s more
    assert fresh_timer.log_dict() == {"rollout": 2.0}


@pytest.mark.reliability("Timer started twice, or ended unstarted", "RuntimeError naming the timer")
def test_timer_misuse_is_a_clear_error(fresh_timer):
    fresh_timer.start("x")
    with pytest.raises(RuntimeError, match="timer 'x' is already running"):
        fresh_timer.start("x")
    with pytest.raises(RuntimeError, match="timer 'y' was not started"):
        fresh_timer.end("y")


def test_singleton_meta_builds_one_instance_per_class():
    class Client(metaclass=SingletonMeta):
        def __init__(self, url):
            self.url = url

    class Other(metaclass=SingletonMeta):
        pass

    seen = []
    threads = [threading.Thread(target=lambda: seen.append(Client("http://a"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(c) for c in seen}) == 1 and Client("http://b").url == "http://a"
    assert Other() is Other() and Other() is not Client("x")
    Client.forget_instance()
    assert Client("http://b").url == "http://b"


# ---- GenerateState --------------------------------------------------------------------------------------------
def test_generate_state_is_the_rollout_state_with_upstream_names(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_rollout, "_STATE", None)
    (tmp_path / "p.jsonl").write_text(json.dumps({"input": "What is 1 + 2?"}) + "\n")
    args = parse_args([
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tmp_path / "p.jsonl"), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--num-rollout", "1", "--rollout-max-response-len", "16",
        "--sglang-server-concurrency", "3",
    ])  # fmt: skip
    state = sglang_rollout.GenerateState(args)
    assert state is sglang_rollout.GenerateState(args) is sglang_rollout.get_state(args)
    assert state.args is args
    assert (
        state.tokenizer("What is 1 + 2?")["input_ids"]
        == AutoTokenizer.from_pretrained(tiny_model_dir)("What is 1 + 2?")["input_ids"]
    )
    assert state.sampling_params == sglang_rollout.sampling_params_from_args(args)
    assert state.sampling_params["max_new_tokens"] == 16

    async def fill_semaphore() -> bool:
        for _ in range(state.max_concurrency):
            await state.semaphore.acquire()
        return state.semaphore.locked()

    # --sglang-server-concurrency requests per engine, and one engine here.
    assert args.rollout_num_gpus == args.rollout_num_gpus_per_engine and state.max_concurrency == 3
    assert asyncio.run(fill_semaphore())


# ---- a train.py run driven by upstream-shaped plugins ---------------------------------------------------------
