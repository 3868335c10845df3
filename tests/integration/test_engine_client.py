"""EngineClient against the real CPU engine, engine command lines, and the HTTP helpers under them."""

from __future__ import annotations

import asyncio
import http.server
import math
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.flags import slime_flags

from slime.backends.sglang_utils.engine_actor import RolloutEngine
from slime.backends.sglang_utils.engine_command_line import (
    build_cpu_engine_args,
    build_sglang_server_args,
    drop_parser_defaults,
    options_to_cli_args,
)
from slime.utils.engine_args import ENGINE_API_KEY_ENV
from slime.utils.http_utils import (
    PORT_RANGE,
    HTTPRequestError,
    async_post_json,
    close_async_session,
    find_free_port,
    get_json,
    post_json,
    wait_until_healthy,
)

# ---------------------------------------------------------------- engine command lines


def test_sglang_server_args_forward_user_flags_after_managed_ones():
    args = slime_flags(
        sglang_server_args={
            "mem_fraction_static": 0.7,
            "cuda-graph-bs": [1, 2, 4],
            "enable_dp_attention": True,
            "disable_radix_cache": False,
            "json_model_override_args": {"rope_scaling": None},
            "chunked_prefill_size": None,
        },
        offload_rollout=True,
    )
    cli = build_sglang_server_args(
        args, model_path="/ckpt", host="10.0.0.1", port=30001, tp_size=2, base_gpu_id=4, nccl_port=30002
    )
    expected = [
        "--model-path", "/ckpt", "--host", "10.0.0.1", "--port", "30001", "--tp-size", "2",
        "--base-gpu-id", "4", "--nccl-port", "30002", "--nnodes", "1", "--node-rank", "0",
        "--enable-memory-saver",
        "--mem-fraction-static", "0.7", "--cuda-graph-bs", "1", "2", "4", "--enable-dp-attention",
        "--json-model-override-args", '{"rope_scaling": null}',
    ]  # fmt: skip
    assert cli == expected


def test_sglang_server_args_multi_node_and_no_offload():
    args = slime_flags(sglang_server_args={}, offload_rollout=False)
    cli = build_sglang_server_args(
        args, model_path="/m", host="h", port=1, tp_size=16, base_gpu_id=0, nccl_port=2,
        dist_init_addr="10.0.0.1:5000", nnodes=2, node_rank=1,
    )  # fmt: skip
    assert "--enable-memory-saver" not in cli and "--enable-return-routed-experts" not in cli
    assert cli[cli.index("--dist-init-addr") + 1] == "10.0.0.1:5000"
    assert cli[cli.index("--nnodes") + 1] == "2" and cli[cli.index("--node-rank") + 1] == "1"


@pytest.mark.parametrize(
    "field, hint", [("tp_size", "--rollout-num-gpus-per-engine"), ("model-path", "--hf-checkpoint"), ("port", "free")]
)
def test_sglang_server_args_refuse_managed_fields(field, hint):
    args = slime_flags(sglang_server_args={field: "x", "mem_fraction_static": 0.5})
    with pytest.raises(ValueError) as error:
        build_sglang_server_args(args, model_path="/m", host="h", port=1, tp_size=1, base_gpu_id=0, nccl_port=2)
    assert f"--sglang-{field.replace('_', '-')}" in str(error.value)
    assert hint in str(error.value)


def test_cpu_engine_args_defaults_and_overrides():
    assert build_cpu_engine_args(slime_flags(), model_path="/m", host="127.0.0.1", port=5) == [
        "--model-path", "/m", "--host", "127.0.0.1", "--port", "5",
        "--max-running-requests", "32", "--max-queued-requests", "4096", "--num-threads", "1",
    ]  # fmt: skip
    args = slime_flags(cpu_engine_max_running_requests=8, cpu_engine_num_threads=2, sglang_server_args={"x": 1})
    cli = build_cpu_engine_args(args, model_path="/m", host="h", port=5)
    assert cli[-6:] == ["--max-running-requests", "8", "--max-queued-requests", "4096", "--num-threads", "2"]


