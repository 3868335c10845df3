"""Delta weight sync (`--update-weight-mode delta`): per tensor, the change since the weights the engines hold.

A delta folder holds `slime-delta.json` (the manifest: the weight version it was encoded against, the encoding,
the checksum algorithm, and per changed tensor its dtype, shape, payload file and checksum) and payload files
`delta-<i>.safetensors` of 1-D uint8 tensors, one per changed tensor, named like it. Tensors left out are
bit-equal to the base. Encodings:

- `xor`: zstd of `new XOR base` over the raw bytes. Bitwise, so the rebuild `payload XOR base` is bit-exact for
  every dtype (subtracting floats is not: `(a - b) + b != a` in general). A small update leaves the sign, the
  exponent and the top mantissa bits of most elements as they were: a relative change r < 2^-k keeps the top
  ~k mantissa bits, so those xor bytes are zero and zstd removes them; an element that did not move is all zero.
- `overwrite`: the changed tensors' new bytes, whole and uncompressed (the engine needs no base for them, only
  for the tensors left out).

Each changed tensor carries a checksum of its new bytes; the engine computes it over what it rebuilt, so a wrong
base (an engine that drifted from the version the trainer assumes), a corrupted payload or a decoding bug is
caught before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard
from safetensors import safe_open

MANIFEST = "slime-delta.json"
FORMAT = "slime-weight-delta/1"
ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "sha256")
# zstd level 1: the xor stream is mostly zero runs, which every level removes; higher levels cost CPU time on
# rank 0 for a few percent of bytes.
ZSTD_LEVEL = 1


class DeltaMismatch(ValueError):
    """A delta that cannot be applied to the weights held (wrong base version, checksum or size): the sender
    must push the full weights instead."""


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when it is a contiguous CPU tensor)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def checksum(data: np.ndarray | bytes, algorithm: str) -> str:
    """Hex digest of `data` with `algorithm` (one of `CHECKSUMS`; xxh3-128, upstream slime's default, is ~20x
    faster than sha256 and as good at catching corruption; sha256 also resists deliberate collisions)."""
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128_hexdigest(data)
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise ValueError(f"unknown checksum {algorithm!r}; use one of {', '.join(CHECKSUMS)}")


def encode_tensor(new: torch.Tensor, base: torch.Tensor, encoding: str) -> bytes | None:
    """The payload that turns `base` into `new`, or None when they are bit-equal (the tensor is left out).

    Raises:
        ValueError: unknown encoding, or `new` and `base` differ in dtype or shape (a base from another model).
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown delta encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")
    if new.dtype != base.dtype or new.shape != base.shape:
        raise ValueError(
            f"cannot encode a {new.dtype} {list(new.shape)} tensor against a {base.dtype} {list(base.shape)} base"
        )
    new_bytes, base_bytes = raw_bytes(new), raw_bytes(base)
    if np.array_equal(new_bytes, base_bytes):
        return None
    if encoding == "overwrite":
        return new_bytes.tobytes()
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(np.bitwise_xor(new_bytes, base_bytes))


