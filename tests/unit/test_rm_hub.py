"""Reward functions of slime.rollout.rm_hub; every expected value below was worked out by hand."""

import asyncio
import contextlib
import os
import random
import socket
import threading
import time

import pytest
from aiohttp import web
from support.flags import slime_flags

from slime.rollout.rm_hub import RewardFunctionError, async_rm, batched_async_rm
from slime.rollout.rm_hub.dapo import compute_dapo_reward
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.f1 import f1_score
from slime.rollout.rm_hub.gpqa import compute_gpqa_reward, extract_choice_letter
from slime.rollout.rm_hub.math_rm import compute_math_reward
from slime.rollout.rm_hub.math_utils import extract_boxed_answer, is_equiv, normalize_final_answer
from slime.rollout.rm_hub.remote_rm import RemoteRewardError
from slime.rollout.rm_hub.reward_workers import RewardWorkerError
from slime.utils.types import Sample


def rm(args, sample):
    return asyncio.run(async_rm(args, sample))


# ---------------------------------------------------------------- boxed extraction and normalization


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
        ("first \\boxed{3}, finally \\boxed{4}", "4"),
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{12", None),  # never closed
        ("the answer is 12", None),
        ("", None),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert extract_boxed_answer(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("$\\dfrac{1}{2}$", "\\frac{1}{2}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("12\\text{ cm}", "12"),
        ("5 square feet", "5"),
        ("10^\\circ", "10"),
        ("30 degrees.", "30"),
        ("\\$1,000", "1000"),
        ("50\\%", "50"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("x = 5", "5"),
        ("\\text{cm}", "cm"),  # a unit alone is the answer, not an empty string
    ],
)
def test_normalize_final_answer(raw, expected):
    assert normalize_final_answer(raw) == expected


# ---------------------------------------------------------------- math


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),  # 0.5 = 1/2 exactly
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("\\boxed{3.50}", "3.5", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{12\\text{ cm}}", "12", 1.0),
        ("\\boxed{10^\\circ}", "10", 1.0),
        ("\\boxed{-7}", "-7", 1.0),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # sqrt(8) = sqrt(4*2) = 2 sqrt(2)
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{\\sqrt[3]{8}}", "2", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),  # a set has no order
        ("\\boxed{(1,2)}", "(2,1)", 0.0),  # a pair has one
        ("\\boxed{\\log_2 8}", "3", 1.0),  # 2^3 = 8
        ("\\boxed{1e3}", "1000", 1.0),
        ("\\boxed{42}", 42, 1.0),  # integer label
        ("\\boxed{6}", "so the total is \\boxed{6}", 1.0),  # label is a boxed solution
        ("\\boxed{12}", "21", 0.0),
        ("\\boxed{1/3}", "0.33", 0.0),  # 0.33 != 1/3 = 0.333...
        ("\\boxed{-7}", "7", 0.0),
        ("\\boxed{\\pi}", "3.14", 0.0),
        ("\\boxed{2\\sqrt{2}}", "2.83", 0.0),
        ("The answer is 5.", "5", 0.0),  # nothing boxed
        ("\\boxed{5", "5", 0.0),
        ("\\boxed{3} no wait \\boxed{4}", "3", 0.0),  # only the last box counts
    ],
)
def test_math_reward(response, label, expected):
    assert compute_math_reward(response, label) == expected
    assert rm(slime_flags(rm_type="math"), Sample(response=response, label=label)) == expected


@pytest.mark.reliability("a power tower 9^{9^{9^{9}}} as a math answer", "refused before evaluation: scores 0 at once")
def test_is_equiv_never_hangs_on_power_towers_even_off_the_main_thread():
    # 9^(9^(9^9)) has more digits than atoms in the universe; the guard must refuse it without a timer.
    results = []
    worker = threading.Thread(target=lambda: results.append(is_equiv("9^{9^{9^{9}}}", "1")), daemon=True)
    started = time.time()
    worker.start()
    worker.join(timeout=20)
    assert results == [False]
    assert time.time() - started < 20
    assert is_equiv("((7^{999})^{999})^{999}", "0") is False


