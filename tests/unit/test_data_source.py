"""Rollout data source: prompt groups, epochs, the buffer, num_rollout, and exact resume from a checkpoint."""

import json
import os
import shutil
from argparse import Namespace

import numpy as np
import pytest
import torch
from support.flags import slime_flags
from support.untrusted_payloads import MakesAFolderWhenUnpickled
from transformers import AutoTokenizer

from slime.rollout.data_source import (
    RolloutDataSource,
    RolloutDataSourceWithBuffer,
    compute_num_rollout,
    pop_first,
)
from slime.utils.types import Sample, Status


def newest_first(args, rollout_id, buffer, num_samples):
    """A buffer filter for the tests: serves the most recently added groups first."""
    taken = []
    while buffer and len(taken) < num_samples:
        taken.append(buffer.pop())
    return taken


def greedy_filter(args, rollout_id, buffer, num_samples):
    """A broken buffer filter that ignores num_samples."""
    taken = list(buffer)
    buffer.clear()
    return taken


def make_args(tmp_path, num_prompts=5, **overrides) -> Namespace:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"prompt {i}", "label": str(i)}) + "\n" for i in range(num_prompts)))
    args = slime_flags(
        prompt_data=str(path),
        input_key="input",
        label_key="label",
        metadata_key="metadata",
        tool_key="tools",
        apply_chat_template=False,
        apply_chat_template_kwargs=None,
        rollout_shuffle=False,
        rollout_seed=42,
        rollout_max_prompt_len=None,
        hf_checkpoint=None,
        trust_remote_code=False,
        n_samples_per_prompt=1,
        rollout_batch_size=2,
        num_rollout=None,
        num_epoch=None,
        buffer_filter_path=None,
        save=str(tmp_path / "ckpt"),
        load=str(tmp_path / "ckpt"),
        start_rollout_id=None,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def prompts_of(groups):
    return [group[0].prompt for group in groups]


def test_groups_have_n_copies_with_running_indices(tmp_path):
    source = RolloutDataSource(make_args(tmp_path, n_samples_per_prompt=3))
    assert len(source) == 5
    groups = source.get_samples(2) + source.get_samples(2)
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    assert [[s.group_index for s in g] for g in groups] == [[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3]]
    assert [s.index for g in groups for s in g] == list(range(12))
    assert [[s.prompt for s in g] for g in groups] == [[f"prompt {i}"] * 3 for i in range(4)]
    assert [g[0].label for g in groups] == ["0", "1", "2", "3"]
    # Copies are independent of each other and of the dataset.
    groups[0][0].metadata["touched"] = True
    assert groups[0][1].metadata == {}
    assert source.dataset.samples[0].metadata == {}


def test_epochs_wrap_in_file_order_without_shuffle(tmp_path):
    source = RolloutDataSource(make_args(tmp_path, num_prompts=3))
    groups = source.get_samples(5)
    assert prompts_of(groups) == ["prompt 0", "prompt 1", "prompt 2", "prompt 0", "prompt 1"]
    assert [g[0].group_index for g in groups] == [0, 1, 2, 3, 4]
    assert (source.epoch_id, source.sample_offset) == (1, 2)


def test_epochs_reshuffle_deterministically(tmp_path):
    num_prompts = 20

    def first_epochs(seed):
        source = RolloutDataSource(
            make_args(tmp_path, num_prompts=num_prompts, rollout_shuffle=True, rollout_seed=seed)
        )
        # Odd batch sizes so that epoch boundaries fall inside a batch.
        stream = prompts_of(source.get_samples(7) + source.get_samples(7) + source.get_samples(26))
        return stream[:num_prompts], stream[num_prompts:]

    epoch0, epoch1 = first_epochs(seed=1)
    all_prompts = sorted(f"prompt {i}" for i in range(num_prompts))
    assert sorted(epoch0) == sorted(epoch1) == all_prompts
    assert epoch0 != epoch1
    assert epoch0 != [f"prompt {i}" for i in range(num_prompts)]
    assert first_epochs(seed=1) == (epoch0, epoch1)
    assert first_epochs(seed=2) != (epoch0, epoch1)


def test_without_prompt_data_serves_empty_samples(tmp_path):
    source = RolloutDataSource(make_args(tmp_path, prompt_data=None, n_samples_per_prompt=2))
    assert len(source) == 0
    groups = source.get_samples(2)
    assert [[(s.prompt, s.group_index, s.index) for s in g] for g in groups] == [
        [("", 0, 0), ("", 0, 1)],
        [("", 1, 2), ("", 1, 3)],
    ]


def test_tokenizer_is_loaded_from_hf_checkpoint_for_chat_template(tmp_path, tiny_model_dir):
    args = make_args(tmp_path, num_prompts=1, apply_chat_template=True, hf_checkpoint=str(tiny_model_dir))
    source = RolloutDataSource(args)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "prompt 0"}], add_generation_prompt=True, tokenize=False
    )
    assert source.get_samples(1)[0][0].prompt == expected
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        RolloutDataSource(make_args(tmp_path, apply_chat_template=True))


