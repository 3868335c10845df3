"""Weight transport shared by trainers and engines, between real processes.

- Shared-memory payloads: serialized in this process, mapped in a spawned one.
- Reusable shared-memory segments (CPU tensors): a real CPU engine process keeps its weights in the segments of
  one push while the next fills the other set, computes what the pushed weights compute, refuses malformed
  layouts with a 400, maps only sealed memory files (none can be cut short under it), and lets go of segments
  the trainer closed; a trainer that exits or is SIGKILLed leaves no file behind.
- The SGLang-style broadcast group: a trainer-like process (with a default process group)
  and an engine-like process (without one) join it, broadcast, leave and rejoin under the same
  name; and a rank built by hand the way SGLang's `init_custom_process_group` builds it (torch's
  `tcp://` rendezvous store, `PrefixStore(group_name)`, `_new_process_group_helper`) meets ours.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import json
import os
import pickle
import re
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import requests
import torch
import torch.distributed as dist
import torch.multiprocessing
from support.engines import REPO_ROOT, engine_server
from support.ranks import rank_process_context
from transformers import AutoModelForCausalLM

from slime.backends.sglang_utils.http_client import EngineClient
from slime.backends.weight_sync import SharedMemoryTransport
from slime.utils import weight_transport
from slime.utils.http_utils import find_free_port
from slime.utils.weight_sync import bucket_named_tensors, probe_tokens
from slime.utils.weight_transport import (
    SHARED_MEMORY_FORMAT,
    MappedSegments,
    deserialize_named_tensors,
    init_process_group_like_sglang,
    parse_shared_payload,
    release_send_segments,
    segment_tag,
    serialize_named_tensors,
    stage_named_tensors,
)
from slime.utils.weight_transport import _NamedTensorPickler as NamedTensorPickler

TIMEOUT = datetime.timedelta(seconds=60)


def _as_plain(named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], list]]:
    """Names, dtypes, shapes and values as plain Python (bf16 widened exactly to float32)."""
    plain = []
    for name, tensor in named_tensors:
        values = tensor.float().tolist() if tensor.is_floating_point() else tensor.tolist()
        plain.append((name, str(tensor.dtype), list(tensor.shape), values))
    return plain


def _run(targets: list[tuple]) -> list:
    """Run each (function, args) in a fresh process (forked from the preloaded fork server, support.ranks) that puts
    one result on the queue it gets last.

    Returns the results in target order; fails if a process errs or hangs.
    """
    context = rank_process_context()
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


def _slime_payload(obj) -> str:
    """`obj` pickled the way serialize_named_tensors pickles, whatever its structure."""
    buffer = io.BytesIO()
    NamedTensorPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _torch_file_system_payload(obj) -> str:
    """`obj` pickled with torch's own reductions under its file_system strategy: CPU storages as /dev/shm names."""
    buffer, previous = io.BytesIO(), torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.mark.reliability("weight payload: not (name, tensor) pairs, or not base64", "ValueError saying what it holds")
def test_deserialize_rejects_a_payload_without_name_tensor_pairs():
    for payload in ({"weight": "not a tensor"}, [("weight",)], torch.zeros(2)):
        with pytest.raises(ValueError, match="list of \\(name, tensor\\) pairs"):
            deserialize_named_tensors(_slime_payload(payload))
    with pytest.raises(ValueError, match="not base64"):
        deserialize_named_tensors("this is not base64!")
    # The {name: tensor} form (SGLang's LoRA endpoint reads a dict) comes back as pairs.
    named = [("a", torch.arange(3.0)), ("b", torch.ones(2, 2))]
    assert _as_plain(deserialize_named_tensors(serialize_named_tensors(named, as_dict=True))) == _as_plain(named)


class _SharedBytes:
    """One by-value tensor whose bytes object a pickle memoizes: every copy of it names the same bytes."""

    data = b"\0" * 40_000

    def __reduce__(self):
        return weight_transport._tensor_from_bytes, (self.data, "float32", [10_000])


