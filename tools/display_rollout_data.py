"""Show rollouts saved with `--save-debug-rollout-data`.

python tools/display_rollout_data.py outputs/rollout_0.pt --num 4
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections import Counter

import torch

from slime.utils.types import Sample


def summarize(samples: list[Sample]) -> str:
    """One paragraph of reward, length and status figures."""
    rewards = [s.get_reward_value() if not isinstance(s.reward, dict) else 0.0 for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    statuses = Counter(s.status.value for s in samples)
    mean_reward = sum(rewards) / max(len(rewards), 1)
    return (
        f"{len(samples)} samples in {len({s.group_index for s in samples})} groups | reward mean {mean_reward:.3f} | "
        f"response length mean {sum(lengths) / max(len(lengths), 1):.1f} max {max(lengths, default=0)} | "
        f"status {dict(statuses)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--num", type=int, default=3, help="samples to print in full")
    args = parser.parse_args()
    try:
        # The files are dicts of lists, strings and numbers: nothing in them needs code to rebuild.
        saved = torch.load(args.path, weights_only=True)
    except pickle.UnpicklingError as e:
        match = re.search(r"GLOBAL (\S+)", str(e))
        raise SystemExit(
            f"{args.path} holds a {match.group(1) if match else 'non-plain object'}, not only plain values and "
            "tensors; this tool does not unpickle such files, as that could run code from them"
        ) from e
    samples = [Sample.from_dict(d) for d in saved["samples"]]
    print(f"rollout {saved['rollout_id']}: {summarize(samples)}")
    for s in samples[: args.num]:
        prompt = s.prompt if isinstance(s.prompt, str) else s.prompt[-1]["content"]
        print("-" * 80)
        print(f"index {s.index} group {s.group_index} reward {s.reward} status {s.status.value} label {s.label!r}")
        print(f"prompt: {prompt!r}")
        print(f"response: {s.response!r}")


if __name__ == "__main__":
    main()
