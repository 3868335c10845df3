"""Opposite rewards for the two adapters of a `--multi-lora-n-adapters 2` run (`--multi-lora-rm-path`): with two
adapters a sample's index is `2 * n + adapter` for the n-th sample of its adapter's stream, and a group's two samples
are consecutive there, so each reward gives one sample of every group 1 and the other 0."""


async def second_of_each_group(args, sample) -> float:
    return float((sample.index // 2) % 2)


async def first_of_each_group(args, sample) -> float:
    return 1.0 - float((sample.index // 2) % 2)