def decode_tensor(
    payload: bytes | np.ndarray, base: torch.Tensor, encoding: str, dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    """Rebuild the new tensor from `encode_tensor`'s payload and the base it was encoded against.

    `base` is cast to `dtype` first: an engine holding float32 copies of bfloat16 weights gets the bfloat16 bytes
    back exactly (bf16 -> fp32 -> bf16 is lossless); one holding them narrower than `dtype` cannot, and fails the
    checksum.

    Raises:
        DeltaMismatch: the payload does not decompress or has the wrong size.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if encoding == "overwrite":
        data = np.frombuffer(bytes(payload), dtype=np.uint8).copy()
    elif encoding == "xor":
        try:
            flips = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=nbytes)
        except zstandard.ZstdError as error:
            raise DeltaMismatch(f"the xor payload does not decompress ({error})") from None
        data = np.frombuffer(flips, dtype=np.uint8)
        if data.size == nbytes:
            data = np.bitwise_xor(data, raw_bytes(base.to(dtype)))
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")
    if data.size != nbytes:
        raise DeltaMismatch(f"the payload holds {data.size} bytes, a {dtype} {list(shape)} tensor has {nbytes}")
    return torch.from_numpy(data).view(dtype).reshape(shape)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (as the manifest stores it)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype_name(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16; ValueError naming the string otherwise."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return dtype


def write_manifest(
    folder: Path,
    base_version: str,
    weight_version: str,
    encoding: str,
    checksum_algorithm: str,
    tensors: dict[str, dict[str, Any]],
    unchanged: int,
) -> None:
    """Write the manifest of a delta folder (the last file written into it).

    Args:
        tensors: name -> {"file", "dtype", "shape", "checksum"} of every changed tensor.
        unchanged: How many tensors were left out as bit-equal (for the log).
    """
    manifest = {
        "format": FORMAT,
        "base_version": base_version,
        "weight_version": weight_version,
        "encoding": encoding,
        "compression": "zstd" if encoding == "xor" else None,
        "checksum": checksum_algorithm,
        "unchanged": unchanged,
        "tensors": tensors,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The manifest of a delta folder, or None for a folder without one (full weights).

    Raises:
        ValueError: the manifest is unreadable or not this format, naming the folder.
    """
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: unreadable delta manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest; this engine reads only that delta format")
    if manifest.get("encoding") not in ENCODINGS or manifest.get("checksum") not in CHECKSUMS:
        raise ValueError(
            f"{path}: unknown encoding {manifest.get('encoding')!r} or checksum {manifest.get('checksum')!r}"
        )
    if not isinstance(manifest.get("tensors"), dict):
        raise ValueError(f"{path}: 'tensors' must map tensor names to their entries")
    return manifest


def rebuild_tensors(
    folder: str | Path, manifest: dict[str, Any], held_version: str, current: Callable[[str], torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Rebuild every changed tensor of a delta folder from the weights held and check it against its checksum.

    Nothing is written: the caller copies the result in once every tensor passed.

    Args:
        manifest: From `read_manifest(folder)`.
        held_version: The weight version the weights held carry; must be the manifest's base version.
        current: name -> the tensor held under that name (the base).

    Returns:
        (name, new tensor) of every changed tensor.

    Raises:
        DeltaMismatch: naming the base versions, or the tensor whose payload or checksum does not match.
    """
    if manifest["base_version"] != held_version:
        raise DeltaMismatch(
            f"delta {folder} was encoded against weight version {manifest['base_version']!r} but the weights held "
            f"are version {held_version!r}; push the full weights"
        )
    folder, rebuilt, readers = Path(folder), [], {}
    with contextlib.ExitStack() as stack:
        for name, entry in manifest["tensors"].items():
            file = folder / Path(entry["file"]).name  # never a path outside the folder
            try:
                if file not in readers:
                    readers[file] = stack.enter_context(safe_open(file, framework="np"))
                payload = readers[file].get_tensor(name)
            except Exception as error:  # missing, truncated or not safetensors: the folder is not what was written
                raise DeltaMismatch(f"delta {folder}: cannot read tensor {name} from {file.name} ({error})") from None
            dtype = parse_dtype_name(entry["dtype"])
            try:
                tensor = decode_tensor(payload, current(name), manifest["encoding"], dtype, entry["shape"])
            except DeltaMismatch as error:
                raise DeltaMismatch(f"delta {folder}: tensor {name}: {error}; push the full weights") from None
            if checksum(raw_bytes(tensor), manifest["checksum"]) != entry["checksum"]:
                raise DeltaMismatch(
                    f"delta {folder}: tensor {name} fails its {manifest['checksum']} checksum after rebuilding (the "
                    f"weights held differ from version {held_version!r} the trainer encoded against, or the payload "
                    "is corrupt); push the full weights"
                )
            rebuilt.append((name, tensor))
    return rebuilt
