"""GRPO step time and peak memory: slime vs TRL's GRPOTrainer on the same model and config.

    pip install trl==1.16.0                      # bench-only dependency
    python bench/grpo_vs_trl.py --model models/SmolLM2-135M-Instruct --steps 6
    python bench/grpo_vs_trl.py --lora 16      # slime-LoRA vs TRL-LoRA (same peft config) vs TRL full
    python bench/grpo_vs_trl.py --slime-flags "" --slime-flags "--bf16 --sglang-dtype bfloat16" --trl-bf16

Config on both sides: 8 prompts x 4 samples per step, 32 new tokens, temperature 1, lr 1e-5,
beta 0 (no KL), one optimizer step per rollout, one torch thread per process (slime's engine
and trainer take turns, so together they use one core at a time). Each side runs in its own
subprocess, one after the other; peak RSS is the largest sum over that subprocess and all its
descendants (Ray's own daemons included for slime), sampled every 0.2 s, both as summed RSS (which
counts shared library pages once per process) and as summed PSS (shared pages split, the real
footprint; see `PeakMemory`). Seconds per step are the mean of steps 2..N (step 1 includes warm-up).

With `--lora R` both sides train a rank-R adapter (alpha 2R, every linear layer, lr 1e-4) instead of the full
weights: slime with `--lora-rank`, TRL's GRPOTrainer with the same `peft_config`; TRL's full fine-tune runs too, as
the memory baseline an adapter should undercut.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


@dataclass
class PeakMemory:
    """Peaks over a run of the summed memory of a process tree, in GiB.

    rss: resident set sizes added up: shared pages (torch's libraries, mapped by every slime process)
        count once per process, so a multi-process run is over-counted.
    pss: proportional set sizes: each shared page split among the processes that map it, so the sum
        is the tree's real footprint. For a single process (TRL) the two are nearly equal.
    """

    rss: float
    pss: float
    by_process: dict[str, float]  # GiB of PSS per kind of process (Ray actor class or program) at the PSS peak


def process_kind(process: psutil.Process) -> str:
    """A Ray worker by its actor class (`ray::RolloutManager.generate` -> ray::RolloutManager), else the program."""
    cmdline = process.cmdline()
    if cmdline and cmdline[0].startswith("ray::"):
        return cmdline[0].split(".")[0]
    if process.name().startswith("python") and len(cmdline) > 1:  # python's script or -m module names it
        return " ".join(cmdline[1:3] if cmdline[1] in ("-m", "-c") else cmdline[1:2])[:40]
    return process.name()


def run_and_measure(command: list[str], env: dict[str, str]) -> tuple[int, PeakMemory]:
    """Run `command`; return its exit code and the peak memory of its process tree (sampled every 0.2 s)."""
    process = subprocess.Popen(command, env=env, cwd=REPO)
    peak_rss = peak_pss = 0
    peak_kinds: dict[str, float] = {}
    stop = threading.Event()

    def sample():
        nonlocal peak_rss, peak_pss, peak_kinds
        root = psutil.Process(process.pid)
        while not stop.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                tree = []
            rss = pss = 0
            kinds: dict[str, float] = {}
            for p in tree:
                try:
                    info = p.memory_full_info()
                    kind = process_kind(p)
                except psutil.Error:
                    continue
                rss, pss = rss + info.rss, pss + info.pss
                kinds[kind] = kinds.get(kind, 0) + info.pss / 2**30
            peak_rss = max(peak_rss, rss)
            if pss > peak_pss:
                peak_pss, peak_kinds = pss, kinds
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = process.wait()
    stop.set()
    sampler.join()
    return code, PeakMemory(peak_rss / 2**30, peak_pss / 2**30, peak_kinds)


def mean_after_first(times: list[float]) -> float:
    later = times[1:] or times
    return sum(later) / len(later)


def lora_flags(rank: int) -> list[str]:
    return ["--lora-rank", str(rank), "--lora-alpha", str(2 * rank), "--target-modules", "all-linear", "--lr", "1e-4"]


def bench_slime(
    model: str, data: Path, steps: int, workdir: Path, max_tokens: int, lora_rank: int = 0, extra: tuple[str, ...] = ()
) -> tuple[float, PeakMemory]:
    save_dir = workdir / f"slime-lora{lora_rank}"
    command = [
        sys.executable, "train.py",
        "--hf-checkpoint", model,
        "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rm-type", "last_number",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-rollout", str(steps),
        "--rollout-max-response-len", "32", "--rollout-temperature", "1.0",
        "--advantage-estimator", "grpo", "--lr", "1e-5",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens),  # micro-batches by token budget
        "--train-num-threads", "1", "--cpu-engine-num-threads", "1",
        "--save", str(save_dir),
        *(lora_flags(lora_rank) if lora_rank else []),
        *extra,
    ]  # fmt: skip
    code, peak = run_and_measure(command, dict(os.environ))
    if code != 0:
        raise SystemExit(f"slime run failed with exit code {code}")
    history = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [h["perf/step_time"] for h in history if "perf/step_time" in h]
    gaps = [h["train/train_rollout_logprob_abs_diff"] for h in history if "train/train_rollout_logprob_abs_diff" in h]
    print(f"slime {' '.join(extra)}: mean |train - rollout| log-prob {sum(gaps) / max(len(gaps), 1):.2e}", flush=True)
    return mean_after_first(step_times), peak


TRL_SCRIPT = """
import json, sys, time
import torch
torch.set_num_threads(1)
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from slime.rollout.rm_hub.last_number import compute_last_number_reward

model, data, steps, out, lora_rank, bf16 = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1"
dataset = load_dataset("json", data_files=data, split="train")
dataset = dataset.map(lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]})