@pytest.mark.reliability(
    "weight or adapter pickle that names one bytes object for many tensors (45 kB growing into 8 MB, or all of memory)",
    "ValueError before the copies are made: the tensors may hold no more bytes than the payload",
)
def test_a_payload_cannot_grow_past_its_own_size():
    raw = pickle.dumps([(f"w{i}", _SharedBytes()) for i in range(200)])  # 200 tensors, one bytes object
    assert len(raw) < 50_000
    with pytest.raises(ValueError, match="more bytes than the payload itself"):
        deserialize_named_tensors(base64.b64encode(raw).decode("ascii"))


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
        "posix.system ": _slime_payload([("w", torch.ones(3)), ("x", _RunsCommand(f"touch {marker}"))]),
        # Exact names only: a dotted name would reach UntypedStorage.from_file, which maps any file.
        "torch.storage.UntypedStorage.from_file": _pickled_global("torch.storage", "UntypedStorage.from_file"),
        "torch._utils._rebuild_tensor_v2": base64.b64encode(pickle.dumps([("w", torch.ones(2))])).decode("ascii"),
    }
    for named_global, payload in attacks.items():
        with pytest.raises(ValueError, match=f"refers to {named_global.strip()},"):
            deserialize_named_tensors(payload)
    assert not marker.exists()
    assert [name for name, _ in deserialize_named_tensors(real)] == ["w"]  # the real thing still loads


class _NamesAFile:
    """What torch's rebuild_storage_filename takes: a manager socket, a /dev/shm name and a size to map."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        rebuild = torch.multiprocessing.reductions.rebuild_storage_filename
        return rebuild, (torch.UntypedStorage, b"/tmp/any-socket", f"/{self.name}".encode(), 384)


@pytest.mark.reliability(
    "weight pickle naming another /dev/shm file (or a socket) for the engine to open, grow and map",
    "ValueError naming torch's rebuild global before anything is opened; slime's CPU tensors travel by value",
)
def test_pickles_cannot_name_a_file_or_socket_for_the_receiver_to_open():
    victim = Path("/dev/shm") / f"victim_{os.getpid()}"
    victim.write_bytes(b"x" * 16)
    try:
        for payload in (
            _torch_file_system_payload([("w", torch.ones(3))]),  # torch's own form of a CPU tensor
            base64.b64encode(pickle.dumps([("model.norm.weight", _NamesAFile(victim.name))])).decode("ascii"),
        ):
            with pytest.raises(ValueError, match="refers to torch.multiprocessing.reductions.rebuild_"):
                deserialize_named_tensors(payload)
        assert victim.read_bytes() == b"x" * 16  # neither grown nor written
    finally:
        victim.unlink()
    raw = base64.b64decode(serialize_named_tensors([("w", torch.ones(3))]))
    assert b"_tensor_from_bytes" in raw and b"rebuild_" not in raw  # no storage, file or socket named


# ---------------------------------------------------------------- reusable shared-memory segments


def _segments_of(payloads: list[str]) -> set[str]:
    return {json.loads(payload)["segment"] for payload in payloads}


_MEMFD = re.compile(r"/memfd:(slime_w_(?:[0-9a-f]{16}_)?[0-9a-f]{16}) \(deleted\)")


def _mapped_by(pid: int) -> set[str]:
    """Names of the slime segments process `pid` maps, read from the kernel's /proc/<pid>/maps."""
    return {match[1] for line in open(f"/proc/{pid}/maps") if (match := _MEMFD.search(line))}


def _open_in(pid: int) -> set[str]:
    """Names of the slime segments process `pid` holds open (a sender's live segments)."""
    names = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if match := _MEMFD.fullmatch(os.readlink(f"/proc/{pid}/fd/{fd}")):
                names.add(match[1])
    return names


def _slime_files_in_dev_shm() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith("slime_w_")]


def test_staged_tensors_read_back_in_any_dtype_and_layout():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    named = [
        ("transposed", base.t()),  # non-contiguous
        ("bf16", torch.tensor([0.5, -2.0, 3.25], dtype=torch.bfloat16)),
        ("int64", torch.tensor([[7, -8], [9, 10]])),
        ("bool", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 3)),
    ]
    expected = _as_plain([(name, tensor.clone()) for name, tensor in named])
    segments = MappedSegments()
    release_send_segments()
    try:
        payload = parse_shared_payload(stage_named_tensors(named, index=0))
        assert _as_plain(segments.named_tensors(payload)) == expected
        assert all(tensor.offset % 64 == 0 for tensor in payload.tensors)
    finally:
        segments.close()
        release_send_segments()
    assert payload.segment not in _open_in(os.getpid()) and not _slime_files_in_dev_shm()