def test_base_source_has_no_buffer(tmp_path):
    source = RolloutDataSource(make_args(tmp_path))
    with pytest.raises(NotImplementedError, match="RolloutDataSourceWithBuffer"):
        source.add_samples(source.get_samples(1))


def test_compute_num_rollout(tmp_path):
    # 2 epochs × 10 prompts = 20 prompts; 20 // 4 per rollout = 5 rollouts.
    assert compute_num_rollout(make_args(tmp_path, num_epoch=2, rollout_batch_size=4), 10) == 5
    # 3 × 10 = 30 prompts; 30 // 4 = 7 rollouts (the last 2 prompts are not used).
    assert compute_num_rollout(make_args(tmp_path, num_epoch=3, rollout_batch_size=4), 10) == 7
    assert compute_num_rollout(make_args(tmp_path, num_rollout=11), 10) == 11
    with pytest.raises(ValueError, match="--num-rollout.*--num-epoch"):
        compute_num_rollout(make_args(tmp_path), 10)
    with pytest.raises(ValueError, match="less than one rollout"):
        compute_num_rollout(make_args(tmp_path, num_epoch=1, rollout_batch_size=16), 10)


def test_pop_first_takes_from_the_front():
    buffer = [["a"], ["b"], ["c"]]
    assert pop_first(None, None, buffer, 2) == [["a"], ["b"]]
    assert buffer == [["c"]]
    assert pop_first(None, None, buffer, 5) == [["c"]]
    assert buffer == []


def test_buffer_groups_are_served_first(tmp_path):
    source = RolloutDataSourceWithBuffer(make_args(tmp_path, n_samples_per_prompt=2))
    first = source.get_samples(2)  # prompts 0, 1
    for sample in first[1]:
        sample.status = Status.ABORTED
    source.add_samples([first[1]])
    assert source.get_buffer_length() == 1
    served = source.get_samples(3)
    # The put-back group comes first, unchanged; then the dataset continues where it stopped.
    assert served[0] is first[1]
    assert prompts_of(served) == ["prompt 1", "prompt 2", "prompt 3"]
    assert [g[0].group_index for g in served] == [1, 2, 3]
    assert source.get_buffer_length() == 0


def test_custom_buffer_filter_is_used(tmp_path):
    source = RolloutDataSourceWithBuffer(make_args(tmp_path, buffer_filter_path="test_data_source.newest_first"))
    groups = source.get_samples(3)
    source.add_samples(groups)
    assert prompts_of(source.get_samples(2)) == ["prompt 2", "prompt 1"]
    assert prompts_of(source.get_samples(2)) == ["prompt 0", "prompt 3"]


def test_buffer_filter_returning_too_many_is_an_error(tmp_path):
    source = RolloutDataSourceWithBuffer(make_args(tmp_path, buffer_filter_path="test_data_source.greedy_filter"))
    source.add_samples(source.get_samples(3))
    with pytest.raises(ValueError, match="greedy_filter returned 3 groups but only 2"):
        source.get_samples(2)


def test_add_samples_rejects_wrong_group_size(tmp_path):
    source = RolloutDataSourceWithBuffer(make_args(tmp_path, n_samples_per_prompt=2))
    groups = source.get_samples(2)
    with pytest.raises(ValueError, match="group 1 has 1 samples but --n-samples-per-prompt is 2"):
        source.add_samples([groups[0], groups[1][:1]])
    assert source.get_buffer_length() == 0
    with pytest.raises(TypeError, match="group 0"):
        source.add_samples([groups[0][0]])