def reward(completions, label, **kwargs):
    return [compute_last_number_reward(c[0]["content"], l) for c, l in zip(completions, label)]

class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.started = [], None
    def on_step_begin(self, args, state, control, **kw):
        self.started = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.started)

config = GRPOConfig(
    output_dir=out, per_device_train_batch_size=32, num_generations=4, max_completion_length=32,
    temperature=1.0, learning_rate=1e-4 if lora_rank else 1e-5, beta=0.0, max_steps=steps, logging_steps=1, report_to=[],
    use_cpu=True, bf16=bf16, save_strategy="no", num_iterations=1, gradient_accumulation_steps=1,
)
timer = StepTimer()
peft_config = None
if lora_rank:
    from peft import LoraConfig
    peft_config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear", task_type="CAUSAL_LM")
trainer = GRPOTrainer(
    model=model, reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[timer], peft_config=peft_config
)
trainer.train()
json.dump(timer.times, open(out + "/step_times.json", "w"))
"""


def bench_trl(
    model: str, data: Path, steps: int, workdir: Path, lora_rank: int = 0, bf16: bool = False
) -> tuple[float, PeakMemory]:
    out = workdir / f"trl-lora{lora_rank}{'-bf16' if bf16 else ''}"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-c", TRL_SCRIPT, model, str(data), str(steps), str(out), str(lora_rank), str(int(bf16))]
    code, peak = run_and_measure(command, env)
    if code != 0:
        raise SystemExit(f"TRL run failed with exit code {code}")
    return mean_after_first(json.loads((out / "step_times.json").read_text())), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--data", default="data/addition/train.jsonl", help="from tools/make_addition_dataset.py")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=512, help="slime's micro-batch token budget")
    parser.add_argument("--lora", type=int, default=0, metavar="R", help="train rank-R LoRA adapters on both sides")
    parser.add_argument(
        "--trl-bf16",
        action="store_true",
        help="run TRL a second time with bf16=True (accelerate's autocast), the same precision as slime's --bf16",
    )
    parser.add_argument(
        "--slime-flags",
        action="append",
        default=[],
        help="more train.py flags for slime's run, e.g. '--gradient-checkpointing'; given again, slime runs again "
        "with those flags instead (one row each, the first is compared with TRL)",
    )
    args = parser.parse_args()
    model = str(Path(args.model).resolve())
    data = Path(args.data).resolve()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, flags in enumerate(args.slime_flags or [""]):
            name = "slime" if i == 0 else f"slime {flags}"
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            rows[name] = bench_slime(
                model, data, args.steps, workdir, args.max_tokens_per_gpu, args.lora, tuple(flags.split())
            )
        rows["TRL"] = bench_trl(model, data, args.steps, Path(tmp), args.lora)
        if args.trl_bf16:
            rows["TRL bf16"] = bench_trl(model, data, args.steps, Path(tmp), args.lora, bf16=True)
        if args.lora:
            rows["TRL full"] = bench_trl(model, data, args.steps, Path(tmp))
    title = f"   (LoRA rank {args.lora})" if args.lora else ""
    width = max(10, *(len(name) for name in rows))
    print(f"{'':{width}} {'s/step':>8} {'peak RSS GiB':>13} {'peak PSS GiB':>13}{title}")
    for name, (step, peak) in rows.items():
        print(f"{name:{width}} {step:8.1f} {peak.rss:13.2f} {peak.pss:13.2f}")
    for trl in ("TRL", "TRL bf16") if args.trl_bf16 else ("TRL",):
        trl_step, trl_peak = rows[trl]
        for name, (slime_step, slime_peak) in rows.items():
            if name.startswith("slime"):
                print(
                    f"{name} / {trl}: speed (steps/s) {trl_step / slime_step:.2f}x, memory "
                    f"{slime_peak.rss / trl_peak.rss:.2f} (RSS), {slime_peak.pss / trl_peak.pss:.2f} (PSS)"
                )
    slime_peak = rows["slime"][1]
    if args.lora:
        full = rows["TRL full"][1]
        print(f"slime-LoRA PSS / TRL full fine-tune PSS: {slime_peak.pss / full.pss:.2f}")
    print_breakdown(slime_peak)


def print_breakdown(peak: PeakMemory) -> None:
    """slime's PSS at its peak, by kind of process (where the footprint of a multi-process run goes)."""
    print("slime's peak PSS by process:")
    for kind, gib in sorted(peak.by_process.items(), key=lambda item: -item[1]):
        print(f"  {kind:40} {gib:6.2f} GiB")


if __name__ == "__main__":
    main()