@pytest.mark.reliability(
    "shared-memory weight payload naming another job's segment, an unsealed memory file, or any other file "
    "descriptor; a segment truncated after the engine mapped it",
    "ValueError: a receiver with a key maps only its job's segments, and only memory files sealed against "
    "shrinking: truncating a mapped segment fails (EPERM) for everyone, so it cannot SIGBUS the engine",
)
def test_a_receiver_maps_only_its_jobs_sealed_segments(tmp_path):
    tag, other = segment_tag("job-key"), segment_tag("other-job-key")
    assert tag != other and len(tag) == 16 and segment_tag(None) is None
    segments = MappedSegments()
    release_send_segments()
    try:
        ours = stage_named_tensors([("w", torch.ones(4))], 0, tag=tag)
        assert json.loads(ours)["segment"].startswith(f"slime_w_{tag}_")
        ((_, view),) = segments.named_tensors(parse_shared_payload(ours, tag))
        assert view.tolist() == [1.0] * 4
        del view
        for theirs in (
            stage_named_tensors([("w", torch.ones(4))], 1),
            stage_named_tensors([("w", torch.ones(4))], 2, tag=other),
        ):
            with pytest.raises(ValueError, match="is not one of this job's"):
                parse_shared_payload(theirs, tag)
        assert parse_shared_payload(theirs).segment  # a receiver without a key takes any slime segment

        # Mapped, the segment cannot be cut short under the receiver: not by its sender, not through /proc.
        sent = json.loads(ours)
        for path in (f"/proc/self/fd/{sent['fd']}", f"/proc/{sent['pid']}/fd/{sent['fd']}"):
            with pytest.raises(PermissionError):
                os.truncate(path, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(sent["fd"], 1)
        ((_, view),) = segments.named_tensors(parse_shared_payload(ours, tag))
        assert view.tolist() == [1.0] * 4

        # A memory file with a slime name but no seals (it could shrink after mapping), and a FIFO the payload
        # names by fd (opening one for reading would block): neither is opened as a segment.
        unsealed = os.memfd_create(f"slime_w_{tag}_{'0' * 16}", os.MFD_CLOEXEC)
        os.ftruncate(unsealed, 4096)
        os.mkfifo(tmp_path / "fifo")
        fifo = os.open(tmp_path / "fifo", os.O_RDWR | os.O_NONBLOCK)
        try:
            forged = {**sent, "segment": f"slime_w_{tag}_{'0' * 16}", "fd": unsealed}
            with pytest.raises(ValueError, match="is not sealed against shrinking"):
                segments.named_tensors(parse_shared_payload(json.dumps(forged), tag))
            for fd in (fifo, 0, 2**30):
                with pytest.raises(ValueError, match="there is no shared-memory segment"):
                    segments.named_tensors(parse_shared_payload(json.dumps({**forged, "fd": fd}), tag))
            with pytest.raises(ValueError, match="there is no shared-memory segment"):  # ours, in another process
                segments.named_tensors(parse_shared_payload(json.dumps({**forged, "pid": 1}), tag))
            assert set(segments.mappings) == {sent["segment"]}
        finally:
            os.close(unsealed)
            os.close(fifo)
    finally:
        segments.close()
        release_send_segments()


def test_a_segment_the_receiver_holds_is_never_written():
    segments = MappedSegments()
    weight = torch.nn.Parameter(torch.zeros(4))
    release_send_segments()

    def push(value: float, numel: int = 4) -> str:
        """Stage chunk 0 beside what the receiver holds; it points `weight` at a view (or copies a larger one)."""
        held = segments.holding([weight])
        payload = parse_shared_payload(stage_named_tensors([("w", torch.full((numel,), value))], 0, held))
        ((_, view),) = segments.named_tensors(payload)
        weight.data = view if numel == 4 else view[:4].clone()
        return payload.segment

    try:
        first = push(1.0)
        assert segments.holding([weight]) == [first]
        second = push(2.0)  # the receiver's weights live in `first`: the push goes to the other segment
        assert second != first and weight.tolist() == [2.0] * 4
        third = push(3.0)  # ...and back, now that the weights left `first`
        assert third == first and weight.tolist() == [3.0] * 4
        # A chunk that fits neither: the free one (`second`) is replaced by a larger one; `first`, held, is kept.
        fourth = push(4.0, numel=2**19)
        assert fourth not in (first, second) and _open_in(os.getpid()) == {first, fourth}
        assert second not in segments.mappings  # the receiver let go of the segment its sender closed
        assert segments.holding([weight]) == []  # that push was copied, not pointed at
    finally:
        segments.close()
        release_send_segments()
    assert not _open_in(os.getpid())


class RecordingClient(EngineClient):
    """A real engine client that also keeps what each /update_weights_from_tensor call carried."""

    def __init__(self, url: str):
        super().__init__(url)
        self.calls: list[dict] = []

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], **kwargs):
        response = super().update_weights_from_tensor(serialized_named_tensors=serialized_named_tensors, **kwargs)
        self.calls.append({"payloads": serialized_named_tensors, "response": response, **kwargs})
        return response


