"""Delta weight sync's encoding (`slime.utils.weight_delta`): bit-exact round trips, skipped unchanged tensors, and
the checks that refuse a delta applied to the wrong weights. Expected bytes are computed here with plain Python
(`struct`, `hashlib`, byte loops), not with the module under test."""

from __future__ import annotations

import hashlib
import re
import struct

import numpy as np
import pytest
import safetensors.numpy
import torch
import zstandard

from slime.utils import weight_delta
from slime.utils.weight_delta import DeltaMismatch


def float32_bytes(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def bfloat16_bytes(values: list[float]) -> bytes:
    """bfloat16 = the top 16 bits of the float32 (exact for the values used here, which bf16 represents)."""
    return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:] for v in values)


def test_xor_payload_is_zstd_of_the_bytewise_xor_float32():
    base = torch.tensor([1.0, -2.0, 0.5, 3.0])
    new = torch.tensor([1.0, -2.0, 0.5000001, 3.25])
    payload = weight_delta.encode_tensor(new, base, "xor")
    expected = bytes(
        a ^ b for a, b in zip(float32_bytes([1.0, -2.0, 0.5000001, 3.25]), float32_bytes([1.0, -2.0, 0.5, 3.0]))
    )
    assert zstandard.ZstdDecompressor().decompress(payload) == expected
    # The first two elements did not move: their 8 xor bytes are zero; 0.5 -> 0.5000001 flips only the lowest byte.
    assert expected[:8] == bytes(8) and expected[8] != 0 and expected[9:12] == bytes(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_round_trip_is_bit_exact(dtype, encoding):
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=generator).to(dtype)
    new = (base.float() + 1e-3 * torch.randn(64, 33, generator=generator)).to(dtype)
    new[0, 0] = float("-0.0")  # a sign-only difference must survive too
    payload = weight_delta.encode_tensor(new, base, encoding)
    rebuilt = weight_delta.decode_tensor(payload, base, encoding, dtype, [64, 33])
    assert rebuilt.dtype == dtype and rebuilt.shape == (64, 33)
    assert bytes(rebuilt.view(torch.uint8).numpy()) == bytes(new.contiguous().view(torch.uint8).numpy())
    if encoding == "overwrite":
        assert payload == bytes(new.view(torch.uint8).numpy())


def test_bfloat16_bytes_match_an_independent_encoding():
    values = [1.0, -2.5, 0.15625]
    assert weight_delta.raw_bytes(torch.tensor(values, dtype=torch.bfloat16)).tobytes() == bfloat16_bytes(values)


def test_unchanged_tensor_is_skipped_and_a_sign_flip_is_not():
    base = torch.tensor([0.0, 1.0])
    assert weight_delta.encode_tensor(base.clone(), base, "xor") is None
    assert weight_delta.encode_tensor(base.clone(), base, "overwrite") is None
    # 0.0 == -0.0 as numbers, but the bytes differ: a delta compares bytes.
    assert weight_delta.encode_tensor(torch.tensor([-0.0, 1.0]), base, "xor") is not None


def test_xor_of_xor_is_the_identity():
    rng = np.random.default_rng(1)
    a = torch.from_numpy(rng.standard_normal(100).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(100).astype(np.float32))
    flips = zstandard.ZstdDecompressor().decompress(weight_delta.encode_tensor(a, b, "xor"))
    twice = bytes(x ^ y for x, y in zip(flips, float32_bytes(b.tolist())))
    assert twice == float32_bytes(a.tolist())
    # And the decoder agrees: xor-ing the payload onto b gives back a, onto a gives back b.
    assert torch.equal(
        weight_delta.decode_tensor(weight_delta.encode_tensor(a, b, "xor"), b, "xor", torch.float32, [100]), a
    )
    assert torch.equal(
        weight_delta.decode_tensor(weight_delta.encode_tensor(a, b, "xor"), a, "xor", torch.float32, [100]), b
    )


def test_checksums_are_the_standard_digests():
    data = float32_bytes([1.0, 2.0, 3.0])
    assert weight_delta.checksum(np.frombuffer(data, np.uint8), "sha256") == hashlib.sha256(data).hexdigest()
    digest = weight_delta.checksum(data, "xxh3-128")
    assert len(digest) == 32 and digest != weight_delta.checksum(float32_bytes([1.0, 2.0, 3.5]), "xxh3-128")
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        weight_delta.checksum(data, "md5")


def write_delta(folder, base: dict, new: dict, encoding="xor", algorithm="sha256", base_version="3"):
    """A delta folder as the trainer writes it (payload file + manifest), built by hand from the unit functions."""
    payloads, entries = {}, {}
    for name, tensor in new.items():
        payload = weight_delta.encode_tensor(tensor, base[name], encoding)
        if payload is None:
            continue
        payloads[name] = np.frombuffer(payload, np.uint8)
        entries[name] = {
            "file": "delta-00000.safetensors",
            "dtype": weight_delta.dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "checksum": hashlib.sha256(bytes(tensor.contiguous().view(torch.uint8).numpy())).hexdigest()
            if algorithm == "sha256"
            else weight_delta.checksum(weight_delta.raw_bytes(tensor), algorithm),
        }
    safetensors.numpy.save_file(payloads, folder / "delta-00000.safetensors")
    weight_delta.write_manifest(folder, base_version, str(int(base_version) + 1), encoding, algorithm, entries, 1)
    return entries


