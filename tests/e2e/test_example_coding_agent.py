"""examples/coding_agent_rl on CPU: its test runner in the real local sandbox (honest, failing and reward-hacking
solutions), and the agent end to end through `--agent-function-path` against a real engine serving a tiny model
taught to answer one problem with correct code."""

import asyncio
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
from support.engines import engine_server
from support.flags import slime_flags
from support.tiny_model import teach_tiny_model
from transformers import AutoTokenizer

from slime.rollout import agent_rollout
from slime.utils.types import Sample, Status

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "coding_agent_rl"
# Under a name of its own: other examples' tests in the same worker import an `agent` module too.
AGENT_MODULE = "coding_agent_rl_agent"
_spec = importlib.util.spec_from_file_location(AGENT_MODULE, EXAMPLE / "agent.py")
agent = importlib.util.module_from_spec(_spec)
sys.modules[AGENT_MODULE] = agent
_spec.loader.exec_module(agent)

TESTS = agent.parse_tests("add(1, 2) == 3\nadd(-4, 4) == 0\nadd(12, 34) == 46")
SOLUTION = "def add(a, b):\n    return a + b\n"


def test_extract_code_and_parse_tests():
    reply = "First try:\n```python\nx = 1\n```\nbetter:\n```py\ndef add(a, b):\n    return a + b\n```\n"
    assert agent.extract_code(reply) == SOLUTION
    assert agent.extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1\n"  # cut by max_tokens
    assert agent.extract_code("no code here") is None
    assert TESTS == ["add(1, 2) == 3", "add(-4, 4) == 0", "add(12, 34) == 46"]
    with pytest.raises(ValueError, match="is not `expression == literal`"):
        agent.parse_tests("add(1, 2) == three")


def test_runner_scores_honest_wrong_and_hacking_solutions():
    cheats = {
        "equal to anything": "class Any:\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Any()\n",
        "equal to anything inside a list": "class Any:\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return [Any()]\n",
        "prints a fake summary": "import json\nprint('0' * 32, json.dumps([3, 3]))\ndef add(a, b):\n    return None\n",
        "exits early": "import os\nos._exit(0)\n",
        "loops forever": "while True:\n    pass\n",
        # The solution shares the runner's interpreter: it reaches the runner's globals through its caller's frame.
        "prints the runner's secret": "import json, os, sys\nsecret = sys._getframe(1).f_globals.get('nonce', '')\n"
        "print(secret, json.dumps([3, 3]), flush=True)\nos._exit(0)\n",
        "overwrites the runner's count": "import sys\nrunner = sys._getframe(1).f_globals\n"
        "runner['passed'], runner['tests'] = 3, []\ndef add(a, b):\n    return None\n",
        "replaces the runner's comparison": "import sys\nsys._getframe(1).f_globals['same'] = lambda got, want: True\n"
        "def add(a, b):\n    return None\n",
        "reads the expected values from the sandbox's files": "import os, re\nfound = {}\n"
        "for name in os.listdir('.'):\n    try:\n        text = open(name).read()\n    except Exception:\n"
        "        continue\n    for m in re.finditer(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', text):\n"
        "        found[int(m[1]), int(m[2])] = int(m[3])\ndef add(a, b):\n    return found.get((a, b))\n",
        "prints results of its own": "import json, os\n"
        f"print({agent.RESULTS_TAG!r} + json.dumps([['value', 'None']] * 3), flush=True)\nos._exit(0)\n",
    }
    wrong = "def add(a, b):\n    return a - b\n"

    # The example's limits with 3 s of time, not 10: "loops forever" spins until the time limit ends it.
    limits = dataclasses.replace(agent.LIMITS, wall_time_s=3, cpu_time_s=3)

    async def score(code, tests=TESTS):
        return await agent.run_tests(code, tests, limits)

    async def main():
        results = {name: await score(code) for name, code in cheats.items()}
        results["right"] = await score(SOLUTION)
        results["half right"] = await score("def add(a, b):\n    return abs(a) + b\n")
        results["wrong"] = await score(wrong)
        results["list"] = await score("def add(a, b):\n    return [a + b]\n", ["add(1, 2) == [3]"])
        results["syntax error"] = await score("def add(a, b)\n    return a + b\n")
        return results

    results = asyncio.run(main())
    assert {name: results[name][0] for name in cheats} == dict.fromkeys(cheats, 0)
    assert results["right"][0] == 3 and results["right"][1].count("PASS") == 3
    assert results["half right"][0] == 2 and "FAIL add(-4, 4) == 0: got 8" in results["half right"][1]
    assert results["wrong"][0] == 0 and results["list"][0] == 1
    assert results["syntax error"][0] == 0 and "SyntaxError" in results["syntax error"][1]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """A CPU engine serving the tiny model taught to answer the add problem with SOLUTION in a python block."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    problem = agent.problem_text("Write a function add(a, b) that returns the sum of two integers.")
    messages = [{"role": "system", "content": agent.SYSTEM_PROMPT}, {"role": "user", "content": problem}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    reply = f"```python\n{SOLUTION}```<|im_end|>"
    model = teach_tiny_model(tiny_model_dir, tmp_path_factory.mktemp("coder") / "model", [(prompt, 0), (reply, 1)])
    with engine_server(model) as (_, url):
        yield url, model, problem


def test_agent_solves_the_problem_through_the_anthropic_route(engine):
    url, model, problem = engine
    args = slime_flags(
        agent_function_path=f"{AGENT_MODULE}.run",
        max_turns=3,
        hf_checkpoint=str(model),
        trust_remote_code=False,
        rollout_engine_urls=[url],
        sglang_api_key=None,
        sglang_router_request_timeout_secs=60,
        rollout_max_context_len=None,
    )
    sample = Sample(index=0, prompt=problem, label="\n".join(TESTS))

    async def main():
        done = await agent_rollout.generate(args, sample, {"temperature": 0.0, "max_new_tokens": 96})
        await (await agent_rollout.get_proxy(args)).stop()
        return done, await agent.reward_func(args, done)

    done, reward = asyncio.run(main())
    assert done.status == Status.COMPLETED and done.metadata["agent_answer"] == SOLUTION
    assert reward == 1.0
    # One model turn: the tests passed at once, so the agent asked nothing more.
    assert done.loss_mask == [1] * done.response_length
    assert (
        AutoTokenizer.from_pretrained(model).decode(done.tokens[done.prompt_length :])
        == f"```python\n{SOLUTION}```<|im_end|>"
    )