@pytest.mark.reliability("Python code as a math answer", "never evaluated: scores 0")
def test_is_equiv_does_not_evaluate_python():
    payload = "__import__('os').environ.setdefault('SLIME_RM_HUB_INJECTED','1')"
    assert is_equiv(payload, "1") is False
    assert "SLIME_RM_HUB_INJECTED" not in os.environ


def test_is_equiv_handles_missing_answers():
    assert is_equiv(None, "1") is False
    assert is_equiv("1", None) is False
    assert is_equiv("", "") is False


# ---------------------------------------------------------------- deepscaler


def test_deepscaler_grades_only_after_reasoning():
    response = "<think>maybe \\boxed{3}</think> Final: \\boxed{4}"
    assert get_deepscaler_rule_based_reward(response, "4") == 1.0
    assert get_deepscaler_rule_based_reward(response, "3") == 0.0  # the box inside <think> does not count
    assert get_deepscaler_rule_based_reward("no marker here \\boxed{4}", "4") == 0.0
    assert get_deepscaler_rule_based_reward("<think>long</think> the answer is 4", "4") == 0.0  # no box
    assert get_deepscaler_rule_based_reward("###Response \\boxed{\\frac{1}{2}}", "\\boxed{0.5}") == 1.0
    assert get_deepscaler_rule_based_reward("</think>\\boxed{4}", ["four", "4"]) == 1.0


# ---------------------------------------------------------------- dapo


