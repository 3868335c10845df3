"""Weight transport shared by trainers and engines, between real processes.

- Shared-memory payloads: serialized in this process, mapped in a spawned one.
- The SGLang-style broadcast group: a trainer-like process (with a default process group)
  and an engine-like process (without one) join it, broadcast, leave and rejoin under the same
  name; and a rank built by hand the way SGLang's `init_custom_process_group` builds it (torch's
  `tcp://` rendezvous store, `PrefixStore(group_name)`, `_new_process_group_helper`) meets ours.
"""

from __future__ import annotations

import base64
import datetime
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

from slime.utils.http_utils import find_free_port
from slime.utils.weight_transport import (
    deserialize_named_tensors,
    init_process_group_like_sglang,
    serialize_named_tensors,
)

TIMEOUT = datetime.timedelta(seconds=60)


def _as_plain(named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], list]]:
    """Names, dtypes, shapes and values as plain Python (bf16 widened exactly to float32)."""
    plain = []
    for name, tensor in named_tensors:
        values = tensor.float().tolist() if tensor.is_floating_point() else tensor.tolist()
        plain.append((name, str(tensor.dtype), list(tensor.shape), values))
    return plain


def _run(targets: list[tuple]) -> list:
    """Run each (function, args) in a spawned process that puts one result on the queue it gets last.

    Returns the results in target order; fails if a process errs or hangs.
    """
    context = torch.multiprocessing.get_context("spawn")
    queues = [context.Queue() for _ in targets]
    processes = [context.Process(target=fn, args=(*args, queue)) for (fn, args), queue in zip(targets, queues)]
    for process in processes:
        process.start()
    try:
        results = []
        for process, queue in zip(processes, queues):
            try:
                results.append(queue.get(timeout=120))
            except Exception:
                pytest.fail(f"{process.name} sent no result (exit code {process.exitcode}); see its stderr")
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0, f"{process.name} exited with {process.exitcode}"
        return results
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()


# ---------------------------------------------------------------- shared-memory payloads


def _map_payload(payload: str, queue) -> None:
    queue.put(_as_plain(deserialize_named_tensors(payload)))


def test_payload_round_trip_across_processes():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    named = [
        ("model.embed_tokens.weight", torch.linspace(-1, 1, 12).reshape(3, 4)),
        ("transposed", base.t()),  # non-contiguous view
        ("slice", base[1:3, 2:5]),  # a window into a larger storage
        ("bf16", torch.tensor([0.5, -2.0, 3.25], dtype=torch.bfloat16)),
        ("int64", torch.tensor([[7, -8], [9, 10]])),
    ]
    expected = _as_plain([(name, tensor.clone()) for name, tensor in named])
    payload = serialize_named_tensors(named)
    # The payload holds copies: changing the originals afterwards must not reach the receiver.
    for _, tensor in named:
        tensor.add_(1)
    base.fill_(100.0)

    [received] = _run([(_map_payload, (payload,))])
    assert received == expected


def _forking_payload(obj) -> str:
    """`obj` pickled the way serialize_named_tensors pickles, whatever its structure."""
    buffer, previous = io.BytesIO(), torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.mark.reliability("weight payload: not (name, tensor) pairs, or not base64", "ValueError saying what it holds")