def run_steps(source, steps, batch_size, record):
    """Draw `steps` batches; at step 1 put the last group back as an aborted partial rollout."""
    for step in steps:
        groups = source.get_samples(batch_size)
        record.extend((s.prompt, s.index, s.group_index, s.response, s.status) for g in groups for s in g)
        if step == 1:
            for sample in groups[-1]:
                sample.status = Status.ABORTED
                sample.response = f"partial {sample.index}"
                sample.append_response([5, 6], "!", [-0.5, -0.25])
            source.add_samples([groups[-1]])


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    "num_prompts,batch_size",
    [
        (5, 3),  # the save falls inside epoch 1
        (4, 2),  # the save falls exactly at the end of epoch 0
    ],
)
def test_resume_matches_an_uninterrupted_run(tmp_path, shuffle, num_prompts, batch_size):
    def new_source():
        args = make_args(
            tmp_path, num_prompts=num_prompts, n_samples_per_prompt=2, rollout_shuffle=shuffle, rollout_seed=3
        )
        return RolloutDataSourceWithBuffer(args)

    total_steps, save_after = 6, 2
    uninterrupted = []
    run_steps(new_source(), range(total_steps), batch_size, uninterrupted)

    resumed = []
    first_run = new_source()
    run_steps(first_run, range(save_after), batch_size, resumed)
    assert first_run.get_buffer_length() == 1
    first_run.save(save_after - 1)
    del first_run
    second_run = new_source()
    second_run.load()
    assert second_run.get_buffer_length() == 1
    run_steps(second_run, range(save_after, total_steps), batch_size, resumed)

    assert resumed == uninterrupted
    # The stream really crossed epochs: every prompt was served more than once.
    assert len({prompt for prompt, *_ in uninterrupted}) == num_prompts
    assert len(uninterrupted) > 2 * 2 * num_prompts


def test_buffer_round_trips_all_sample_fields(tmp_path):
    source = RolloutDataSourceWithBuffer(make_args(tmp_path))
    group = source.get_samples(1)[0]
    group[0].append_response([7, 8, 9], "abc", [-0.1, -0.2, -0.3])
    group[0].metadata = {"tools": [{"name": "calculator"}]}
    group[0].status = Status.TRUNCATED
    group[0].reward = {"acc": 1.0}
    source.add_samples([group])
    source.save(0)
    restored = RolloutDataSourceWithBuffer(make_args(tmp_path))
    restored.load(0)
    assert restored.buffer[0][0] == group[0]
    assert isinstance(restored.buffer[0][0], Sample)


@pytest.mark.reliability(
    "a data source checkpoint whose unpickling would run code",
    "refused (loaded with weights_only=True), naming the file; no code runs",
)
def test_load_never_runs_code_from_a_checkpoint(tmp_path):
    args = make_args(tmp_path)
    os.makedirs(os.path.join(args.load, "rollout"))
    ran = tmp_path / "code_ran"
    path = os.path.join(args.load, "rollout", "data_source_0.pt")
    torch.save({"epoch_id": MakesAFolderWhenUnpickled(str(ran))}, path)
    with pytest.raises(ValueError, match="data_source_0.pt") as error:
        RolloutDataSourceWithBuffer(args).load(0)
    assert "MakesAFolderWhenUnpickled" in str(error.value) or "makedirs" in str(error.value)
    assert not ran.exists()


@pytest.mark.reliability(
    "a sample put back into the buffer with metadata a checkpoint cannot store safely (a numpy array)",
    "the save fails naming the type and the fix; no checkpoint file is left",
)
def test_save_refuses_state_that_needs_unpickling(tmp_path):
    source = RolloutDataSourceWithBuffer(make_args(tmp_path))
    group = source.get_samples(1)[0]
    group[0].metadata = {"scores": np.array([1.0, 2.0])}
    source.add_samples([group])
    with pytest.raises(TypeError, match="numpy") as error:
        source.save(0)
    assert "plain Python values" in str(error.value)
    assert os.listdir(os.path.join(tmp_path, "ckpt", "rollout")) == []
    group[0].metadata = {"scores": [1.0, 2.0]}  # plain values save and load
    source.save(0)
    restored = RolloutDataSourceWithBuffer(make_args(tmp_path))
    restored.load(0)
    assert restored.buffer[0][0].metadata == {"scores": [1.0, 2.0]}


