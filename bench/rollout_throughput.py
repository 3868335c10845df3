"""Rollout throughput: router + CPU engine vs plain batched `model.generate` in one process.

    python bench/rollout_throughput.py --model models/SmolLM2-135M-Instruct [--dtype bfloat16]

Both sides decode the same 32 chat prompts for exactly 64 new tokens (EOS ignored) at
temperature 1 with the same thread count and parameter dtype, one after the other. Prints tokens/s of each, the ratio
engine / generate (the target is >= 0.9: the HTTP path should cost little), and the engine's share of the
compute floor (2 FLOPs per parameter per token at the cores' FP32 peak, the larger of the clock's and a measured
matmul's; a bfloat16 run is measured against the same FP32 floor, so its share says how much faster than that floor
the CPU's bf16 units make decoding).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slime.backends.sglang_utils.engine_actor import RolloutEngine
from slime.backends.sglang_utils.router import add_worker, start_router, wait_for_workers
from slime.utils.arguments import default_args
from slime.utils.perf import cpu_peak_tflops


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        messages = [{"role": "user", "content": f"What is {10 + i} + {57 + 2 * i}? Explain step by step."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def bench_generate(model_path: str, prompts: list[list[int]], new_tokens: int, threads: int, dtype: str) -> float:
    """Tokens/s of one left-padded batched `generate` call (after a warm-up call)."""
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id)

    def run(tokens: int) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            output = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        assert output.shape[1] - batch["input_ids"].shape[1] == tokens
        return time.perf_counter() - started

    run(4)
    return len(prompts) * new_tokens / run(new_tokens)


async def _send_all(url: str, prompts: list[list[int]], new_tokens: int) -> int:
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:

        async def one(ids):
            payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
            async with session.post(f"{url}/generate", json=payload) as response:
                response.raise_for_status()
                return (await response.json())["meta_info"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(ids) for ids in prompts)))


def bench_engine(model_path: str, prompts: list[list[int]], new_tokens: int, threads: int, dtype: str) -> float:
    """Tokens/s of the same prompts sent concurrently through sglang-router to one CPU engine."""
    args = default_args(
        hf_checkpoint=model_path,
        cpu_engine_num_threads=threads,
        cpu_engine_max_running_requests=len(prompts),
        sglang_router_request_timeout_secs=3600,
        sglang_server_args={"dtype": dtype},
    )
    router = start_router(args)
    engine = RolloutEngine(args, rank=0, backend="cpu")
    try:
        engine.start(timeout=300)
        add_worker(router.url, engine.url())
        wait_for_workers(router.url, [engine.url()], timeout=60)
        asyncio.run(_send_all(router.url, prompts[:4], 4))  # warm-up
        started = time.perf_counter()
        tokens = asyncio.run(_send_all(router.url, prompts, new_tokens))
        elapsed = time.perf_counter() - started
        assert tokens == len(prompts) * new_tokens, tokens
        return tokens / elapsed
    finally:
        engine.shutdown()
        router.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = make_prompts(tokenizer, args.num_prompts)
    engine_tps = bench_engine(args.model, prompts, args.new_tokens, args.threads, args.dtype)
    generate_tps = bench_generate(args.model, prompts, args.new_tokens, args.threads, args.dtype)
    print(f"{args.num_prompts} prompts x {args.new_tokens} new tokens, {args.threads} thread(s), {args.dtype}")
    print(f"router + cpu engine : {engine_tps:8.1f} tok/s")
    print(f"model.generate      : {generate_tps:8.1f} tok/s")
    print(f"ratio engine/generate: {engine_tps / generate_tps:.2f}")
    # The compute floor: 2 FLOPs per parameter per token at the cores' FP32 peak (slime.utils.perf).
    config = AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    # The peak is the larger of the clock-based one and what a large float32 matmul reaches: a core may run
    # above the `cpu MHz` it lists (2100 MHz listed, 157 GFLOP/s measured, on one host of these machines).
    listed, measured = cpu_peak_tflops(args.threads) * 1e12, matmul_flops(args.threads)
    peak = max(listed, measured)
    floor = peak / (2 * params)
    print(
        f"compute floor      : {floor:8.1f} tok/s ({params / 1e6:.1f}M parameters, {peak / 1e9:.0f} GFLOP/s peak: "
        f"{listed / 1e9:.0f} from the clock, {measured / 1e9:.0f} measured by a 2048 x 2048 float32 matmul)"
    )
    print(f"engine / floor     : {engine_tps / floor:8.1%}")


def matmul_flops(threads: int, size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a float32 `size` x `size` matmul on `threads` threads (best of `repeats`)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats + 2):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


if __name__ == "__main__":
    main()