def test_trust_remote_code_reaches_both_engines_command_lines():
    from slime.backends.cpu_engine.server import parse_args

    for trust in (False, True):
        args = slime_flags(trust_remote_code=trust)
        sglang = build_sglang_server_args(
            args, model_path="/m", host="h", port=1, tp_size=1, base_gpu_id=0, nccl_port=2
        )
        cpu = build_cpu_engine_args(args, model_path="/m", host="127.0.0.1", port=5)
        assert ("--trust-remote-code" in sglang, "--trust-remote-code" in cpu) == (trust, trust)
        assert parse_args(cpu).trust_remote_code is trust
    with pytest.raises(ValueError, match="--sglang-trust-remote-code: use --trust-remote-code"):
        build_sglang_server_args(
            slime_flags(sglang_server_args={"trust_remote_code": True}),
            model_path="/m", host="h", port=1, tp_size=1, base_gpu_id=0, nccl_port=2,
        )  # fmt: skip


def test_cpu_engine_args_forward_the_api_key_and_queue_limit(monkeypatch):
    args = slime_flags(
        cpu_engine_max_queued_requests=64, sglang_server_args={"api-key": "k3y", "mem_fraction_static": 0.5}
    )
    cli = build_cpu_engine_args(args, model_path="/m", host="127.0.0.1", port=5)
    assert cli[cli.index("--max-queued-requests") + 1] == "64"
    assert "k3y" not in cli and "--api-key" not in cli  # the key goes by the environment
    assert "--mem-fraction-static" not in cli  # means nothing to the CPU engine
    command, env = RolloutEngine(args, rank=0, backend="cpu", port=5, model_path="/m")._server_command()
    assert env[ENGINE_API_KEY_ENV] == "k3y" and "k3y" not in command
    # The engine's own parser reads them back, the key from its environment.
    from slime.backends.cpu_engine.server import parse_args

    monkeypatch.setenv(ENGINE_API_KEY_ENV, env[ENGINE_API_KEY_ENV])
    parsed = parse_args(cli)
    assert (parsed.api_key, parsed.max_queued_requests, parsed.host) == ("k3y", 64, "127.0.0.1")
    monkeypatch.delenv(ENGINE_API_KEY_ENV)
    assert parse_args(cli).api_key is None


def test_options_follow_the_target_parser():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-x", action="store_true")
    parser.add_argument("--no-cache", dest="cache", action="store_false")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prefill", action="append", nargs="+")
    parser.add_argument("--sizes", type=int, nargs="*", default=[])
    parser.add_argument("--level", default="info")
    options = {"enable_x": True, "cache": False, "warmup": False, "prefill": [["http://a", "9000"], ["http://b"]],
               "sizes": [1, 2], "level": "info", "not_in_parser": 3}  # fmt: skip
    changed = drop_parser_defaults(options, parser)
    assert "level" not in changed and changed["not_in_parser"] == 3
    cli = options_to_cli_args(changed, parser)
    assert cli == ["--enable-x", "--no-cache", "--no-warmup", "--prefill", "http://a", "9000", "--prefill",
                   "http://b", "--sizes", "1", "2", "--not-in-parser", "3"]  # fmt: skip
    # Round trip: the target parser reads back exactly the changed values, and defaults for the rest.
    parsed = vars(parser.parse_args(cli[:-2]))
    assert parsed == {"enable_x": True, "cache": False, "warmup": False, "prefill": [["http://a", "9000"], ["http://b"]],
                      "sizes": [1, 2], "level": "info"}  # fmt: skip


