"""Fully async vs synchronous GRPO: steps/s, staleness and reward on the same machine, one after the other.

    bash scripts/run-quickstart-cpu.sh            # once: prepares the model and data/addition/
    python bench/async_vs_sync.py --model models/SmolLM2-135M-Instruct --num-rollout 10

Both runs use the CPU quickstart's training config (8 prompts x 4 samples, 32 new tokens, temperature
0.5, GRPO, lr 2e-5 on a cosine to 2e-6, a 0.01 low-var KL loss, token-budget micro-batches) without
its eval and saves, so a step is generation and training only, and train on the same number of samples:

- sync: `train.py`; generation and training take turns, so each gets all `--cores` threads in its turn.
- async: `train_async.py --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async
  --max-weight-staleness 1`; the engine generates while the trainer trains, so they split the cores
  (2 cores: one thread each).

`--max-response-len` and `--prompt-suffix` (e.g. ' Explain each step.') make responses longer, so
generation takes a larger share of the step. The table ends with the cap perfect overlap would give at
the sync run's phase times: sync step / max(generate, train + push).

`--tool-latency S` makes it agentic (`bench/slow_tool.py`, both runs): each sample answers, waits S seconds for a
checker tool's verdict (time that uses no CPU), and answers again. A sync step then waits out the tool while the
trainer idles; async trains meanwhile. With `--async-engine-threads` set so that trainer and engine threads add up
to more than `--cores`, whichever of the two is busy while the other waits gets every core.

Steps/s leave out each run's first step (warm-up: the first batch is generated with nothing to overlap).
Reward is the mean `rollout/reward` of the last `--last-k` rollouts with its standard error over those
rollouts (each the mean of the same number of samples). Staleness (async only) is `rollout/staleness_mean`
averaged over the steps and the largest `rollout/staleness_max`, in weight pushes. Each run writes its
metrics.jsonl to `--output-dir`/{sync,async}/ and its log to {sync,async}.log there; the figures go to
`--output-dir`/async_vs_sync.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


@dataclass
class ModeResult:
    """Figures of one run.

    steps_per_s: measured steps over their summed `perf/step_time` (the first step left out).
    reward_mean / reward_se: mean `rollout/reward` of the last k rollouts and its standard error
        (None with k < 2).
    staleness_mean / staleness_max: over all steps, in weight pushes; None for the sync run.
    trainer_wait_mean / generation_wait_mean: per step, seconds the trainer waited for its batch and the
        generation loop sat idle with its pipeline full (async only).
    wall_s: the whole run, startup included.
    """

    mode: str
    command: list[str]
    steps_per_s: float
    measured_steps: int
    step_times: list[float]
    rewards: list[float]
    reward_mean: float
    reward_se: float | None
    staleness_mean: float | None
    staleness_max: float | None
    stale_groups: float | None
    trainer_wait_mean: float | None
    generation_wait_mean: float | None
    generate_time_mean: float | None
    train_time_mean: float | None
    update_weights_time_mean: float | None
    response_length_mean: float | None
    wall_s: float
    load_average_before: float


def quickstart_flags(model: Path, data: Path, num_rollout: int, save_dir: Path, max_response_len: int) -> list[str]:
    """scripts/run-quickstart-cpu.sh's training flags, without its eval, saves and thread budgets."""
    return [
        "--hf-checkpoint", str(model),
        "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rm-type", "last_number",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-rollout", str(num_rollout),
        "--rollout-max-response-len", str(max_response_len), "--rollout-temperature", "0.5",
        "--advantage-estimator", "grpo", "--lr", "2e-5", "--lr-decay-style", "cosine", "--min-lr", "2e-6",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
        "--save", str(save_dir),
    ]  # fmt: skip


def column(rows: list[dict], key: str) -> list[float]:
    """The values of `key` in the rows that have it."""
    return [row[key] for row in rows if key in row]


