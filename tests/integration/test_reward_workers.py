"""Math rewards in worker processes: a pathological answer costs at most --rm-timeout-secs and never the loop."""

import asyncio
import os
import signal
import time

import pytest
from support.flags import slime_flags

from slime.rollout.rm_hub import async_rm, pop_reward_metrics, start_reward_workers
from slime.rollout.rm_hub.reward_workers import RewardWorkerError, get_reward_pool, shutdown_reward_workers
from slime.utils.types import Sample

# sympy expands both sides: 1000 terms with up to 300-digit coefficients. Measured: 22 s for the old grader
# (on the event loop), 12 s for math-verify without a timeout; the nested one over 40 s and 11 s.
STUCK = [("\\boxed{(x+1)^{999}}", "(x+2)^{999}"), ("\\boxed{((x+1)^{30})^{30}}", "((x+2)^{30})^{30}")]
TIMEOUT = 2.0
MARGIN = 8.0  # worker restart and a busy 2-core machine; still well under the 11 s a stuck answer takes


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(autouse=True)
def fresh_pool():
    shutdown_reward_workers()
    pop_reward_metrics()
    yield
    shutdown_reward_workers()


async def _ticking(ticks: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        ticks.append(time.monotonic())
        await asyncio.sleep(0.02)


@pytest.mark.reliability(
    "math answers that make sympy run for 10-40 s ((x+1)^{999} vs (x+2)^{999})",
    "the grading worker is killed after --rm-timeout-secs, the answer scores 0, reward/timeouts counts it",
)
def test_stuck_answers_time_out_while_the_event_loop_keeps_running():
    args = slime_flags(rm_type="math", rm_timeout_secs=TIMEOUT, rm_num_workers=2)

    async def scenario():
        # Start both workers first, so that the timing below is the grading alone.
        warm = [Sample(index=i, response="\\boxed{3}", label="3") for i in range(2)]
        assert await asyncio.gather(*(async_rm(args, s) for s in warm)) == [1.0, 1.0]
        first_pids = get_reward_pool(2).pids()
        assert len(first_pids) == 2

        ticks, stop = [], asyncio.Event()
        ticker = asyncio.create_task(_ticking(ticks, stop))
        started = time.monotonic()
        stuck = [Sample(index=10 + i, response=r, label=label) for i, (r, label) in enumerate(STUCK)]
        rewards = await asyncio.gather(*(async_rm(args, s) for s in stuck))
        elapsed = time.monotonic() - started
        stop.set()
        await ticker
        return first_pids, rewards, elapsed, ticks

    first_pids, rewards, elapsed, ticks = asyncio.run(scenario())
    assert rewards == [0.0, 0.0]
    assert elapsed < TIMEOUT + MARGIN
    # The loop ran the ticker all along: grading inline would have frozen it for the whole 10-40 s.
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 1.0
    assert ticks[-1] - ticks[0] > TIMEOUT * 0.9
    counts = pop_reward_metrics()
    assert (counts["reward/timeouts"], counts["reward/worker_crashes"]) == (2.0, 0.0)
    assert counts["perf/reward_time"] >= 2 * TIMEOUT * 0.9  # two answers, each graded until its timeout
    assert pop_reward_metrics()["reward/timeouts"] == 0.0  # reading resets

    # The stuck processes were killed, not abandoned; new ones grade the next answers.
    assert all(_process_gone(pid) for pid in first_pids)
    next_answer = Sample(index=20, response="\\boxed{2\\sqrt{2}}", label="\\sqrt{8}")  # 2 sqrt 2 = sqrt(4 * 2)
    assert asyncio.run(async_rm(args, next_answer)) == 1.0
    assert not set(get_reward_pool(2).pids()) & set(first_pids)


@pytest.mark.reliability(
    "one answer stuck in sympy while other answers wait to be graded",
    "the other answers are graded by the second worker before the stuck one times out",
)
def test_other_answers_are_graded_while_one_is_stuck():
    args = slime_flags(rm_type="math", rm_timeout_secs=TIMEOUT, rm_num_workers=2)
    finished = []

    async def score(sample):
        reward = await async_rm(args, sample)
        finished.append(sample.index)
        return reward

    async def scenario():
        await asyncio.gather(*(async_rm(args, Sample(response="\\boxed{1}", label="1")) for _ in range(2)))
        stuck = score(Sample(index=0, response=STUCK[0][0], label=STUCK[0][1]))
        # 1/2 = 0.5, 3/4 != 0.7, 10 = 10, -7 != 7, (x+1)^2 = x^2 + 2x + 1.
        normal = [
            Sample(index=1, response="\\boxed{\\frac{1}{2}}", label="0.5"),
            Sample(index=2, response="\\boxed{\\frac{3}{4}}", label="0.7"),
            Sample(index=3, response="\\boxed{10}", label="10"),
            Sample(index=4, response="\\boxed{-7}", label="7"),
            Sample(index=5, response="\\boxed{(x+1)^2}", label="x^2+2x+1"),
        ]
        return await asyncio.gather(stuck, *(score(s) for s in normal))

    assert asyncio.run(scenario()) == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert finished[-1] == 0  # every normal answer came back before the stuck one timed out
    assert pop_reward_metrics()["reward/timeouts"] == 1.0


@pytest.mark.reliability(
    "a grading worker killed with SIGKILL in the middle of an answer",
    "the answer scores as wrong, reward/worker_crashes counts it, a new worker grades the next",
)
def test_a_worker_that_dies_mid_answer_is_replaced():
    args = slime_flags(rm_type="dapo", rm_timeout_secs=30.0, rm_num_workers=1)

    async def scenario():
        assert (await async_rm(args, Sample(response="Answer: 4", label="4")))["score"] == 1.0
        (pid,) = get_reward_pool(1).pids()
        grading = asyncio.create_task(
            async_rm(args, Sample(index=3, response="Answer: (x+1)^{999}", label=STUCK[0][1]))
        )
        await asyncio.sleep(1.0)  # the worker is now inside sympy
        os.kill(pid, signal.SIGKILL)
        return pid, await grading

    pid, reward = asyncio.run(scenario())
    # dapo's wrong-answer score, with the extracted answer kept.
    assert reward == {"score": -1.0, "acc": False, "pred": "(x+1)^{999}"}
    counts = pop_reward_metrics()
    assert (counts["reward/timeouts"], counts["reward/worker_crashes"]) == (0.0, 1.0)
    assert asyncio.run(async_rm(args, Sample(response="Answer: 7", label="7")))["acc"] is True
    assert pid not in get_reward_pool(1).pids()


@pytest.mark.reliability(
    "a grading task the worker cannot run (unknown reward type sent to the pool)",
    "RewardWorkerError carrying the worker's traceback; the worker stays up",
)
def test_an_error_inside_the_worker_is_reported_with_its_traceback():
    pool = get_reward_pool(1)
    with pytest.raises(RewardWorkerError, match="KeyError: 'no_such_type'") as error:
        asyncio.run(pool.grade("no_such_type", "\\boxed{1}", "1", timeout=30.0))
    assert "traceback in the reward worker" in str(error.value) and "worker_main" in str(error.value)
    (pid,) = pool.pids()
    assert asyncio.run(pool.grade("math", "\\boxed{1}", "1", timeout=30.0)) == 1.0
    assert pool.pids() == [pid]


def test_workers_start_before_the_first_answer_and_then_grade_it():
    # A custom reward function or a non-rule-based type needs no workers: none start.
    start_reward_workers(slime_flags(rm_type="math", custom_rm_path="my.reward", rm_num_workers=2))
    start_reward_workers(slime_flags(rm_type="remote_rm", custom_rm_path=None, rm_num_workers=2))
    time.sleep(0.5)
    assert get_reward_pool(2).pids() == []

    start_reward_workers(slime_flags(rm_type="math", custom_rm_path=None, rm_num_workers=2))
    deadline = time.monotonic() + 60
    while len(get_reward_pool(2).pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    started = set(get_reward_pool(2).pids())
    assert len(started) == 2

    async def grade_two():
        return await asyncio.gather(*(get_reward_pool(2).grade("math", "\\boxed{2}", "2", 30.0) for _ in range(2)))

    rewards = asyncio.run(grade_two())
    assert rewards == [1.0, 1.0] and set(get_reward_pool(2).pids()) == started  # the answers used those workers


@pytest.mark.reliability("--rm-timeout-secs 0 or --rm-num-workers 0", "ValueError naming the flag")
def test_bad_pool_settings_name_the_flag():
    with pytest.raises(ValueError, match="--rm-timeout-secs"):
        asyncio.run(get_reward_pool(1).grade("math", "\\boxed{1}", "1", timeout=-1.0))
    with pytest.raises(ValueError, match="--rm-num-workers"):
        get_reward_pool(0)


@pytest.mark.reliability(
    "a gpqa response of 'answer' and 5000 spaces (the old pattern backtracked polynomially: 400 spaces took 29 s on "
    "the rollout's event loop)",
    "graded in a worker like every built-in reward: scores 0 at once, a correct answer after it still scores 1",
)
def test_hostile_gpqa_response_is_graded_in_a_worker():
    args = slime_flags(rm_type="gpqa", rm_timeout_secs=30.0)
    hostile = Sample(index=0, response="The answer" + " " * 5000 + "is unclear", label="B")
    assert asyncio.run(async_rm(args, hostile)) == 0.0
    assert len(get_reward_pool(1).pids()) == 1  # in a worker, not on this loop
    spaced = Sample(index=1, response="Answer" + " " * 5000 + ": (B)", label="B")
    assert asyncio.run(async_rm(args, spaced)) == 1.0
    assert pop_reward_metrics().get("reward/timeouts", 0) == 0


def test_every_built_in_type_scores_as_wrong_past_the_timeout():
    # A timeout no answer can meet: each type's worker is killed, and the answer scores as a wrong one.
    expected = {"f1": 0.0, "gpqa": 0.0, "last_number": 0.0, "dapo": {"score": -1.0, "acc": False, "pred": "2"}}
    for rm_type, wrong in expected.items():
        args = slime_flags(rm_type=rm_type, rm_timeout_secs=1e-6)
        assert asyncio.run(async_rm(args, Sample(index=0, response="Answer: 2", label="2"))) == wrong, rm_type
    assert pop_reward_metrics()["reward/timeouts"] == len(expected)
