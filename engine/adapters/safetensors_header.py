"""The safetensors header of an adapter's weights, validated against the file without reading any tensor.

Layout: 8 bytes little-endian header length N, N bytes of JSON `{key: {dtype, shape, data_offsets}}` (plus
`__metadata__`), then the data, which the tensors' `data_offsets` [begin, end) must cover exactly, in order,
with nothing left over. A crafted header (offsets a scalar or three items, dtype a list, shape an int, a shape
multiplying out past the file) and trailing bytes are all `AdapterCorrupt`, caught before the file is read.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from kubelora.engine.adapters.files import open_regular
from kubelora.engine.errors import AdapterCorrupt

WEIGHTS_FILE = "adapter_model.safetensors"
# Bytes per element of the safetensors dtypes with whole-byte elements; other dtypes are refused later.
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
              "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def read_header(name: str, path: Path) -> tuple[dict, int]:
    """The safetensors JSON header and the file's size, checked against each other without reading tensors:
    every entry well-typed, and the tensors packed back to back over the data, with no byte after them."""
    def corrupt(why: str) -> AdapterCorrupt:
        return AdapterCorrupt(name, WEIGHTS_FILE, f"is corrupt: {why}", limit="a safetensors file")

    with open_regular(name, path) as f:
        size = os.fstat(f.fileno()).st_size
        header_len, header = _read_json_header(f, size, corrupt)
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    spans = sorted(_tensor_span(key, entry, data_len, corrupt) for key, entry in header.items())
    end = 0
    for begin, span_end, key in spans:
        if begin != end:
            raise corrupt(f"tensor {json_excerpt(key)} starts at data byte {begin}, expected {end}: tensors must "
                          "follow each other without gaps or overlaps")
        end = span_end
    if end != data_len:
        raise corrupt(f"the tensors end at data byte {end} but the file holds {data_len} data bytes "
                      f"({data_len - end} trailing bytes)")
    return header, size


def _read_json_header(f, size: int, corrupt) -> tuple[int, object]:
    """(header length, parsed header) of an open safetensors file of `size` bytes."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise corrupt(f"{size} bytes is shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(size - 8, MAX_HEADER_BYTES):
        raise corrupt(f"header length {header_len} exceeds the file ({size} bytes) or {MAX_HEADER_BYTES}")
    try:
        return header_len, json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise corrupt(f"header is not JSON ({type(exc).__name__})") from exc


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_span(key: str, entry: object, data_len: int, corrupt) -> tuple[int, int, str]:
    """(begin, end, key) of one header entry whose fields have safetensors' types and agree with its size."""
    tensor = f"tensor {json_excerpt(key)}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise corrupt(f"{tensor} has no dtype/shape/data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise corrupt(f"{tensor} dtype must be a string, got {json_excerpt(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise corrupt(f"{tensor} shape must be an array of non-negative integers, got {json_excerpt(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1] <= data_len):
        raise corrupt(f"{tensor} data_offsets must be [begin, end] with 0 <= begin <= end <= {data_len}, got "
                      f"{json_excerpt(offsets)}")
    item_bytes = ITEM_BYTES.get(dtype)
    if item_bytes is not None and _num_bytes(shape, item_bytes, data_len) != offsets[1] - offsets[0]:
        raise corrupt(f"{tensor} data_offsets {offsets} do not hold a {dtype} tensor of shape {json_excerpt(shape)}")
    return offsets[0], offsets[1], key


def _num_bytes(shape: list[int], item_bytes: int, limit: int) -> int:
    """Bytes of a tensor of `shape`, or limit + 1 once past `limit` (a crafted shape may multiply out to any size)."""
    if 0 in shape:
        return 0
    total = item_bytes
    for dim in shape:
        total *= dim
        if total > limit:
            return limit + 1
    return total


def json_excerpt(value: object) -> str:
    """`value` as JSON, cut to 80 characters: crafted values may be huge."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