def test_dapo_reward():
    assert compute_dapo_reward("Let me compute.\nAnswer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    # The last Answer line wins.
    assert compute_dapo_reward("Answer: 41\nwait, recheck\nAnswer: 42", "42")["score"] == 1.0
    assert compute_dapo_reward("Answer: 41", "42") == {"score": -1.0, "acc": False, "pred": "41"}
    assert compute_dapo_reward("I give up", "42") == {"score": -1.0, "acc": False, "pred": ""}
    assert compute_dapo_reward("Answer: $\\frac{1}{2}$", "0.5")["acc"] is True
    assert compute_dapo_reward("Answer: \\boxed{7}", 7)["pred"] == "7"
    assert compute_dapo_reward("so \\boxed{7}", 7)["acc"] is True  # no Answer line: boxed fallback


def test_dapo_reward_through_async_rm_picks_with_reward_key():
    sample = Sample(index=0, response="Answer: 3", label="3")
    sample.reward = rm(slime_flags(rm_type="dapo"), sample)
    assert sample.get_reward_value("score") == 1.0


# ---------------------------------------------------------------- f1


def test_f1_score_by_hand():
    # "quick brown fox" vs "quick red fox": 2 shared of 3 each, P = R = 2/3, F1 = 2/3.
    assert f1_score("The quick brown fox", "quick red fox") == pytest.approx(2 / 3)
    # "paris france" vs "paris": P = 1/2, R = 1, F1 = 2 * 1/2 / (3/2) = 2/3; "lyon" shares nothing.
    assert f1_score("Paris, France.", ["Lyon", "paris"]) == pytest.approx(2 / 3)
    assert f1_score("An apple!", "apple") == 1.0  # article and punctuation dropped
    assert f1_score("yes", "yes it is") == 0.0  # yes/no answers get no partial credit
    assert f1_score("banana", "apple") == 0.0
    assert f1_score(None, "apple") == 0.0


def test_boxed_prefix_grades_the_boxed_answer():
    sample = Sample(response="blah blah \\boxed{Barack Obama}", label="Barack Obama")
    assert rm(slime_flags(rm_type="boxed_f1"), sample) == 1.0
    # Plain f1 sees "blah blah boxedbarack obama" (4 tokens) vs "barack obama": 1 shared,
    # P = 1/4, R = 1/2, F1 = 2 * (1/8) / (3/4) = 1/3.
    assert rm(slime_flags(rm_type="f1"), sample) == pytest.approx(1 / 3)
    assert rm(slime_flags(rm_type="boxed_f1"), Sample(response="Barack Obama", label="Barack Obama")) == 0.0
    assert rm(slime_flags(rm_type="boxed_gpqa"), Sample(response="A is tempting, but \\boxed{B}", label="B")) == 1.0
    assert rm(slime_flags(rm_type="gpqa"), Sample(response="Answer: B", label="B")) == 1.0
    assert rm(slime_flags(rm_type="boxed_gpqa"), Sample(response="Answer: B", label="B")) == 0.0  # nothing boxed


# ---------------------------------------------------------------- gpqa


@pytest.mark.parametrize(
    "response, letter",
    [
        ("Answer: (C)", "C"),
        ("The answer is C.", "C"),
        ("...so the final answer is: (A)", "A"),
        ("\\boxed{D}", "D"),
        ("\\boxed{\\text{(B)}}", "B"),
        ("B", "B"),
        ("A looks wrong. Answer: B", "B"),
        ("the answer is a tricky one", None),  # lower-case article, not option A
        ("Answer: E", None),  # only A-D by default
        ("I am not sure", None),
    ],
)
def test_gpqa_letter_formats(response, letter):
    assert extract_choice_letter(response) == letter


def test_gpqa_reward():
    assert compute_gpqa_reward("Answer: (C)", "C") == 1.0
    assert compute_gpqa_reward("Answer: (C)", "(C)") == 1.0
    assert compute_gpqa_reward("Answer: B", "C") == 0.0
    choices = {"choices": ["red", "green", "blue", "yellow"]}
    assert compute_gpqa_reward("Answer: C", "blue", metadata=choices) == 1.0  # blue is the third option
    assert compute_gpqa_reward("Answer: B", "blue", metadata=choices) == 0.0
    five = {"choices": ["1", "2", "3", "4", "5"]}
    assert compute_gpqa_reward("Answer: E", "E", metadata=five) == 1.0
    with pytest.raises(ValueError, match="metadata\\['choices'\\]"):
        compute_gpqa_reward("Answer: A", "purple", metadata=choices)


def test_gpqa_uses_sample_metadata_through_async_rm():
    sample = Sample(response="The answer is A", label="red", metadata={"choices": ["red", "green", "blue", "yellow"]})
    assert rm(slime_flags(rm_type="gpqa"), sample) == 1.0


# ---------------------------------------------------------------- dispatch


def test_random_reward_is_zero_or_one_and_follows_the_seed():
    args = slime_flags(rm_type="random")
    random.seed(7)
    first = [rm(args, Sample()) for _ in range(40)]
    random.seed(7)
    second = [rm(args, Sample()) for _ in range(40)]
    assert set(first) == {0.0, 1.0}  # 40 fair coin flips being all equal has probability 2^-39
    assert first == second


def test_metadata_rm_type_overrides_args():
    sample = Sample(response="\\boxed{4}", label="4", metadata={"rm_type": "math"})
    assert rm(slime_flags(rm_type="f1"), sample) == 1.0


@pytest.mark.reliability(
    "unknown --rm-type (maths, boxed_math) or none", "ValueError naming it and listing the valid types"
)
def test_unknown_rm_type_lists_valid_types():
    with pytest.raises(ValueError) as error:
        rm(slime_flags(rm_type="maths"), Sample(response="1", label="1"))
    message = str(error.value)
    assert "'maths'" in message
    for name in ("math", "deepscaler", "dapo", "f1", "gpqa", "remote_rm", "random", "boxed_"):
        assert name in message
    for already_boxed in ("boxed_random", "boxed_math"):  # math finds the boxed answer itself
        with pytest.raises(ValueError, match=already_boxed):
            rm(slime_flags(rm_type=already_boxed), Sample())
    with pytest.raises(ValueError, match="--rm-type"):
        rm(slime_flags(), Sample())


@pytest.mark.reliability("gpqa label that is no option", "RewardFunctionError naming the rm type and sample index")
def test_builtin_reward_error_names_type_and_sample():
    sample = Sample(index=5, response="Answer: A", label="purple")
    with pytest.raises(RewardFunctionError, match="reward type 'gpqa' failed on sample index 5") as error:
        rm(slime_flags(rm_type="gpqa"), sample)
    # Raised in the grading worker: its error and traceback come back as the cause.
    assert isinstance(error.value.__cause__, RewardWorkerError)
    assert str(error.value.__cause__).startswith("ValueError: gpqa label 'purple' is neither an option letter")


# ---------------------------------------------------------------- custom reward functions

GROUP_CALLS = []


def exact_match_rm(args, sample):
    return float(sample.response == sample.label)


async def length_rm(args, sample, scale=1.0):
    await asyncio.sleep(0)
    return scale * len(sample.response)


async def longest_wins_group_rm(args, samples):
    GROUP_CALLS.append([s.index for s in samples])
    longest = max(len(s.response) for s in samples)
    return [float(len(s.response) == longest) for s in samples]


def short_group_rm(args, samples):
    return [1.0]


def broken_rm(args, sample):
    raise KeyError("answer_field")


def test_custom_rm_sync_and_async():
    sample = Sample(response="abc", label="abc")
    assert rm(slime_flags(custom_rm_path=f"{__name__}.exact_match_rm", rm_type="random"), sample) == 1.0
    assert rm(slime_flags(custom_rm_path=f"{__name__}.length_rm"), sample) == 3.0
    args = slime_flags(custom_rm_path=f"{__name__}.length_rm")
    assert asyncio.run(async_rm(args, sample, scale=2.0)) == 6.0  # kwargs reach the custom function


def test_batched_rm_per_sample_and_per_group():
    samples = [Sample(index=i, response="x" * n, label="xx") for i, n in enumerate([1, 3, 2])]
    per_sample = asyncio.run(batched_async_rm(slime_flags(custom_rm_path=f"{__name__}.exact_match_rm"), samples))
    assert per_sample == [0.0, 0.0, 1.0]
    assert asyncio.run(batched_async_rm(slime_flags(rm_type="math"), [Sample(response="\\boxed{2}", label=2)])) == [1.0]

    GROUP_CALLS.clear()
    group_args = slime_flags(custom_rm_path=f"{__name__}.longest_wins_group_rm", group_rm=True)
    assert asyncio.run(batched_async_rm(group_args, samples)) == [0.0, 1.0, 0.0]
    assert GROUP_CALLS == [[0, 1, 2]]  # called once with the whole group

    short_args = slime_flags(custom_rm_path=f"{__name__}.short_group_rm", group_rm=True)
    with pytest.raises(RewardFunctionError, match="returned 1 rewards for 3 samples"):
        asyncio.run(batched_async_rm(short_args, samples))


@pytest.mark.reliability(
    "--custom-rm-path function that raises (per sample and --group-rm)",
    "RewardFunctionError naming the path and sample indices, original error chained",
)
def test_raising_custom_rm_gives_clear_chained_error():
    args = slime_flags(custom_rm_path=f"{__name__}.broken_rm")
    with pytest.raises(RewardFunctionError) as error:
        rm(args, Sample(index=7, response="r", label="l"))
    message = str(error.value)
    assert f"{__name__}.broken_rm" in message and "sample index 7" in message and "answer_field" in message
    assert isinstance(error.value.__cause__, KeyError)

    group_args = slime_flags(custom_rm_path=f"{__name__}.broken_rm", group_rm=True)
    with pytest.raises(RewardFunctionError, match=r"samples with index \[3, 4\]") as group_error:
        asyncio.run(batched_async_rm(group_args, [Sample(index=3), Sample(index=4)]))
    assert isinstance(group_error.value.__cause__, KeyError)


@pytest.mark.reliability("--custom-rm-path naming a missing module", "ValueError naming the path")
def test_bad_custom_rm_path_names_it():
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        rm(slime_flags(custom_rm_path="no_such_module_xyz.rm"), Sample())


USER_RM_MODULE = """
import sys


def rm(args, sample):
    return 1.0 / len(sample.response)  # ZeroDivisionError on an empty response


async def quits(args, sample):
    sys.exit(3)  # a helper that ends the program
"""


@pytest.fixture
def user_rm_module(tmp_path, monkeypatch):
    """A reward module as a user writes it, in its own folder on sys.path."""
    (tmp_path / "my_user_rewards.py").write_text(USER_RM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_user_rewards"


@pytest.mark.reliability(
    "--custom-rm-path function from a user module that raises on one sample",
    "RewardFunctionError naming the dotted path and sample index, original error chained",
)
def test_user_module_rm_that_raises_names_path_and_sample(user_rm_module):
    args = slime_flags(custom_rm_path=f"{user_rm_module}.rm")
    samples = [Sample(index=i, response=r) for i, r in enumerate(["ab", "abcd", "", "a"])]
    with pytest.raises(RewardFunctionError) as error:
        asyncio.run(batched_async_rm(args, samples))
    assert "'my_user_rewards.rm'" in str(error.value) and "sample index 2" in str(error.value)
    assert isinstance(error.value.__cause__, ZeroDivisionError)
    assert asyncio.run(batched_async_rm(args, [samples[0], samples[1]])) == [0.5, 0.25]  # 1/2, 1/4


@pytest.mark.reliability(
    "--custom-rm-path function that calls sys.exit() on the rollout's shared event loop",
    "RewardFunctionError naming the path and sample; the loop keeps serving (it used to die and hang the run)",
)
def test_user_rm_calling_sys_exit_cannot_kill_the_shared_loop(user_rm_module):
    from slime.utils.async_utils import run

    args = slime_flags(custom_rm_path=f"{user_rm_module}.quits")
    outcome = []

    def call():
        try:
            run(async_rm(args, Sample(index=9, response="r")))
        except BaseException as error:  # SystemExit is what must not get through
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert outcome, "the reward call never returned: the shared event loop died"
    error = outcome[0]
    assert isinstance(error, RewardFunctionError), repr(error)
    assert "'my_user_rewards.quits'" in str(error) and "sample index 9" in str(error)
    assert isinstance(error.__cause__, SystemExit) and error.__cause__.code == 3
    assert run(asyncio.sleep(0, result="still serving")) == "still serving"


# ---------------------------------------------------------------- remote reward model


@contextlib.asynccontextmanager
async def reward_server(routes):
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.reliability(
    "reward server answering HTTP 500 / 422 / 500-then-200",
    "5xx retried --rm-max-retries times, 4xx not; final error names URL, status, body",
)
def test_remote_rm_against_local_server():
    received = []
    hits = {"fail": 0, "flaky": 0, "bad": 0}

    async def exact(request):
        payload = await request.json()
        received.append(payload)
        return web.json_response({"reward": float(payload["response"] == payload["label"]), "extra": 1})

    async def number(request):
        return web.json_response(0.25)

    async def scores(request):
        return web.json_response({"score": 0.5, "acc": True})

    async def fail(request):
        hits["fail"] += 1
        return web.Response(status=500, text="model crashed")

    async def flaky(request):
        hits["flaky"] += 1
        return web.Response(status=500) if hits["flaky"] == 1 else web.json_response(1)

    async def bad(request):
        hits["bad"] += 1
        return web.Response(status=422, text="missing field")

    routes = [
        web.post("/exact", exact),
        web.post("/number", number),
        web.post("/scores", scores),
        web.post("/fail", fail),
        web.post("/flaky", flaky),
        web.post("/bad", bad),
    ]
    sample = Sample(index=2, prompt="1+1?", response="2", label="2", metadata={"source": "unit"})

    async def scenario():
        async with reward_server(routes) as base:

            def args(path, **fields):
                return slime_flags(rm_type="remote_rm", rm_url=base + path, rm_retry_delay=0.0, **fields)

            assert await async_rm(args("/exact"), sample) == 1.0
            assert received == [{"prompt": "1+1?", "response": "2", "label": "2", "metadata": {"source": "unit"}}]
            assert await async_rm(args("/number"), sample) == 0.25
            assert await async_rm(args("/scores"), sample) == {"score": 0.5, "acc": True}

            with pytest.raises(RewardFunctionError) as error:
                await async_rm(args("/fail", rm_max_retries=2), sample)
            cause = error.value.__cause__
            assert isinstance(cause, RemoteRewardError) and cause.status == 500
            assert base + "/fail" in str(error.value) and "HTTP 500" in str(error.value)
            assert "model crashed" in str(error.value) and "3 attempt" in str(error.value)
            assert hits["fail"] == 3  # first try + 2 retries

            assert await async_rm(args("/flaky", rm_max_retries=1), sample) == 1.0
            assert hits["flaky"] == 2

            with pytest.raises(RewardFunctionError, match="HTTP 422"):
                await async_rm(args("/bad", rm_max_retries=3), sample)
            assert hits["bad"] == 1  # client errors are not retried

    asyncio.run(scenario())


@pytest.mark.reliability("--rm-url with nothing listening, or missing", "error naming the URL, or asking for --rm-url")
def test_remote_rm_unreachable_and_unconfigured():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    args = slime_flags(rm_type="remote_rm", rm_url=f"http://127.0.0.1:{closed_port}/rm", rm_max_retries=0)
    with pytest.raises(RewardFunctionError, match=f"cannot reach reward server http://127.0.0.1:{closed_port}/rm"):
        rm(args, Sample())
    with pytest.raises(RewardFunctionError, match="--rm-url"):
        rm(slime_flags(rm_type="remote_rm"), Sample())


@pytest.mark.reliability(
    "reward server that stalls on the first request, or on every request",
    "a stalled request times out after --rm-request-timeout-secs and is retried; the last error names the URL",
)
def test_remote_rm_times_out_and_retries():
    hits = {"slow_once": 0, "stalled": 0}
    release = asyncio.Event()

    async def slow_once(request):
        hits["slow_once"] += 1
        if hits["slow_once"] == 1:
            await release.wait()  # held until the test ends, far past the request timeout
        return web.json_response({"reward": 0.75})

    async def stalled(request):
        hits["stalled"] += 1
        await release.wait()
        return web.json_response(1.0)

    routes = [web.post("/slow_once", slow_once), web.post("/stalled", stalled)]
    sample = Sample(index=4, response="2", label="2")

    async def scenario():
        async with reward_server(routes) as base:
            try:

                def args(path, **fields):
                    return slime_flags(
                        rm_type="remote_rm",
                        rm_url=base + path,
                        rm_request_timeout_secs=0.5,
                        rm_retry_delay=0.0,
                        **fields,
                    )

                assert await async_rm(args("/slow_once", rm_max_retries=2), sample) == 0.75
                assert hits["slow_once"] == 2  # the stalled first try timed out, the retry answered

                with pytest.raises(RewardFunctionError) as error:
                    await async_rm(args("/stalled", rm_max_retries=1), sample)
                message = str(error.value)
                assert base + "/stalled" in message and "within 0.5 s" in message and "2 attempt" in message
                assert "--rm-request-timeout-secs" in message and "sample index 4" in message
                assert isinstance(error.value.__cause__, RemoteRewardError)
                assert hits["stalled"] == 2
            finally:
                release.set()

    # Bounded, so that a client without a timeout fails here instead of waiting for ever.
    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("37 + 58 = 95", "95", 1.0),
        ("37 + 58 = 145", "95", 0.0),
        ("The answer is 1,000.", "1000", 1.0),
        ("It is \\boxed{12}, not 13", "12", 1.0),  # a boxed answer wins over the last number
        ("3.50", "3.5", 1.0),
        ("-7", "-7", 1.0),
        ("no digits here", "4", 0.0),
        ("4", "four", 0.0),  # a label that is not a number never matches
    ],
)
def test_last_number_reward(response, label, expected):
    from slime.rollout.rm_hub.last_number import compute_last_number_reward

    assert compute_last_number_reward(response, label) == expected


def test_last_number_is_a_builtin_rm_type():
    sample = Sample(index=0, response="so 2 + 2 = 4", label="4")
    assert asyncio.run(async_rm(slime_flags(rm_type="last_number", custom_rm_path=None), sample)) == 1.0
