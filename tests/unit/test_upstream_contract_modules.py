"""Upstream slime modules its plugins import, called the way upstream's own examples and scripts call them."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from aiohttp import web
from support.flags import slime_flags

from slime.rollout import sglang_rollout
from slime.utils.http_utils import find_free_port
from slime.utils.types import Sample, Status

REPO = Path(__file__).resolve().parents[2]


# ---- rm_hub: math_dapo_utils, grade_answer_verl, math_utils.extract_answer -------------------------------------
def test_math_dapo_compute_score_as_the_retool_example_calls_it():
    from slime.rollout.rm_hub.math_dapo_utils import compute_score

    prompt = "Solve 6 * 7. Put the final answer as Answer: \\boxed{...}\n"
    assert compute_score(prompt + "6*7 is 42.\nAnswer: \\boxed{42}", "42", strict_box_verify=True) == {
        "score": 1.0,
        "acc": True,
        "pred": "42",
    }
    wrong = compute_score(prompt + "Answer: \\boxed{41}", "42", strict_box_verify=True)
    assert (wrong["score"], wrong["acc"], wrong["pred"]) == (-1.0, False, "41")
    # Strict: the box must be near the end; one 150 characters back does not count.
    early = compute_score("Answer: \\boxed{42}" + " more words" * 15, "42", strict_box_verify=True)
    assert (early["score"], early["pred"]) == (-1.0, "")
    # Strict means the exact text; the default mode grades the Answer line by value.
    assert compute_score("Answer: \\boxed{42.0}", "42", strict_box_verify=True)["acc"] is False
    assert compute_score("so\nAnswer: 42.0", "42") == {"score": 1.0, "acc": True, "pred": "42.0"}
    assert compute_score("no final line", "42") == {"score": -1.0, "acc": False, "pred": ""}


def test_math_dapo_pause_tokens_move_the_strict_window():
    from slime.rollout.rm_hub.math_dapo_utils import compute_score

    text = "Answer: \\boxed{7}" + "x" * 300
    assert compute_score(text, "7", strict_box_verify=True)["acc"] is False
    assert compute_score(text, "7", strict_box_verify=True, pause_tokens_index=[1, 2, 3, 50])["acc"] is True
    with pytest.raises(ValueError, match="4 pause tokens"):
        compute_score(text, "7", strict_box_verify=True, pause_tokens_index=[50])


def test_grade_answer_verl_and_extract_answer_as_upstream_rm_hub_uses_them():
    from slime.rollout.rm_hub import grade_answer_verl
    from slime.rollout.rm_hub.math_utils import extract_answer

    assert extract_answer("first \\boxed{1}, then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert extract_answer("no box here") is None
    assert grade_answer_verl("The answer is \\boxed{\\frac{1}{2}}.", "0.5") is True
    assert grade_answer_verl("The answer is \\boxed{3}.", "The solution gives \\boxed{3}") is True
    assert grade_answer_verl("The answer is \\boxed{0}.", 0) is True
    assert grade_answer_verl("The answer is 3.", "3") is False  # nothing boxed
    assert grade_answer_verl("\\boxed{3}", "") is False
    assert grade_answer_verl("\\boxed{4}", "3") is False


# ---- on_policy_distillation --------------------------------------------------------------------------------------
class TeacherServer:
    """A real aiohttp server on loopback answering SGLang's scoring request: the log-prob of input token i is
    -(i + 1) / 10 (and None for the first token), echoing the token ids."""

    def __init__(self):
        self.requests: list[dict] = []

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        ids = body["input_ids"]
        entries = [[None if i == 0 else -(i + 1) / 10, token, None] for i, token in enumerate(ids)]
        return web.json_response({"text": "", "meta_info": {"input_token_logprobs": entries}})

    async def __aenter__(self) -> str:
        app = web.Application()
        app.add_routes([web.post("/generate", self.generate)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = find_free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def test_on_policy_distillation_reward_then_post_process():
    from slime.rollout.on_policy_distillation import post_process_rewards, reward_func

    prompt_ids, response_ids = [11, 12, 13], [21, 22]
    samples = [
        Sample(index=0, tokens=prompt_ids + response_ids, response_length=2, status=Status.COMPLETED),
        Sample(index=1, tokens=prompt_ids + [31], response_length=1, status=Status.ABORTED),  # never scored
    ]
    server = TeacherServer()

    async def score() -> None:
        async with server as base_url:
            args = slime_flags(rm_url=f"{base_url}/generate", rollout_temperature=0.7, reward_key=None)
            samples[0].reward = await reward_func(args, samples[0])
            return args

    args = asyncio.run(score())
    assert server.requests[0]["input_ids"] == prompt_ids + response_ids
    assert server.requests[0]["sampling_params"]["max_new_tokens"] == 0
    assert server.requests[0]["return_logprob"] is True and server.requests[0]["logprob_start_len"] == 0
    assert isinstance(samples[0].reward, dict)  # upstream's contract: the teacher's whole answer

    raw, rewards = post_process_rewards(args, samples)
    assert raw == rewards == [0.0, 0.0]
    # Tokens 3 and 4 of the sequence are the response: -(3 + 1) / 10 and -(4 + 1) / 10.
    assert samples[0].teacher_log_probs == pytest.approx([-0.4, -0.5])
    assert samples[1].teacher_log_probs == [0.0]


def test_on_policy_distillation_names_a_bad_rm_url():
    from slime.rollout.on_policy_distillation import reward_func

    with pytest.raises(ValueError, match="--rm-url"):
        asyncio.run(reward_func(slime_flags(rm_url=None), Sample(tokens=[1, 2], response_length=1)))


# ---- sleep_rollout -----------------------------------------------------------------------------------------------
def test_sleep_rollout_never_returns_and_logs_that_it_sleeps(monkeypatch, caplog):
    from slime.rollout import sleep_rollout

    monkeypatch.setattr(sleep_rollout, "SLEEP_INTERVAL_SECONDS", 0.01)
    caplog.set_level(logging.INFO, logger=sleep_rollout.__name__)
    thread = threading.Thread(target=sleep_rollout.sleep, args=(Namespace(), 3, None), daemon=True)
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive()
    assert any("rollout 3 sleeps on purpose" in record.getMessage() for record in caplog.records)
    monkeypatch.setattr(sleep_rollout, "SLEEP_INTERVAL_SECONDS", 3600.0)  # the daemon thread idles from now on


# ---- sglang_streaming_rollout ------------------------------------------------------------------------------------
class StreamingEngine:
    """A real aiohttp server speaking SGLang's streamed `/generate`: it generates `new_tokens` one event at a time,
    each event cumulative (text and `output_token_logprobs` so far); with `cut_after` it drops the connection after
    that many events, as an aborted stream ends."""

    def __init__(self, new_tokens: list[int], cut_after: int | None = None):
        self.new_tokens = new_tokens
        self.cut_after = cut_after
        self.requests: list[dict] = []
        self.authorizations: list[str | None] = []

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(1, len(self.new_tokens) + 1):
            if self.cut_after is not None and n > self.cut_after:
                request.transport.close()
                return response
            done = n == len(self.new_tokens)
            meta = {
                "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(self.new_tokens[:n])],
                "finish_reason": {"type": "stop"} if done else None,
                "weight_version": "7",
            }
            event = {"text": "t" * n, "meta_info": meta}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def __aenter__(self) -> int:
        app = web.Application()
        app.add_routes([web.post("/generate", self.generate)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = find_free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return port

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def _stream(tiny_model_dir, tmp_path, engine: StreamingEngine, sample: Sample, *flags: str) -> Sample:
    from slime.rollout.sglang_streaming_rollout import generate_streaming
    from slime.utils.arguments import parse_args

    (tmp_path / "p.jsonl").write_text(json.dumps({"input": "What is 1 + 2?"}) + "\n")
    args = parse_args([
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tmp_path / "p.jsonl"), "--num-rollout", "1",
        "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--custom-generate-function-path", "slime.rollout.sglang_streaming_rollout.generate_streaming", *flags,
    ])  # fmt: skip

    async def run() -> Sample:
        async with engine as port:
            args.sglang_router_ip, args.sglang_router_port = "127.0.0.1", port
            return await generate_streaming(args, sample, {"max_new_tokens": 8, "temperature": 1.0})

    return asyncio.run(run())


@pytest.fixture
def fresh_rollout_state(monkeypatch):
    monkeypatch.setattr(sglang_rollout, "_STATE", None)


def test_generate_streaming_writes_the_whole_response(tiny_model_dir, tmp_path, fresh_rollout_state):
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(tiny_model_dir)("What is 1 + 2?", add_special_tokens=False)["input_ids"]
    engine = StreamingEngine([40, 41, 42])
    sample = _stream(tiny_model_dir, tmp_path, engine, Sample(index=0, prompt="What is 1 + 2?"))
    assert engine.requests[0]["stream"] is True and engine.requests[0]["input_ids"] == prompt_ids
    assert sample.tokens == prompt_ids + [40, 41, 42]
    assert (sample.response, sample.response_length, sample.loss_mask) == ("ttt", 3, [1, 1, 1])
    assert sample.rollout_log_probs == [-0.5, -1.0, -1.5]
    assert (sample.status, sample.weight_versions) == (Status.COMPLETED, ["7"])
    assert "lora_path" not in engine.requests[0]


def test_generate_streaming_sends_the_adapter_and_the_engine_key(tiny_model_dir, tmp_path, fresh_rollout_state):
    from slime.utils.lora import POLICY_ADAPTER

    engine = StreamingEngine([40])
    flags = ["--train-backend", "fsdp", "--lora-rank", "4", "--sglang-api-key", "s3cret"]
    sample = _stream(tiny_model_dir, tmp_path, engine, Sample(index=0, prompt="What is 1 + 2?"), *flags)
    assert engine.requests[0]["lora_path"] == POLICY_ADAPTER == "slime-policy"
    assert engine.authorizations == ["Bearer s3cret"]
    assert sample.status == Status.COMPLETED


def test_stream_into_sample_sends_a_samples_images():
    """A vision-language sample's images go as `image_data` (lossless base64 PNG), as the default generate sends them."""
    import io

    from PIL import Image

    from slime.rollout.sglang_streaming_rollout import stream_into_sample

    picture = Image.new("RGB", (3, 2), (10, 20, 30))
    picture.putpixel((1, 1), (200, 0, 7))
    sample = Sample(index=0, tokens=[1, 2, 3], multimodal_inputs={"images": [picture]})
    engine = StreamingEngine([40])

    async def run() -> None:
        async with engine as port:
            args = slime_flags(sglang_router_ip="127.0.0.1", sglang_router_port=port)
            await stream_into_sample(args, sample, {"max_new_tokens": 1})

    asyncio.run(run())
    (sent,) = engine.requests[0]["image_data"]
    decoded = Image.open(io.BytesIO(base64.b64decode(sent)))
    assert decoded.format == "PNG" and decoded.tobytes() == picture.tobytes() and decoded.size == picture.size
    assert engine.requests[0]["input_ids"] == [1, 2, 3] and sample.tokens == [1, 2, 3, 40]


