"""Time vanilla_gae (reverse loop over time) against chunked_gae (chunked parallel scan).

Run from the repository root:

    python -m bench.gae --batch 256 --length 131072 --chunk-sizes 64 128 256 --repeats 3

Each timing is the best of `--repeats` runs after one warm-up run.
"""

import argparse
import time

import torch

from slime.utils.ppo_utils import chunked_gae, vanilla_gae


def best_time(fn, repeats: int, device: torch.device) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    result = fn()  # warm-up (kernel selection, allocator)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lambd", type=float, default=0.95)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    rewards = torch.randn(args.batch, args.length, device=device)
    values = torch.randn(args.batch, args.length, device=device)

    print(
        f"GAE on {args.batch} x {args.length} float32, gamma={args.gamma}, lambd={args.lambd}, device={device}, "
        f"threads={torch.get_num_threads()}, best of {args.repeats}"
    )
    vanilla_s, (advantages, _) = best_time(
        lambda: vanilla_gae(rewards, values, args.gamma, args.lambd), args.repeats, device
    )
    print(f"vanilla_gae: {vanilla_s:.3f} s\n")
    print(f"{'chunk':>6} {'chunked s':>10} {'speedup':>8} {'max |diff|':>11}")
    for chunk_size in args.chunk_sizes:
        chunked_s, (chunked_advantages, _) = best_time(
            lambda c=chunk_size: chunked_gae(rewards, values, args.gamma, args.lambd, chunk_size=c),
            args.repeats,
            device,
        )
        diff = (advantages - chunked_advantages).abs().max().item()
        print(f"{chunk_size:>6} {chunked_s:>10.3f} {vanilla_s / chunked_s:>7.2f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