def test_folder_rebuilds_changed_tensors_only(tmp_path):
    base = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    new = {"a": base["a"] + 0.25, "b": base["b"].clone()}
    entries = write_delta(tmp_path, base, new)
    assert list(entries) == ["a"]  # b did not change
    manifest = weight_delta.read_manifest(tmp_path)
    rebuilt = weight_delta.rebuild_tensors(tmp_path, manifest, "3", base.__getitem__)
    assert [name for name, _ in rebuilt] == ["a"] and torch.equal(rebuilt[0][1], new["a"])
    assert weight_delta.read_manifest(tmp_path / "nowhere") is None


def test_engine_holding_float32_copies_rebuilds_bfloat16(tmp_path):
    base = {"w": torch.tensor([1.5, -0.75, 2.0], dtype=torch.bfloat16)}
    new = {"w": torch.tensor([1.5, -0.8125, 2.0], dtype=torch.bfloat16)}
    write_delta(tmp_path, base, new)
    engine_holds = {"w": base["w"].float()}
    (rebuilt,) = weight_delta.rebuild_tensors(tmp_path, weight_delta.read_manifest(tmp_path), "3", engine_holds.get)
    assert rebuilt[1].dtype == torch.bfloat16 and torch.equal(rebuilt[1], new["w"])


def test_wrong_base_fails_the_checksum_naming_the_tensor(tmp_path):
    base = {"layer.weight": torch.zeros(8)}
    write_delta(tmp_path, base, {"layer.weight": torch.full((8,), 0.5)}, algorithm="xxh3-128")
    drifted = {"layer.weight": torch.zeros(8).index_fill_(0, torch.tensor([3]), 1e-3)}
    manifest = weight_delta.read_manifest(tmp_path)
    with pytest.raises(DeltaMismatch, match=r"tensor layer\.weight fails its xxh3-128 checksum"):
        weight_delta.rebuild_tensors(tmp_path, manifest, "3", drifted.get)


def test_corrupt_payload_or_wrong_version_is_refused(tmp_path):
    base = {"w": torch.zeros(16)}
    write_delta(tmp_path, base, {"w": torch.linspace(0, 1, 16)}, encoding="overwrite")
    manifest = weight_delta.read_manifest(tmp_path)
    with pytest.raises(DeltaMismatch, match=r"encoded against weight version '3' but the weights held are version '7'"):
        weight_delta.rebuild_tensors(tmp_path, manifest, "7", base.get)
    payloads = safetensors.numpy.load_file(tmp_path / "delta-00000.safetensors")
    payloads["w"] = payloads["w"].copy()
    payloads["w"][5] ^= 0x40
    safetensors.numpy.save_file(payloads, tmp_path / "delta-00000.safetensors")
    with pytest.raises(DeltaMismatch, match=r"tensor w fails its sha256 checksum"):
        weight_delta.rebuild_tensors(tmp_path, manifest, "3", base.get)
    payloads["w"] = payloads["w"][:-4]
    safetensors.numpy.save_file(payloads, tmp_path / "delta-00000.safetensors")
    with pytest.raises(
        DeltaMismatch, match=r"tensor w: the payload holds 60 bytes, a torch.float32 \[16\] tensor has 64"
    ):
        weight_delta.rebuild_tensors(tmp_path, manifest, "3", base.get)


def test_undecompressable_xor_payload_is_refused():
    with pytest.raises(DeltaMismatch, match="does not decompress"):
        weight_delta.decode_tensor(b"not zstd at all", torch.zeros(4), "xor", torch.float32, [4])


def test_encoding_against_a_different_tensor_is_an_error():
    with pytest.raises(
        ValueError, match=r"cannot encode a torch.float32 \[3\] tensor against a torch.float32 \[4\] base"
    ):
        weight_delta.encode_tensor(torch.zeros(3), torch.zeros(4), "xor")
    with pytest.raises(ValueError, match="unknown delta encoding 'sparse'"):
        weight_delta.encode_tensor(torch.zeros(3), torch.ones(3), "sparse")


@pytest.mark.reliability(
    "delta sync with SGLang engines, without disk sync, with --colocate or --lora-rank, and delta-only flags "
    "without --update-weight-mode delta",
    "refused at parse time naming the flags and the fix",
)
def test_delta_flags_are_checked_at_parse_time(tmp_path):
    from slime.utils.arguments import ArgumentValidationError, parse_args

    base = ["--train-backend", "fsdp", "--hf-checkpoint", "/models/tiny", "--prompt-data", "x.jsonl",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1"]  # fmt: skip
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path)]
    delta = [*disk, "--update-weight-mode", "delta"]
    refused = {
        "--update-weight-mode delta needs --rollout-backend cpu: SGLang's /update_weights_from_disk loads full "
        "folders only": ["--rollout-backend", "sglang", "--rollout-num-gpus", "1", *delta],
        "--update-weight-mode delta needs --update-weight-transport disk": ["--update-weight-mode", "delta"],
        "--update-weight-mode delta does not apply with --lora-rank": ["--lora-rank", "4", *delta],
        "--update-weight-local-checkpoint-dir, --update-weight-delta-encoding only take effect with "
        "--update-weight-mode delta": [
            *disk, "--update-weight-local-checkpoint-dir", "/x", "--update-weight-delta-encoding", "overwrite"
        ],
    }  # fmt: skip
    for message, flags in refused.items():
        with pytest.raises(ArgumentValidationError, match=re.escape(message)):
            parse_args([*base, "--rollout-backend", "cpu", *flags])  # a later --rollout-backend wins
    args = parse_args([*base, "--rollout-backend", "cpu", *delta, "--update-weight-delta-checksum", "sha256"])
    assert (args.update_weight_mode, args.update_weight_delta_checksum) == ("delta", "sha256")