@pytest.mark.gpu
def test_sglang_server_args_parse_with_real_sglang():
    pytest.importorskip("sglang")
    from slime.backends.sglang_utils.engine_command_line import sglang_cli_parser
    from slime.utils.arguments import SGLANG_MANAGED_FIELDS

    parser = sglang_cli_parser()
    # Shaped like slime's parser output: every unmanaged ServerArgs field at its default, plus the user's changes.
    every_field = {
        action.dest: action.default for action in parser._actions if action.dest not in SGLANG_MANAGED_FIELDS
    }
    user_changes = {"mem_fraction_static": 0.6, "cuda_graph_bs_decode": [1, 2]}
    args = slime_flags(
        sglang_server_args=every_field | user_changes, offload_rollout=True, use_rollout_routing_replay=True
    )
    cli = build_sglang_server_args(
        args, model_path="/ckpt", host="127.0.0.1", port=30001, tp_size=2, base_gpu_id=1, nccl_port=30002
    )
    parsed = parser.parse_args(cli)
    assert (parsed.model_path, parsed.tp_size, parsed.base_gpu_id, parsed.port) == ("/ckpt", 2, 1, 30001)
    assert parsed.mem_fraction_static == 0.6 and parsed.cuda_graph_bs_decode == [1, 2] and parsed.enable_memory_saver
    assert parsed.enable_return_routed_experts  # --use-rollout-routing-replay
    # Unchanged defaults stay off the command line: only slime's fields and the two changes are there.
    assert sorted(word for word in cli if word.startswith("--")) == sorted(
        ["--model-path", "--host", "--port", "--tp-size", "--base-gpu-id", "--nccl-port", "--nnodes", "--node-rank",
         "--enable-memory-saver", "--enable-return-routed-experts", "--mem-fraction-static", "--cuda-graph-bs"]
    )  # fmt: skip


# ---------------------------------------------------------------- HTTP helpers


