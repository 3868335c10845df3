"""Seconds and bytes to push a model's weights to a real CPU engine over each transport, after one optimizer step,
against a plain in-process `load_state_dict(state_dict())` copy.

Run from the repository root:

    python -m bench.weight_sync --model models/SmolLM2-135M-Instruct --repeats 3
    python -m bench.weight_sync --transports disk delta adapter-by-value   # full vs delta vs adapter

Without the model folder (`python tools/prepare_smollm2.py` makes it offline) the bench says so and falls back to
a tiny random Llama built here (tests/support/tiny_model.py), printing which model it measured.

This process plays training rank 0 (world size 1, gloo) holding the HF model; one engine server
(`python -m slime.backends.cpu_engine`, one thread) serves the same model. Each push goes through
`WeightUpdater.push` (pause, flush, send, resume) with buckets of `--buffer-size` bytes:

- tensor: two named shared-memory segments the trainer reuses every push, `/update_weights_from_tensor`
  (colocated engines, same host); the warm-up push creates and maps them, the timed ones only copy;
- broadcast: a gloo group with the engine, `/update_weights_from_distributed`;
- disk: HF safetensors shards under `--disk-dir`, `/update_weights_from_disk` (previous push deleted);
- delta: the same with `--update-weight-mode delta`: the warm-up push is full, each timed one writes only the
  changed tensors' zstd-compressed xor with the previous push (`--delta-encoding`), which the engine applies to its
  live weights; bytes moved are the delta folder's payload;
- adapter: `--lora-rank 16` on every linear layer, colocated: only the LoRA adapter, through a shared-memory
  segment, to `/load_lora_adapter_from_tensors`, the engine serving it beside the base it loaded;
- adapter-by-value: the same adapter in the request body (engines on other hosts).

Before each push the model takes one AdamW step (`--lr`, on a random batch; the adapter alone for the adapter
rows), and afterwards the engine's probe log-probs must equal this process's (the gap is printed). Timings are the best of `--repeats` pushes after one warm-up push.
Each transport is the one `choose_transport` picks for the same flags.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils import lora
from slime.backends.sglang_utils.http_client import EngineClient
from slime.backends.weight_sync import WeightUpdater, choose_transport, engine_prompt_log_probs
from slime.utils import weight_delta
from slime.utils.arguments import default_args
from slime.utils.http_utils import find_free_port, wait_until_healthy
from slime.utils.lora import POLICY_ADAPTER
from slime.utils.weight_sync import bucket_named_tensors, probe_tokens

REPO = Path(__file__).resolve().parents[1]
LORA_RANK = 16
DISK_TRANSPORTS = ("disk", "delta")


def start_engine(model: str) -> tuple[subprocess.Popen, str]:
    port = find_free_port()
    command = [sys.executable, "-m", "slime.backends.cpu_engine", "--model-path", model, "--port", str(port)]
    command += ["--enable-lora", "--max-lora-rank", str(LORA_RANK)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([*command, "--num-threads", "1"], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(f"{url}/health", 300, process=process)
    return process, url


def probe_gap(model: torch.nn.Module, client: EngineClient, probe: list[int], lora_path: str | None) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([probe]), use_cache=False).logits[0, :-1]
    mine = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)
    return float((torch.tensor(engine_prompt_log_probs(client, probe, lora_path)) - mine).abs().max())


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, vocab_size: int, seed: int) -> None:
    """One AdamW step of next-token loss on a random 2 x 32 batch: the change a training step makes."""
    tokens = torch.randint(0, vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    model.train()
    model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def pushed_folder_bytes(disk_dir: str) -> tuple[int, str]:
    """Bytes of the weight files of the newest push folder under `disk_dir`, and what kind of folder it is."""
    (folder,) = [p for p in Path(disk_dir).iterdir() if p.name.startswith("weights-v")]
    delta = "-delta-" in folder.name
    files = [f for f in folder.iterdir() if f.suffix == ".safetensors" or f.name == weight_delta.MANIFEST]
    return sum(f.stat().st_size for f in files), "delta" if delta else "full"


def time_pushes(
    model, client, updater: WeightUpdater, buffer_size: int, repeats: int, probe: list[int], lr: float,
    adapter: bool = False, disk_dir: str | None = None,
) -> tuple[float, float, int]:  # fmt: skip
    """Best seconds of `repeats` pushes (after a warm-up), each after one optimizer step, the largest probe gap after
    any of them, and the bytes a push moves (disk: the newest folder's weight files). `adapter`: `model` is a peft
    model and only its adapter trains and is pushed."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    best, gap, moved = float("inf"), 0.0, 0
    for attempt in range(repeats + 1):
        optimizer_step(model, optimizer, model.config.vocab_size, seed=attempt)
        if adapter:
            named = list(lora.adapter_tensors(model))
        else:
            named = [(n, p.detach()) for n, p in model.named_parameters()]
        buckets = bucket_named_tensors(named, buffer_size)
        start = time.perf_counter()
        updater.push(buckets)
        seconds = time.perf_counter() - start
        if attempt:  # attempt 0 warms up (for delta: the full push that gives the engines their base)
            best = min(best, seconds)
            moved = (
                pushed_folder_bytes(disk_dir)[0] if disk_dir else sum(t.numel() * t.element_size() for _, t in named)
            )
        gap = max(gap, probe_gap(model, client, probe, POLICY_ADAPTER if adapter else None))
    return best, gap, moved


def model_or_fallback(path: str, workdir: str) -> tuple[str, str]:
    """(folder, label) of the model to measure: `path` when it is a HF folder, else a tiny random Llama built in
    `workdir`, saying so."""
    if (Path(path) / "config.json").is_file():
        return str(Path(path).absolute()), path
    print(
        f"{path} is not a prepared model folder (python tools/prepare_smollm2.py makes SmolLM2-135M-Instruct "
        "offline); measuring a tiny random Llama instead (hidden 256, 4 layers, vocabulary 320)"
    )
    sys.path.insert(0, str(REPO / "tests"))
    from support.tiny_model import build_tiny_model

    folder = build_tiny_model(Path(workdir) / "tiny-llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4)
    return str(folder), "tiny random Llama (hidden 256, 4 layers)"


def lora_model(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of `base` (the weights the engine holds now) with a rank-`LORA_RANK` adapter on every linear layer,
    B random (peft starts it at zero)."""
    config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear")
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.01)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the step before each push")
    parser.add_argument("--buffer-size", type=int, default=512 * 1024**2, help="--update-weight-buffer-size")
    parser.add_argument("--disk-dir", default=None, help="--update-weight-disk-dir (default: a temporary folder)")
    parser.add_argument("--delta-encoding", default="xor", choices=weight_delta.ENCODINGS)
    parser.add_argument(
        "--transports", nargs="+", default=["tensor", "broadcast", "disk", "delta", "adapter", "adapter-by-value"]
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    workdir = tempfile.TemporaryDirectory(prefix="weight_sync_bench_model_")
    model_dir, label = model_or_fallback(args.model, workdir.name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    probe = probe_tokens(model.config.vocab_size)

    copy_target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    copy_target.load_state_dict(model.state_dict())  # warm-up
    copy_s = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        copy_target.load_state_dict(model.state_dict())
        copy_s = min(copy_s, time.perf_counter() - start)
    del copy_target

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    process, url = start_engine(model_dir)
    client = EngineClient(url)
    rows = [("state_dict copy (1 process)", copy_s, nbytes, 0.0, "")]
    try:
        for transport in args.transports:
            with tempfile.TemporaryDirectory(prefix="weight_sync_bench_", dir=args.disk_dir) as disk_dir:
                options = default_args(
                    colocate=transport in ("tensor", "adapter"),
                    rollout_num_gpus_per_engine=1,
                    rollout_backend="cpu",
                    update_weight_transport="disk" if transport in DISK_TRANSPORTS else "nccl",
                    update_weight_mode="delta" if transport == "delta" else "full",
                    update_weight_delta_encoding=args.delta_encoding,
                    update_weight_delta_checksum="xxh3-128",
                    update_weight_local_checkpoint_dir=None,
                    update_weight_buffer_size=args.buffer_size,
                    update_weight_disk_dir=disk_dir,
                    update_weight_disk_keep_files=False,
                    hf_checkpoint=model_dir,
                    custom_update_weight_post_write_path=None,
                )
                adapter = transport.startswith("adapter")
                # A full-weight row trains `model` itself, so the engine holds `model` when an adapter row starts.
                pushed = lora_model(model) if adapter else model
                config = lora.adapter_config(pushed) if adapter else None
                updater = WeightUpdater(rank=0)
                updater.connect(choose_transport(options, torch.device("cpu"), adapter_config=config), [client], [url])
                on_disk = disk_dir if transport in DISK_TRANSPORTS else None
                seconds, gap, moved = time_pushes(
                    pushed, client, updater, args.buffer_size, args.repeats, probe, args.lr, adapter, on_disk
                )
                updater.close()
                note = f"rank-{LORA_RANK} adapter on every linear layer" if adapter else ""
                if transport == "disk":
                    note = "HF folder written, then read by the engine"
                if transport == "delta":
                    note = f"{args.delta_encoding} delta of the tensors that changed, applied to the live weights"
                rows.append((transport, seconds, moved, gap, note))
    finally:
        process.terminate()
        process.wait(timeout=30)
        dist.destroy_process_group()
        workdir.cleanup()

    print(
        f"{label}: {nbytes / 1e6:.1f} MB of float32 parameters, buckets of {args.buffer_size / 2**20:.1f} MiB, "
        f"1 engine, 1 thread each, one AdamW step (lr {args.lr:g}) before each push, best of {args.repeats}"
    )
    print(f"{'transport':<28} {'seconds':>8} {'MB moved':>9} {'x copy':>7} {'probe gap':>10}  note")
    for name, seconds, moved, gap, note in rows:
        print(f"{name:<28} {seconds:8.3f} {moved / 1e6:9.3f} {seconds / copy_s:7.1f} {gap:10.2e}  {note}")


if __name__ == "__main__":
    main()