def test_deserialize_rejects_a_payload_without_name_tensor_pairs():
    with pytest.raises(ValueError, match="list of \\(name, tensor\\) pairs"):
        deserialize_named_tensors(_forking_payload({"weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="not base64"):
        deserialize_named_tensors("this is not base64!")


class _RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _CallsEval:
    def __reduce__(self):
        return eval, ("1 + 1",)


def _pickled_global(module: str, name: str) -> str:
    """A protocol-4 pickle that only looks up module.name (STACK_GLOBAL), base64-encoded."""

    def short_string(text: str) -> bytes:
        return b"\x8c" + bytes([len(text)]) + text.encode()

    raw = b"\x80\x04" + short_string(module) + short_string(name) + b"\x93."
    return base64.b64encode(raw).decode("ascii")


@pytest.mark.reliability(
    "weight payload whose pickle calls os.system, eval, or a dotted torch global", "ValueError naming it; nothing runs"
)
def test_deserialize_refuses_foreign_globals_before_building_anything(tmp_path):
    marker = tmp_path / "pwned"
    real = serialize_named_tensors([("w", torch.ones(3))])
    attacks = {
        "posix.system": base64.b64encode(pickle.dumps([("w", _RunsCommand(f"touch {marker}"))])).decode("ascii"),
        "builtins.eval": base64.b64encode(pickle.dumps([("w", _CallsEval())])).decode("ascii"),
        # A real pair first, then the attack: the global is refused before the first tensor is rebuilt.
        "posix.system ": _forking_payload([("w", torch.ones(3)), ("x", _RunsCommand(f"touch {marker}"))]),
        # Exact names only: a dotted name would reach UntypedStorage.from_file, which maps any file.
        "torch.storage.UntypedStorage.from_file": _pickled_global("torch.storage", "UntypedStorage.from_file"),
        "torch._utils._rebuild_tensor_v2": base64.b64encode(pickle.dumps([("w", torch.ones(2))])).decode("ascii"),
    }
    for named_global, payload in attacks.items():
        with pytest.raises(ValueError, match=f"refers to {named_global.strip()},"):
            deserialize_named_tensors(payload)
    assert not marker.exists()
    assert [name for name, _ in deserialize_named_tensors(real)] == ["w"]  # the real thing still loads


# ---------------------------------------------------------------- broadcast group

SENT = [
    ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
    ("b", torch.tensor([1.5, -0.25, 8.0], dtype=torch.bfloat16)),
]
SENT_AGAIN = [("c", torch.full((4,), 2.5))]


def _trainer_rank(store_file: str, ports: list[int], group_name: str, queue) -> None:
    """Rank 0 in a process that already has a default (training) group, as a trainer rank does."""
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
    for port, tensors in zip(ports, [SENT, SENT_AGAIN]):
        group = init_process_group_like_sglang("gloo", "127.0.0.1", port, 0, 2, group_name, TIMEOUT)
        for _, tensor in tensors:
            dist.broadcast(tensor, src=0, group=group)
        dist.destroy_process_group(group)
    # The training group is still the default one and still works.
    total = torch.ones(1)
    dist.all_reduce(total)
    state = (dist.get_rank(), dist.get_world_size(), total.item())
    dist.destroy_process_group()
    queue.put(state)


def _engine_rank(ports: list[int], group_name: str, queue) -> None:
    """Rank 1 in a process without a default group, as the CPU engine is."""
    received = []
    for port, tensors in zip(ports, [SENT, SENT_AGAIN]):
        group = init_process_group_like_sglang("gloo", "127.0.0.1", port, 1, 2, group_name, TIMEOUT)
        assert (group.rank(), group.size()) == (1, 2)
        for name, tensor in tensors:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
            dist.broadcast(buffer, src=0, group=group)
            received.append((name, buffer))
        # Leaving frees the name for the next round.
        dist.destroy_process_group(group)
    queue.put((dist.is_initialized(), _as_plain(received)))


def test_group_between_a_trainer_with_a_default_group_and_an_engine_without(tmp_path):
    ports = [find_free_port(), find_free_port()]
    trainer_state, (engine_has_default_group, received) = _run(
        [
            (_trainer_rank, (str(tmp_path / "default_group_store"), ports, "weights")),
            (_engine_rank, (ports, "weights")),
        ]
    )
    assert received == _as_plain(SENT + SENT_AGAIN)
    assert trainer_state == (0, 1, 1.0)  # rank 0 of the 1-process training group; all_reduce of 1 is 1
    assert engine_has_default_group is False  # joining made no default group in the engine


def _hand_built_sglang_rank(port: int, group_name: str, queue) -> None:
    """A receiver assembled step by step as SGLang's engines do, independent of weight_transport."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend("gloo"),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=TIMEOUT,
    )
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    buffer = torch.empty(SENT[0][1].shape)
    dist.broadcast(buffer, src=0, group=group)
    dist.destroy_process_group(group)
    queue.put(buffer.tolist())


def _sender(port: int, group_name: str, queue) -> None:
    group = init_process_group_like_sglang("gloo", "127.0.0.1", port, 0, 2, group_name, TIMEOUT)
    dist.broadcast(SENT[0][1], src=0, group=group)
    dist.destroy_process_group(group)
    queue.put("sent")


def test_group_meets_a_rank_built_the_sglang_way():
    port = find_free_port()
    status, received = _run([(_sender, (port, "probe_group")), (_hand_built_sglang_rank, (port, "probe_group"))])
    assert status == "sent" and received == SENT[0][1].tolist()
