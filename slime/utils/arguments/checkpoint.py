"""Checkpoint outputs: --save-hf, and the rule that --save / --save-hf never overwrite an earlier run or a folder
slime did not write. (--save / --load themselves are Megatron names, registered in megatron.py.)"""

from __future__ import annotations

import argparse
import os

from slime.utils.arguments.errors import _fail


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoint")
    group.add_argument(
        "--save-hf",
        default=None,
        help="Also save HF weights here at each save; may contain {rollout_id}.",
    )


# ---- output folders (--save, --save-hf): never overwrite an earlier run or a folder slime did not write ----
def _validate_output_folders(args: argparse.Namespace) -> None:
    from slime.utils import atomic_dir, run_dir

    found = run_dir.holds_run(args.save)
    if found and not (args.load and os.path.realpath(args.load) == os.path.realpath(args.save)):
        _fail(
            f"--save {args.save} already holds a run ({', '.join(found)}); without --load pointing at it, this run "
            f"would start again and overwrite it. Pass --load {args.save} to resume it, or choose another --save "
            "for a new run."
        )
    save_hf = args.save_hf
    if not save_hf:
        return
    try:
        first = save_hf.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as e:
        _fail(f"--save-hf {save_hf!r} may contain only the placeholder {{rollout_id}} ({e!r}).")
    if first == save_hf:  # one fixed folder, replaced at every save: it must be absent or an earlier export
        problem = atomic_dir.replace_problem(save_hf, "--save-hf")
        if problem is not None:
            _fail(problem)