def mean_or_none(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(mode: str, command: list[str], rows: list[dict], last_k: int, wall_s: float, load: float) -> ModeResult:
    """The figures of one run from its metrics.jsonl rows (one per trained rollout, in order)."""
    step_times = column(rows, "perf/step_time")
    measured = step_times[1:]
    rewards = column(rows, "rollout/reward")
    last = rewards[-last_k:]
    staleness_max = column(rows, "rollout/staleness_max")
    stale_groups = column(rows, "rollout/stale_groups")
    return ModeResult(
        mode=mode,
        command=command,
        steps_per_s=len(measured) / sum(measured) if measured else math.nan,
        measured_steps=len(measured),
        step_times=step_times,
        rewards=rewards,
        reward_mean=sum(last) / len(last),
        reward_se=statistics.stdev(last) / math.sqrt(len(last)) if len(last) > 1 else None,
        staleness_mean=mean_or_none(column(rows, "rollout/staleness_mean")),
        staleness_max=max(staleness_max) if staleness_max else None,
        stale_groups=sum(stale_groups) if stale_groups else None,
        trainer_wait_mean=mean_or_none(column(rows, "perf/train_wait_time")),
        generation_wait_mean=mean_or_none(column(rows, "rollout/generation_wait_time")),
        generate_time_mean=mean_or_none(column(rows[1:], "perf/generate_time")),
        train_time_mean=mean_or_none(column(rows[1:], "perf/train_time")),
        update_weights_time_mean=mean_or_none(column(rows[1:], "perf/update_weights_time")),
        response_length_mean=mean_or_none(column(rows, "rollout/response_length")),
        wall_s=wall_s,
        load_average_before=load,
    )


def run_mode(
    mode: str, script: str, flags: list[str], save_dir: Path, num_rollout: int, last_k: int, env: dict[str, str]
) -> ModeResult:
    """Run `python <script> <flags>` with its output in `save_dir`.log and summarize its metrics.jsonl."""
    command = [sys.executable, script, *flags]
    log_path = save_dir.with_suffix(".log")
    load = os.getloadavg()[0]
    print(f"{mode}: {script}, {num_rollout} rollouts (log: {log_path}; load average before {load:.2f})", flush=True)
    started = time.perf_counter()
    with log_path.open("w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall_s = time.perf_counter() - started
    if code != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"{mode} run failed with exit code {code}; the end of {log_path}:\n{tail}")
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "rollout/reward" in row]
    if len(rows) != num_rollout:
        raise SystemExit(f"{mode} run logged {len(rows)} rollouts, expected {num_rollout}: see {log_path}")
    print(f"{mode}: done in {wall_s:.0f} s", flush=True)
    return summarize(mode, command, rows, last_k, wall_s, load)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(sync: ModeResult, fully_async: ModeResult, last_k: int) -> None:
    print(f"\n{'':6} {'steps/s':>8} {'s/step':>7} {'reward (last ' + str(last_k) + ')':>20} {'staleness':>10}")
    for r in (sync, fully_async):
        reward = f"{r.reward_mean:.3f} ± {fmt(r.reward_se, '.3f')}"
        staleness = f"{fmt(r.staleness_mean, '.2f')}/{fmt(r.staleness_max, '.0f')}"
        print(f"{r.mode:6} {r.steps_per_s:8.4f} {1 / r.steps_per_s:7.1f} {reward:>20} {staleness:>10}")
    print(
        f"steps/s over steps 2..{len(sync.step_times)} (step 1, the warm-up, left out); reward ± its standard error "
        "over rollouts; staleness mean/max in weight pushes"
    )
    print(f"speed ratio async/sync (steps/s): {fully_async.steps_per_s / sync.steps_per_s:.2f}x")
    generate, train, push = sync.generate_time_mean, sync.train_time_mean, sync.update_weights_time_mean
    if None not in (generate, train, push):
        # Perfect overlap at sync's per-phase speed: a step takes the longer of generation and train + push.
        cap = (1 / sync.steps_per_s) / max(generate, train + push)
        print(
            f"sync step: generate {generate:.1f} s + train {train:.1f} s + push {push:.1f} s (mean response "
            f"{fmt(sync.response_length_mean, '.1f')} tokens); perfect overlap at these speeds caps async at {cap:.2f}x"
        )
    if sync.reward_se is not None and fully_async.reward_se is not None:
        diff_se = math.hypot(sync.reward_se, fully_async.reward_se)
        print(f"reward async - sync: {fully_async.reward_mean - sync.reward_mean:+.3f} ± {diff_se:.3f}")
    print(
        f"async: trainer waited {fmt(fully_async.trainer_wait_mean, '.1f')} s/step for its batch, generation idled "
        f"{fmt(fully_async.generation_wait_mean, '.1f')} s/step, {fmt(fully_async.stale_groups, '.0f')} stale groups "
        "dropped"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--data", default="data/addition/train.jsonl", help="from tools/make_addition_dataset.py")
    parser.add_argument("--num-rollout", type=int, default=10, help="rollouts (train steps) per run")
    parser.add_argument("--last-k", type=int, default=5, help="rollouts whose reward is averaged")
    parser.add_argument("--cores", type=int, default=2, help="sync: threads per phase; async: split between the two")
    parser.add_argument("--max-weight-staleness", type=int, default=1)
    parser.add_argument(
        "--async-train-threads",
        type=int,
        default=None,
        help="async: trainer threads (default: half the cores; the engine gets the rest, at least 1)",
    )
    parser.add_argument(
        "--async-engine-threads",
        type=int,
        default=None,
        help="async: engine threads (default: the cores the trainer leaves, at least 1); trainer and engine threads "
        "may add up to more than --cores, so that one can use every core while the other waits",
    )
    parser.add_argument(
        "--tool-latency",
        type=float,
        default=0.0,
        help="seconds each sample's checker tool takes (bench/slow_tool.py: answer, wait, answer again); 0: plain "
        "single-turn GRPO",
    )
    parser.add_argument("--max-response-len", type=int, default=32, help="--rollout-max-response-len of both runs")
    parser.add_argument(
        "--prompt-suffix",
        default="",
        help="appended to every prompt (a copy of --data is written to --output-dir), e.g. ' Explain each step.' "
        "for longer responses: a generation-bound workload",
    )
    parser.add_argument("--output-dir", default="outputs/bench-async-vs-sync")
    args = parser.parse_args()

    model, data, out = Path(args.model).resolve(), Path(args.data).resolve(), Path(args.output_dir).resolve()
    hint = "run bash scripts/run-quickstart-cpu.sh once (it prepares both), or pass --model / --data"
    for flag, path in (("--model", model), ("--data", data)):
        if not path.exists():
            raise SystemExit(f"{flag} {path} does not exist: {hint}")
    if args.num_rollout < 2:
        raise SystemExit(f"--num-rollout must be at least 2 (the first step is warm-up), got {args.num_rollout}")
    if not 1 <= args.last_k <= args.num_rollout:
        raise SystemExit(f"--last-k must be between 1 and --num-rollout ({args.num_rollout}), got {args.last_k}")
    if args.cores < 2:
        raise SystemExit(
            f"--cores must be at least 2 (async mode gives generation and training one each), got {args.cores}"
        )
    for mode in ("sync", "async"):
        if (out / mode).exists():
            raise SystemExit(f"{out / mode} already exists: pass --output-dir <new folder>, or remove it")
    out.mkdir(parents=True, exist_ok=True)
    if args.prompt_suffix:
        rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
        data = out / "prompts.jsonl"
        data.write_text(
            "".join(json.dumps({**row, "prompt": row["prompt"] + args.prompt_suffix}) + "\n" for row in rows)
        )

    train_threads = args.async_train_threads or args.cores // 2
    engine_threads = args.async_engine_threads or max(1, args.cores - train_threads)
    env = dict(os.environ)
    workload: list[str] = []
    if args.tool_latency > 0:
        # Ray's workers import the generate function by this path, so it is absolute.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "bench"), env.get("PYTHONPATH")]))
        env["SLIME_BENCH_TOOL_LATENCY"] = str(args.tool_latency)
        workload = ["--custom-generate-function-path", "slow_tool.generate", "--max-turns", "2"]
    sync_flags = quickstart_flags(model, data, args.num_rollout, out / "sync", args.max_response_len) + [
        "--train-num-threads", str(args.cores), "--cpu-engine-num-threads", str(args.cores), *workload,
    ]  # fmt: skip
    async_flags = quickstart_flags(model, data, args.num_rollout, out / "async", args.max_response_len) + [
        "--rollout-function-path", FULLY_ASYNC, "--max-weight-staleness", str(args.max_weight_staleness),
        "--train-num-threads", str(train_threads), "--cpu-engine-num-threads", str(engine_threads), *workload,
    ]  # fmt: skip
    sync = run_mode("sync", "train.py", sync_flags, out / "sync", args.num_rollout, args.last_k, env)
    fully_async = run_mode("async", "train_async.py", async_flags, out / "async", args.num_rollout, args.last_k, env)

    print_table(sync, fully_async, args.last_k)
    figures = {
        "num_rollout": args.num_rollout,
        "last_k": args.last_k,
        "cores": args.cores,
        "max_weight_staleness": args.max_weight_staleness,
        "tool_latency": args.tool_latency,
        "async_threads": {"trainer": train_threads, "engine": engine_threads},
        "speed_ratio": fully_async.steps_per_s / sync.steps_per_s,
        "sync": asdict(sync),
        "async": asdict(fully_async),
    }
    (out / "async_vs_sync.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"figures written to {out / 'async_vs_sync.json'}")


if __name__ == "__main__":
    main()