@pytest.fixture(scope="module")
def shm_engine(tiny_model_dir):
    with engine_server(tiny_model_dir) as (process, url):
        yield process, url


def _prompt_log_probs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)


def _engine_log_probs(url: str, tokens: list[int]) -> torch.Tensor:
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    entries = requests.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]["input_token_logprobs"]
    return torch.tensor([entry[0] for entry in entries[1:]])


@pytest.mark.slow
def test_pushes_reuse_the_segments_and_deliver_the_new_values(tiny_model_dir, shm_engine):
    process, url = shm_engine
    client = RecordingClient(url)
    transport = SharedMemoryTransport(gpus_per_engine=1)
    transport.connect([client], [url], rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    probe = probe_tokens(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)

    def push(version: str) -> set[str]:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator), alpha=0.05)
        client.calls.clear()
        buckets = bucket_named_tensors(((n, p.detach()) for n, p in model.named_parameters()), 40_000)
        transport.push(buckets, version)
        assert all(call["load_format"] == SHARED_MEMORY_FORMAT for call in client.calls)
        counts = [int(re.fullmatch(r"updated (\d+) tensors", call["response"]["message"])[1]) for call in client.calls]
        assert sum(counts) == len(list(model.parameters()))
        assert requests.get(f"{url}/get_model_info", timeout=30).json()["weight_version"] == version
        gap = (_engine_log_probs(url, probe) - _prompt_log_probs(model, probe)).abs().max().item()
        assert gap < 1e-5, gap
        return _segments_of([payload for call in client.calls for payload in call["payloads"]])

    release_send_segments()
    try:
        first = push("1")
        assert len(first) > 2 and client.calls[0]["payloads"] == []  # several chunks, after asking what is held
        before = _engine_log_probs(url, probe)
        second = push("2")
        assert not second & first  # the engine's weights live in `first`: this push fills the other segments...
        assert set(client.calls[-1]["response"]["segments_in_use"]) == second  # ...and the weights move there
        third = push("3")
        assert third == first  # the same segments again, rewritten in place...
        assert (_engine_log_probs(url, probe) - before).abs().max().item() > 1e-3  # ...with the new values
        assert _mapped_by(process.pid) == first | second  # mapped once, kept across pushes

        # Released and resumed (--offload-rollout), the engine holds no segment: the push reuses the same ones.
        for endpoint in ("release_memory_occupation", "resume_memory_occupation"):
            assert requests.post(f"{url}/{endpoint}", json={}, timeout=120).json()["success"] is True
        gap = (_engine_log_probs(url, probe) - _prompt_log_probs(model, probe)).abs().max().item()
        assert gap < 1e-5, gap  # the release snapshot of weights that lived in segments was right
        assert push("4") == first

        release_send_segments()  # as a trainer that exits; a new one pushes through new segments
        assert not _open_in(os.getpid())
        fifth = push("5")
        assert not fifth & (first | second)
        assert _mapped_by(process.pid) == fifth  # the closed ones were let go
    finally:
        release_send_segments()