def test_generate_streaming_keeps_the_partial_response_of_a_cut_stream(tiny_model_dir, tmp_path, fresh_rollout_state):
    engine = StreamingEngine([40, 41, 42, 43], cut_after=2)
    sample = _stream(tiny_model_dir, tmp_path, engine, Sample(index=0, prompt="What is 1 + 2?"))
    assert sample.status == Status.ABORTED
    assert sample.tokens[-2:] == [40, 41] and sample.response_length == 2
    assert sample.rollout_log_probs == [-0.5, -1.0] and sample.response == "tt"

    # Continued (partial rollout): the engine is asked for what is left and the new tokens follow the old ones.
    engine = StreamingEngine([50])
    continued = _stream(tiny_model_dir, tmp_path, engine, sample)
    assert engine.requests[0]["sampling_params"]["max_new_tokens"] == 8 - 2
    assert continued.tokens[-3:] == [40, 41, 50] and continued.response == "ttt"
    assert continued.rollout_log_probs == [-0.5, -1.0, -0.5] and continued.status == Status.COMPLETED


# ---- accelerator ---------------------------------------------------------------------------------------------------
def test_accelerator_helpers_answer_for_this_machine(monkeypatch):
    from slime.utils import accelerator

    on_cuda = torch.cuda.is_available()
    assert accelerator.device_type() == ("cuda" if on_cuda else "cpu")
    assert accelerator.device() == (
        torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    )
    assert accelerator.process_group_backend() == ("nccl" if on_cuda else "gloo")
    assert accelerator.process_group_backend("gloo") == "gloo"
    x = torch.ones(4, device=accelerator.device())
    accelerator.synchronize()
    accelerator.empty_cache()
    assert accelerator.memory_allocated() >= (x.numel() * 4 if on_cuda else 0)
    if not on_cuda:
        assert accelerator.get_device_properties() is None and accelerator.device_count() == 1
        with pytest.raises(RuntimeError, match="no accelerator memory on the CPU"):
            accelerator.mem_get_info()
    accelerator.manual_seed(123)
    first = torch.rand(3, device=accelerator.device())
    accelerator.manual_seed(123)
    assert torch.equal(first, torch.rand(3, device=accelerator.device()))

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert accelerator.visible_devices_env_key() == "CUDA_VISIBLE_DEVICES"
    assert [accelerator.resolve_visible_device_id(i) for i in (3, 2.0, "1")] == [1, 0, 1]
    with pytest.raises(RuntimeError, match="not visible"):
        accelerator.resolve_visible_device_id(7)