def test_save_is_atomic_and_load_picks_the_latest(tmp_path):
    source = RolloutDataSourceWithBuffer(make_args(tmp_path))
    source.get_samples(1)
    source.save(1)
    source.get_samples(2)
    path = source.save(3)
    rollout_dir = os.path.dirname(path)
    assert sorted(os.listdir(rollout_dir)) == ["data_source_1.pt", "data_source_3.pt"]
    # A crash mid-save leaves a temp file behind; it must not be mistaken for a checkpoint.
    with open(os.path.join(rollout_dir, ".data_source_7.abc123.tmp"), "wb") as f:
        f.write(b"truncated")

    latest = RolloutDataSourceWithBuffer(make_args(tmp_path))
    latest.load()
    assert (latest.sample_offset, latest.sample_group_index) == (3, 3)
    older = RolloutDataSourceWithBuffer(make_args(tmp_path))
    older.load(1)
    assert (older.sample_offset, older.sample_group_index) == (1, 1)
    with pytest.raises(FileNotFoundError, match=r"rollout 2 .*found rollouts: \[1, 3\]"):
        older.load(2)


def test_load_without_checkpoint_is_a_fresh_start(tmp_path, caplog):
    for load_dir in [None, str(tmp_path / "empty")]:
        source = RolloutDataSourceWithBuffer(make_args(tmp_path, load=load_dir))
        with caplog.at_level("INFO", logger="slime.rollout.data_source"):
            source.load()
        assert "starting from the first prompt" in caplog.text
        assert prompts_of(source.get_samples(1)) == ["prompt 0"]
    with pytest.raises(FileNotFoundError, match="found rollouts: none"):
        RolloutDataSourceWithBuffer(make_args(tmp_path, load=str(tmp_path / "empty"))).load(4)


def test_save_needs_save_dir(tmp_path):
    with pytest.raises(ValueError, match="--save"):
        RolloutDataSource(make_args(tmp_path, save=None)).save(0)


def test_load_keeps_the_checkpoint_shuffle_seed(tmp_path, caplog):
    args = make_args(tmp_path, num_prompts=12, rollout_shuffle=True, rollout_seed=1)
    original = RolloutDataSource(args)
    original.get_samples(14)  # into epoch 1
    original.save(0)
    expected = prompts_of(original.get_samples(20))

    resumed = RolloutDataSource(make_args(tmp_path, num_prompts=12, rollout_shuffle=True, rollout_seed=99))
    with caplog.at_level("WARNING", logger="slime.rollout.data_source"):
        resumed.load()
    assert "--rollout-seed 99 differs from the checkpoint's 1" in caplog.text
    assert prompts_of(resumed.get_samples(20)) == expected


@pytest.mark.reliability(
    "an --hf-checkpoint whose tokenizer_config.json auto_map names a .py of the folder (that writes a file when run)",
    "ValueError naming the folder and --trust-remote-code; the .py never runs (it runs only under that flag)",
)
def test_a_tokenizer_that_needs_its_folders_code_runs_it_only_with_trust_remote_code(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"auto_map": {"AutoTokenizer": [None, "evil.EvilTokenizer"]}, "tokenizer_class": "EvilTokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ran = tmp_path / "ran"
    (folder / "evil.py").write_text(
        f"open({str(ran)!r}, 'w').write('x')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    flags = {"num_prompts": 1, "apply_chat_template": True, "hf_checkpoint": str(folder)}
    with pytest.raises(ValueError, match="needs Python code from its own folder .* only with --trust-remote-code"):
        RolloutDataSource(make_args(tmp_path, **flags))
    assert not ran.exists()
    source = RolloutDataSource(make_args(tmp_path, **flags, trust_remote_code=True))
    assert ran.exists()  # the folder's own tokenizer class was imported, and it renders the prompt
    assert source.get_samples(1)[0][0].prompt == AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        [{"role": "user", "content": "prompt 0"}], add_generation_prompt=True, tokenize=False
    )