@pytest.mark.slow
@pytest.mark.reliability(
    "malformed /update_weights_from_tensor shared-memory layout (bad JSON, foreign or missing segment, a FIFO "
    "or other file named by fd, offset past the end or misaligned, unknown dtype, negative shape, unknown parameter)",
    "HTTP 400 naming the problem; nothing is read out of bounds and the weights stay as they were",
)
def test_malformed_shared_memory_payloads_are_refused(tiny_model_dir, shm_engine, tmp_path):
    _, url = shm_engine
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    name, tensor = next(iter(model.state_dict().items()))
    probe = probe_tokens(model.config.vocab_size)
    before = _engine_log_probs(url, probe)
    version = requests.get(f"{url}/get_model_info", timeout=30).json()["weight_version"]
    good = json.loads(stage_named_tensors([(name, torch.zeros_like(tensor))], index=0))
    segment_bytes = os.fstat(good["fd"]).st_size
    os.mkfifo(tmp_path / "fifo")
    fifo = os.open(tmp_path / "fifo", os.O_RDWR | os.O_NONBLOCK)  # opening a FIFO for reading would block

    def entry(**changed):
        return {**good, "tensors": [{**good["tensors"][0], **changed}]}

    cases = [
        ("{not json", "not JSON"),
        ({**good, "segment": "../../etc/passwd"}, "slime segment name"),
        ({**good, "segment": "torch_1_2"}, "slime segment name"),
        ({**good, "segment": "slime_w_" + "0" * 16}, "no shared-memory segment"),
        ({**good, "fd": fifo}, "no shared-memory segment"),
        ({**good, "pid": "self"}, "pid and fd must be"),
        ({**good, "fd": -1}, "pid and fd must be"),
        (entry(offset=segment_bytes), "reach past the end"),
        (entry(offset=2), "multiple of 4"),
        (entry(dtype="float33"), "dtype must name a torch dtype"),
        (entry(shape=[-1, 4]), "shape must be a list of integers"),
        (entry(name="no.such.weight"), "unknown parameter names"),
        (entry(shape=[1, 2]), "wrong shapes"),
        ({"segment": good["segment"]}, "JSON object"),
    ]
    try:
        for payload, expected in cases:
            text = payload if isinstance(payload, str) else json.dumps(payload)
            body = {"serialized_named_tensors": [text], "load_format": SHARED_MEMORY_FORMAT, "weight_version": "bad"}
            response = requests.post(f"{url}/update_weights_from_tensor", json=body, timeout=60)
            assert response.status_code == 400, (payload, response.text)
            assert response.json()["success"] is False and expected in response.json()["message"], response.text
        body = {"serialized_named_tensors": [good], "load_format": SHARED_MEMORY_FORMAT}
        response = requests.post(f"{url}/update_weights_from_tensor", json=body, timeout=60)
        assert response.status_code == 400 and "must be a JSON string" in response.text
    finally:
        release_send_segments()
        os.close(fifo)
    assert requests.get(f"{url}/get_model_info", timeout=30).json()["weight_version"] == version
    assert torch.equal(_engine_log_probs(url, probe), before)


_TRAINER = """
import json, sys, torch
from slime.utils.weight_transport import stage_named_tensors
print(json.dumps([stage_named_tensors([("w", torch.full((1000,), 3.0))], index) for index in (0, 1)]), flush=True)
sys.stdin.readline()  # the test maps a segment meanwhile
"""


@pytest.mark.reliability(
    "a trainer holding weight segments exits, or is killed with SIGKILL",
    "nothing is left to clean up: segments are memory files, never names in /dev/shm; their memory lasts while "
    "an engine's weights live in it, and a payload naming the dead trainer's segments is refused",
)
@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_a_trainer_leaves_no_segment_behind(ending):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    segments = MappedSegments()
    try:
        payloads = [parse_shared_payload(payload) for payload in json.loads(trainer.stdout.readline())]
        assert _open_in(trainer.pid) == {payload.segment for payload in payloads} and not _slime_files_in_dev_shm()
        ((_, weights),) = segments.named_tensors(payloads[0])  # as an engine whose weights live in the segment
        if ending == "exit":
            trainer.communicate("\n", timeout=60)
            assert trainer.returncode == 0
        else:
            trainer.kill()
            trainer.wait(timeout=60)
        assert weights.tolist() == [3.0] * 1000  # the memory lives on while it is mapped
        with pytest.raises(ValueError, match="there is no shared-memory segment"):
            segments.named_tensors(payloads[1])
        assert not segments.mappings and not _slime_files_in_dev_shm()  # the mapping went with its sender
    finally:
        segments.close()
        if trainer.poll() is None:
            trainer.kill()


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