# ---- external_utils.command_utils ----------------------------------------------------------------------------------
RECORDER = """
import json, os, sys
marker = os.environ["MARKER"]
with open(os.environ["RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "marker_seen": os.path.exists(marker),
               "env": {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "MASTER_ADDR", "A", "B")}}, f)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def test_execute_train_runs_the_train_command_as_upstream_scripts_call_it(tmp_path, monkeypatch):
    import slime.utils.external_utils.command_utils as U

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    script = tmp_path / "fake_train.py"
    script.write_text(RECORDER)
    record, marker = tmp_path / "record.json", tmp_path / "marker"
    env = {"RECORD": str(record), "MARKER": str(marker), "A": "1"}

    U.execute_train(
        train_args="--rollout-batch-size 4 --wandb-group 'two words' ",
        num_gpus_per_node=0,
        megatron_model_type=None,
        train_script=str(script),
        before_ray_job_submit=marker.touch,
        extra_env_vars=env,
        config=U.ExecuteTrainConfig(extra_env_vars="B=2"),
    )
    seen = json.loads(record.read_text())
    assert seen["argv"] == ["--rollout-batch-size", "4", "--wandb-group", "two words"]
    assert seen["marker_seen"] and Path(seen["cwd"]) == REPO
    assert seen["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "MASTER_ADDR": "127.0.0.1", "A": "1", "B": "2"}

    # A Megatron model type puts the model script's MODEL_ARGS first, as bash expands them.
    U.execute_train("--lr 1e-6", 0, "qwen3-0.6B", train_script=str(script), extra_env_vars=env)
    expected = subprocess.run(
        ["bash", "-c", 'source scripts/models/qwen3-0.6B.sh && printf "%s\\n" "${MODEL_ARGS[@]}"'],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")[:-1]
    assert "--num-layers" in expected
    assert json.loads(record.read_text())["argv"] == [*expected, "--lr", "1e-6"]

    with pytest.raises(subprocess.CalledProcessError) as failed:
        U.execute_train("", 0, None, train_script=str(script), extra_env_vars=env | {"EXIT_CODE": "3"})
    assert failed.value.returncode == 3

    record.unlink()
    monkeypatch.setenv("SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    U.execute_train("", 0, None, train_script=str(script), extra_env_vars=env)
    assert not record.exists()


def test_execute_train_refuses_what_it_cannot_launch_here(tmp_path, monkeypatch):
    import slime.utils.external_utils.command_utils as U

    with pytest.raises(ValueError, match="no-such-model.*known:.*qwen3-0.6B"):
        U.execute_train("", 0, "no-such-model")
    with pytest.raises(ValueError, match="launches one node, not 2"):
        U.execute_train("", 0, None, config=U.ExecuteTrainConfig(num_nodes=2))
    with pytest.raises(ValueError, match="no such file"):
        U.execute_train("", 0, None, train_script="missing_train.py")
    monkeypatch.setenv("SLIME_SCRIPT_EXTERNAL_RAY", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="RAY_ADDRESS"):
        U.execute_train("", 0, None)


def test_command_helpers_upstream_scripts_use(monkeypatch):
    import slime.utils.external_utils.command_utils as U

    assert U.exec_command(f"{sys.executable} -c 'print(6 * 7)'", capture_output=True) == "42\n"
    with pytest.raises(subprocess.CalledProcessError):
        U.exec_command("exit 4")
    monkeypatch.setenv("SLIME_TEST_ENABLE_INFINITE_RUN", "True")
    assert U.get_env_enable_infinite_run() is True
    monkeypatch.setenv("SLIME_TEST_ENABLE_INFINITE_RUN", "0")
    assert U.get_env_enable_infinite_run() is False


# ---- observability -------------------------------------------------------------------------------------------------
def test_observability_as_a_custom_rollout_log_function_uses_it():
    from slime.observability import logging_utils
    from slime.observability.metric_utils import compute_rollout_step
    from slime.observability.timer import Timer, timer
    from slime.utils.timer import Timer as SlimeTimer

    args = slime_flags(rollout_batch_size=8, n_samples_per_prompt=4, global_batch_size=16, num_steps_per_rollout=2)
    assert compute_rollout_step(args, 5) == 5
    args.wandb_always_use_train_step = True
    assert compute_rollout_step(args, 5) == 5 * 8 * 4 // 16

    logging_utils.pop_logged_metrics()
    logging_utils.log(args, {"my/score": 0.5, "rollout/step": 10}, step_key="rollout/step")
    logging_utils.log(args, {"my/score": 0.75, "my/other": 1.0}, step_key="rollout/step")
    assert logging_utils.pop_logged_metrics() == {"my/score": 0.75, "my/other": 1.0}
    assert logging_utils.pop_logged_metrics() == {}

    assert Timer is SlimeTimer and Timer() is SlimeTimer()
    Timer().reset()
    with timer("upstream-name"):
        pass
    assert "upstream-name" in Timer().log_dict()


# ---- eval_config.DATASET_RUNTIME_SPECS -----------------------------------------------------------------------------
def test_dataset_runtime_specs_resolve_as_the_eval_sets_do(tmp_path):
    from slime.utils.eval_config import DATASET_RUNTIME_SPECS, EvalDatasetConfig, eval_datasets, pick_from_args

    # Upstream plugins take a subset of the table and resolve each field from the flags.
    field_names = ("n_samples_per_eval_prompt", "temperature", "top_p", "top_k", "max_response_len")
    specs = {name: DATASET_RUNTIME_SPECS[name] for name in field_names}
    assert specs["temperature"] == {
        "dataset_keys": ("temperature",),
        "default_keys": ("temperature",),
        "arg_attrs": ("eval_temperature", "rollout_temperature"),
    }
    args = slime_flags(
        rollout_temperature=0.9, eval_temperature=None, eval_top_p=0.5, rollout_max_response_len=64,
        eval_prompt_data=[("set", str(tmp_path / "set.jsonl"))],
    )  # fmt: skip
    picked = {name: pick_from_args(args, spec["arg_attrs"]) for name, spec in specs.items()}
    assert picked["temperature"] == 0.9 and picked["top_p"] == 0.5 and picked["max_response_len"] == 64
    # The eval sets slime runs are resolved by the same table.
    (dataset,) = eval_datasets(args)
    assert isinstance(dataset, EvalDatasetConfig)
    assert {name: getattr(dataset, name) for name in field_names} == picked