def test_find_free_port_is_bindable_unique_and_honours_exclude():
    ports = [find_free_port() for _ in range(20)]
    assert len(set(ports)) == 20  # one process never gets a port twice
    assert all(PORT_RANGE[0] <= port < PORT_RANGE[1] for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
    with pytest.raises(RuntimeError, match="no free port"):
        find_free_port(exclude=set(range(*PORT_RANGE)))


def test_find_free_port_ignores_the_global_random_seed():
    # Every process of a run seeds `random` alike; concurrent engines must still probe from different ports.
    random.seed(0)
    first = find_free_port()
    random.seed(0)
    second = find_free_port()
    random.seed(0)
    third = find_free_port()
    # With a seeded start, each call would probe upward from the same port and return neighbours.
    assert not (second == first + 1 and third == second + 1)


def test_wait_until_healthy_fails_fast_with_log_tail_when_process_exits(tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        lines = "; ".join(f"print('line {i}')" for i in range(80))
        process = subprocess.Popen([sys.executable, "-c", f"{lines}; raise SystemExit(3)"], stdout=log)
    url = f"http://127.0.0.1:{find_free_port()}/health"
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        wait_until_healthy(url, timeout=60, process=process, log_path=log_path)
    assert time.monotonic() - start < 30
    message = str(error.value)
    assert url in message and "code 3" in message
    assert "line 79" in message and "line 30" in message and "line 29" not in message  # last 50 of 80 lines


def test_wait_until_healthy_times_out_naming_url_and_timeout():
    url = f"http://127.0.0.1:{find_free_port()}/health"
    with pytest.raises(TimeoutError) as error:
        wait_until_healthy(url, timeout=1, poll_interval=0.1)
    assert url in str(error.value) and "1s" in str(error.value)


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers POST /echo with the body it got and POST /reject with 422."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        status, reply = (200, body) if self.path == "/echo" else (422, b"field 'foo' is not allowed")
        self.send_response(status)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def _serve(port: int) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_post_json_and_async_post_json_report_status_and_body():
    port = find_free_port()
    server = _serve(port)
    try:
        assert post_json(f"http://127.0.0.1:{port}/echo", {"a": [1, 2]}) == {"a": [1, 2]}
        with pytest.raises(HTTPRequestError) as error:
            post_json(f"http://127.0.0.1:{port}/reject", {"foo": 1})
        assert error.value.status == 422 and "field 'foo' is not allowed" in str(error.value)

        async def call(path):
            try:
                return await async_post_json(f"http://127.0.0.1:{port}/{path}", {"b": 2})
            finally:
                await close_async_session()

        assert asyncio.run(call("echo")) == {"b": 2}
        with pytest.raises(HTTPRequestError) as error:
            asyncio.run(call("reject"))
        assert error.value.status == 422 and "/reject" in str(error.value)
    finally:
        server.shutdown()


async def _post_echo(port: int, max_retries: int):
    try:
        return await async_post_json(
            f"http://127.0.0.1:{port}/echo", {"x": 1}, max_retries=max_retries, retry_delay=0.05
        )
    finally:
        await close_async_session()


def test_async_post_json_gives_up_after_its_retries():
    with pytest.raises(ConnectionError, match="2 attempts"):
        asyncio.run(_post_echo(find_free_port(), max_retries=1))


def test_async_post_json_retries_until_the_server_is_up():
    port = find_free_port()
    late_servers = []
    starter = threading.Timer(0.5, lambda: late_servers.append(_serve(port)))
    starter.start()
    try:
        # Backoff 0.05 * (1 + 2 + 4 + 8 + 16 + ...) s outlasts the 0.5 s the server takes to appear.
        assert asyncio.run(_post_echo(port, max_retries=8)) == {"x": 1}
    finally:
        starter.join()
        for server in late_servers:
            server.shutdown()


# ---------------------------------------------------------------- EngineClient against the real CPU engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from slime.backends.sglang_utils.engine_actor import RolloutEngine

    args = slime_flags(hf_checkpoint=str(tiny_model_dir), server_log_dir=str(tmp_path_factory.mktemp("logs")))
    engine = RolloutEngine(args, rank=0, backend="cpu")
    engine.start(timeout=180)
    yield engine
    engine.shutdown()
    assert not engine.is_alive()


def _generate(engine, input_ids, max_new_tokens=4):
    return engine.generate(
        {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            "return_logprob": True,
        }
    )


def test_health_info_and_generate(engine, tiny_model_dir):
    assert engine.is_alive() and engine.health() and engine.health_generate()
    assert engine.get_model_info()["model_path"] == str(tiny_model_dir)
    assert isinstance(engine.get_server_info(), dict)
    prompt = [5, 6, 7, 8]
    response = _generate(engine, prompt)
    meta = response["meta_info"]
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(response["output_ids"]) <= 4
    assert [token for _, token, _ in meta["output_token_logprobs"]] == response["output_ids"]
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert isinstance(response["text"], str)


def test_flush_abort_pause_continue(engine):
    engine.flush_cache()
    engine.abort_request(rid="no-such-request")
    engine.abort_request(abort_all=True)
    with pytest.raises(ValueError, match="rid"):
        engine.abort_request()
    engine.pause_generation()
    engine.continue_generation()
    assert _generate(engine, [1, 2, 3], max_new_tokens=2)["meta_info"]["completion_tokens"] >= 1


def test_flush_waits_up_to_its_bound_for_running_requests_to_leave(engine):
    """A weight push flushes right after its pause, while SGLang may still be ending the requests the pause aborted:
    `flush_cache(wait=...)` retries the engine's 400 (requests running) within its bound, then raises it."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_generate, engine, [1, 2, 3], 400)
        deadline = time.monotonic() + 60
        while get_json(f"{engine.url()}/v1/loads")["num_running_reqs"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        engine.pause_generation(mode="in_place")  # the request stays in flight, so the flush keeps refusing
        try:
            with pytest.raises(HTTPRequestError) as refused:
                engine.flush_cache()
            assert refused.value.status == 400
            started = time.monotonic()
            with pytest.raises(HTTPRequestError):
                engine.flush_cache(wait=0.5)
            assert time.monotonic() - started >= 0.5  # retried for the whole bound, then raised
            # The request leaves during the wait: the flush then succeeds.
            threading.Timer(0.5, lambda: engine.abort_request(abort_all=True)).start()
            engine.flush_cache(wait=30)
        finally:
            engine.continue_generation()
        assert running.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"


def test_release_and_resume_memory(engine):
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert _generate(engine, [1, 2, 3], max_new_tokens=2)["meta_info"]["completion_tokens"] >= 1


def _zeroed_model(tiny_model_dir):
    """The tiny model with every weight set to 0: logits are all 0, so each output log-prob is -ln(vocab)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model


def _assert_uniform_logprobs(response, vocab_size, expected_version):
    uniform = -math.log(vocab_size)  # softmax of equal logits
    logprobs = [logprob for logprob, _, _ in response["meta_info"]["output_token_logprobs"]]
    assert logprobs and all(abs(lp - uniform) < 1e-4 for lp in logprobs)
    assert response["meta_info"]["weight_version"] == expected_version


def _assert_not_uniform(response, vocab_size):
    logprobs = [logprob for logprob, _, _ in response["meta_info"]["output_token_logprobs"]]
    assert any(abs(lp + math.log(vocab_size)) > 1e-3 for lp in logprobs)


def test_update_weights_from_disk(engine, tiny_model_dir, tmp_path):
    model = _zeroed_model(tiny_model_dir)
    model.save_pretrained(tmp_path)
    engine.update_weights_from_disk(str(tmp_path), weight_version="zeros")
    _assert_uniform_logprobs(_generate(engine, [5, 6, 7]), model.config.vocab_size, "zeros")
    engine.update_weights_from_disk(str(tiny_model_dir), weight_version="original")
    response = _generate(engine, [5, 6, 7])
    _assert_not_uniform(response, model.config.vocab_size)
    assert response["meta_info"]["weight_version"] == "original"
    with pytest.raises(HTTPRequestError):
        engine.update_weights_from_disk(str(tmp_path / "missing"))


def test_update_weights_from_tensor(engine, tiny_model_dir):
    from slime.utils.weight_transport import serialize_named_tensors

    model = _zeroed_model(tiny_model_dir)
    payload = [serialize_named_tensors(list(model.state_dict().items()))]
    engine.update_weights_from_tensor(payload, flush_cache=True, weight_version="tensor-zeros")
    _assert_uniform_logprobs(_generate(engine, [9, 10]), model.config.vocab_size, "tensor-zeros")
    with pytest.raises(HTTPRequestError) as error:
        engine.update_weights_from_tensor(payload, load_format="flattened_bucket")
    assert error.value.status == 400 and "load_format" in error.value.body
    engine.update_weights_from_disk(str(tiny_model_dir), weight_version="original")
    _assert_not_uniform(_generate(engine, [9, 10]), model.config.vocab_size)


@pytest.mark.reliability("trainer pushes a weight update the engine refuses", "the error carries the engine's reason")
def test_refused_update_raises_with_the_engine_message(engine, tiny_model_dir):
    import torch

    from slime.utils.weight_transport import serialize_named_tensors

    model = _zeroed_model(tiny_model_dir)
    named = [(name, tensor.to(torch.int64)) for name, tensor in model.state_dict().items()]
    with pytest.raises(HTTPRequestError) as error:
        engine.update_weights_from_tensor([serialize_named_tensors(named)], weight_version="ints")
    assert error.value.status == 400
    assert "wrong dtypes" in str(error.value) and "nothing was changed" in str(error.value)
    _assert_not_uniform(_generate(engine, [9, 10]), model.config.vocab_size)
    assert engine.get_model_info()["weight_version"] != "ints"


def test_update_weights_from_distributed_over_gloo(engine, tiny_model_dir):
    import torch.distributed as dist

    from slime.utils.weight_transport import init_process_group_like_sglang

    model = _zeroed_model(tiny_model_dir)
    named = list(model.state_dict().items())
    port, group_name = find_free_port(), "test_weight_sync"
    with ThreadPoolExecutor(1) as pool:
        # The engine (rank 1) and this process (rank 0, the trainer) must join at the same time.
        joined = pool.submit(engine.init_weights_update_group, "127.0.0.1", port, 1, 2, group_name, "gloo")
        group = init_process_group_like_sglang("gloo", "127.0.0.1", port, 0, 2, group_name)
        joined.result(timeout=60)
        received = pool.submit(
            engine.update_weights_from_distributed,
            names=[name for name, _ in named],
            dtypes=[str(tensor.dtype).removeprefix("torch.") for _, tensor in named],
            shapes=[list(tensor.shape) for _, tensor in named],
            group_name=group_name,
            weight_version="dist-zeros",
        )
        for _, tensor in named:
            dist.broadcast(tensor, src=0, group=group)
        received.result(timeout=60)
        dist.destroy_process_group(group)
    _assert_uniform_logprobs(_generate(engine, [11, 12]), model.config.vocab_size, "dist-zeros")
    engine.destroy_weights_update_group(group_name)
    with pytest.raises(HTTPRequestError, match="no weight update group"):
        engine.destroy_weights_update_group(group_name)
    engine.update_weights_from_disk(str(tiny_model_dir), weight_version="original")
    _assert_not_uniform(_generate(engine, [11, 12]), model.config.vocab_size)


def test_lora_rank_turns_on_lora_serving_in_both_engines_command_lines():
    from slime.backends.cpu_engine.server import parse_args

    def sglang_cli(args) -> list[str]:
        return build_sglang_server_args(args, model_path="/m", host="h", port=1, tp_size=1, base_gpu_id=0, nccl_port=2)

    args = slime_flags(lora_rank=8, target_modules=["all-linear"], sglang_server_args={"max_loras_per_batch": 2})
    sglang = sglang_cli(args)
    assert "--enable-lora" in sglang and sglang[sglang.index("--max-lora-rank") + 1] == "8"
    assert sglang[sglang.index("--lora-target-modules") + 1] == "all"  # SGLang's name for every linear layer
    served = parse_args(build_cpu_engine_args(args, model_path="/m", host="127.0.0.1", port=5))
    assert (served.enable_lora, served.max_lora_rank, served.max_loras_per_batch) == (True, 8, 2)
    assert served.lora_target_modules == ["all-linear"]
    leaf = slime_flags(lora_rank=4, target_modules=["q_proj", "v_proj"])
    served = parse_args(build_cpu_engine_args(leaf, model_path="/m", host="127.0.0.1", port=5))
    assert served.lora_target_modules == ["q_proj", "v_proj"]
    # Without --lora-rank no LoRA field reaches the CPU engine (max_loras_per_batch is ignored with a warning).
    plain = slime_flags(sglang_server_args={"max_loras_per_batch": 2})
    assert not [flag for flag in build_cpu_engine_args(plain, model_path="/m", host="h", port=5) if "lora" in flag]
    # --lora-train-only: the engines keep the base and serve no adapter.
    base_only = slime_flags(lora_rank=8, target_modules=["all-linear"], lora_train_only=True)
    assert not [flag for flag in sglang_cli(base_only) if "lora" in flag]
    assert not [flag for flag in build_cpu_engine_args(base_only, model_path="/m", host="h", port=5) if "lora" in flag]
    # Released weights come back only from SGLang's CPU copy: no adapter push resends the base (nor does a
    # --lora-train-only run, which pushes nothing).
    for lora_rank, train_only, backup in ((8, False, True), (8, True, True), (0, False, False)):
        offloaded = slime_flags(
            lora_rank=lora_rank, target_modules=["all-linear"], offload_rollout=True, lora_train_only=train_only
        )
        assert ("--enable-weights-cpu-backup" in sglang_cli(offloaded)) is backup
