"""Walk a GGUF file's header once, checking every count and size against the file, before
gguf-py reads it.

gguf-py's `GGUFReader` trusts the counts it reads: a metadata array's declared length is
iterated as it stands (one flipped byte of a length turns 49,152 tokens into 2^40 iterations,
each allocating, until the process is killed), and a string or tensor past the end of the file
surfaces as a numpy error far from its cause. `scan(file)` reads the same layout with `struct`
over a memory map, in one linear pass and without building a Python object per element, and
refuses the first field that cannot be right with `GGUFError` naming the file, the field and the
value. What passes is safe for gguf-py to walk: every length it will follow fits in the file,
and the number of array elements it will turn into numpy views is bounded.

The layout (gguf-py's `gguf_reader.py`, llama.cpp's `gguf.cpp` and its GGUF spec):
magic `GGUF`, version u32 (2 or 3), tensor count u64, KV count u64; each KV a string key, a u32
value type and the value (a string is a u64 length and its bytes; an array a u32 item type, a u64
count and the items); each tensor info a string name, a u32 dimension count, u64 dimensions
innermost first, a u32 ggml type and a u64 offset from the start of the data section, which
begins at the next multiple of `general.alignment` (32 when absent) after the tensor infos. A
file written for the other byte order is recognised, as gguf-py does, by a version whose low
16 bits read as zero.
"""
from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALARS = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f", BOOL: "?",
           UINT64: "Q", INT64: "q", FLOAT64: "d"}
TYPE_NAMES = {UINT8: "UINT8", INT8: "INT8", UINT16: "UINT16", INT16: "INT16", UINT32: "UINT32", INT32: "INT32",
              FLOAT32: "FLOAT32", BOOL: "BOOL", STRING: "STRING", ARRAY: "ARRAY", UINT64: "UINT64", INT64: "INT64",
              FLOAT64: "FLOAT64"}
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# llama.cpp's limits (GGML_MAX_DIMS, GGML_MAX_NAME with its terminating zero).
MAX_DIMS, MAX_NAME = 4, 63
# gguf-py holds two numpy views per array element (about 170 MB for SmolLM2's 49,152 tokens and
# 48,900 merges); 16x the largest vocabulary in use (Gemma's 262,144) keeps an honest file
# loading and a crafted one from exhausting memory through elements the file does hold.
MAX_ARRAY_ITEMS = 1 << 22
# The smallest a KV pair (8-byte key length, type, a 1-byte value) and a tensor info (name
# length, one dimension, dimension count, type, offset) can be: counts beyond the file's bytes
# over these are refused before any is read.
MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file and the field or tensor."""


@dataclass(frozen=True)
class Value:
    """Where one KV's value lies: its type, an array's item type and count (0 for scalars)."""
    type: int
    item_type: int | None = None
    count: int = 0


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]           # innermost first, as stored
    offset: int                     # from the start of the data section
    n_bytes: int


@dataclass
class Header:
    """What the scan found: enough to know gguf-py will walk only what the file holds."""
    file: Path
    size: int
    version: int
    big_endian: bool
    alignment: int = DEFAULT_ALIGNMENT
    data_offset: int = 0
    digest: str = ""                # sha256 of every byte before the data section
    values: dict[str, Value] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)


class _Cursor:
    """A position in the mapped file; every read checks the bytes are there first, so a read
    past the end is a refusal naming `what` was being read, never a short buffer."""

    def __init__(self, buf, file: Path, order: str):
        self.buf, self.file, self.order, self.pos, self.size = buf, file, order, 0, len(buf)

    def refuse(self, what: str, detail: str) -> GGUFError:
        return GGUFError(f"{self.file}: {what} {detail}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.refuse(what, f"needs {n} bytes at offset {self.pos}, past the end of the file "
                                    f"({self.size} bytes); the file is truncated or corrupt")

    def unpack(self, code: str, what: str):
        n = struct.calcsize(code)
        self.need(n, what)
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += n
        return value

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str, *, decode: bool = True) -> str | None:
        length = self.unpack("Q", f"{what} (string length)")
        if length > self.size - self.pos:
            raise self.refuse(what, f"declares a string of {length} bytes at offset {self.pos}; only "
                                    f"{self.size - self.pos} bytes are left in the file")
        start = self.pos
        self.pos += length
        if not decode:
            return None
        try:
            return bytes(self.buf[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.refuse(what, f"is not UTF-8 ({exc.reason} at byte {exc.start})") from None


def scan(file: str | Path) -> Header:
    """The header of `file`, every count and size checked against the file; GGUFError naming the
    file, the field and the value at the first that cannot be right."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFError(f"{file}: {size} bytes is shorter than a GGUF header (24); the file is "
                                "truncated or not a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan(buf, file, size)
    except OSError as exc:
        raise GGUFError(f"{file}: cannot be read ({exc.strerror or exc})") from None


def _scan(buf, file: Path, size: int) -> Header:
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFError(f"{file}: magic {bytes(buf[:4])!r} is not b'GGUF'; not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    big = version & 0xFFFF == 0
    if big:
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in VERSIONS:
        raise GGUFError(f"{file}: GGUF version {version} is not supported; expected one of "
                        f"{', '.join(map(str, VERSIONS))}")
    cur = _Cursor(buf, file, ">" if big else "<")
    cur.pos = 8
    tensor_count = cur.unpack("Q", "GGUF.tensor_count")
    kv_count = cur.unpack("Q", "GGUF.kv_count")
    left = size - cur.pos
    if kv_count > left // MIN_KV_BYTES:
        raise GGUFError(f"{file}: GGUF.kv_count = {kv_count}: the {left} bytes after the header hold at most "
                        f"{left // MIN_KV_BYTES} key/value pairs; the file is corrupt")
    if tensor_count > left // MIN_TENSOR_INFO_BYTES:
        raise GGUFError(f"{file}: GGUF.tensor_count = {tensor_count}: the {left} bytes after the header hold at "
                        f"most {left // MIN_TENSOR_INFO_BYTES} tensor infos; the file is corrupt")
    header = Header(file, size, version, big)
    for i in range(kv_count):
        key = cur.string(f"metadata key #{i}")
        if key in header.values:
            raise cur.refuse(f"metadata field {key!r}", "appears twice")
        header.values[key] = _value(cur, key)
        if key == "general.alignment":
            header.alignment = _alignment(cur, header.values[key], key)
    _tensor_infos(cur, header, tensor_count)
    header.digest = hashlib.sha256(buf[:min(header.data_offset, size)]).hexdigest()
    return header


def _value(cur: _Cursor, key: str) -> Value:
    what = f"metadata field {key!r}"
    vtype = cur.unpack("I", f"{what} (type)")
    if vtype == ARRAY:
        item = cur.unpack("I", f"{what} (array item type)")
        count = cur.unpack("Q", f"{what} (array length)")
        if item == ARRAY:
            raise cur.refuse(what, "is an array of arrays, which llama.cpp does not read either")
        if item not in SCALARS and item != STRING:
            raise cur.refuse(what, f"has array item type {item}, not a GGUF value type (0-12)")
        _check_count(cur, what, item, count)
        if item == STRING:
            for j in range(count):
                cur.string(f"{what}[{j}]", decode=False)
        else:
            cur.skip(count * struct.calcsize(SCALARS[item]), f"{what} ({count} items)")
        return Value(ARRAY, item, count)
    if vtype == STRING:
        cur.string(what, decode=False)
        return Value(STRING)
    if vtype not in SCALARS:
        raise cur.refuse(what, f"has value type {vtype}, not a GGUF value type (0-12)")
    cur.skip(struct.calcsize(SCALARS[vtype]), what)
    return Value(vtype)


def _check_count(cur: _Cursor, what: str, item: int, count: int) -> None:
    """A declared array length fits the bytes left (each item takes at least its own size, a
    string its 8-byte length) and the element bound, before a single item is read."""
    least = 8 if item == STRING else struct.calcsize(SCALARS[item])
    left = cur.size - cur.pos
    if count > left // least:
        raise cur.refuse(what, f"declares {count} {TYPE_NAMES[item]} items; the {left} bytes left in the file "
                               f"hold at most {left // least}: the array length is corrupt")
    if count > MAX_ARRAY_ITEMS:
        raise cur.refuse(what, f"declares {count} items, more than the {MAX_ARRAY_ITEMS} this loader reads")


def _alignment(cur: _Cursor, value: Value, key: str) -> int:
    if value.type != UINT32:
        raise cur.refuse(f"metadata field {key!r}", f"has type {TYPE_NAMES.get(value.type, value.type)}; "
                                                    "it must be UINT32")
    (alignment,) = struct.unpack_from(cur.order + "I", cur.buf, cur.pos - 4)
    if alignment == 0 or alignment & (alignment - 1):
        raise cur.refuse(f"metadata field {key!r}", f"= {alignment} is not a power of two")
    return alignment


def _tensor_infos(cur: _Cursor, header: Header, count: int) -> None:
    names = set()
    infos = []
    for i in range(count):
        name = cur.string(f"tensor info #{i} (name)")
        what = f"tensor {name!r}"
        if len(name.encode()) > MAX_NAME:
            raise cur.refuse(what, f"has a name of {len(name.encode())} bytes; llama.cpp's limit is {MAX_NAME}")
        if name in names:
            raise cur.refuse(what, "appears twice")
        names.add(name)
        n_dims = cur.unpack("I", f"{what} (dimension count)")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.refuse(what, f"has {n_dims} dimensions; expected 1 to {MAX_DIMS}")
        dims = tuple(cur.unpack("Q", f"{what} (dimension {d})") for d in range(n_dims))
        raw_type = cur.unpack("I", f"{what} (type)")
        offset = cur.unpack("Q", f"{what} (offset)")
        infos.append((name, dims, raw_type, offset))
    header.data_offset = -(-cur.pos // header.alignment) * header.alignment
    for name, dims, raw_type, offset in infos:
        header.tensors.append(_tensor(cur, header, name, dims, raw_type, offset))


def _tensor(cur: _Cursor, header: Header, name: str, dims: tuple[int, ...], raw_type: int,
            offset: int) -> TensorInfo:
    what = f"tensor {name!r}"
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise cur.refuse(what, f"has ggml type {raw_type}, which is not a known type") from None
    if any(d == 0 for d in dims):
        raise cur.refuse(what, f"has a zero dimension {list(dims)}")
    if dims[0] % block:
        raise cur.refuse(what, f"has rows of {dims[0]} values, not a multiple of {ggml_type.name}'s block of {block}")
    n_elements = 1
    for d in dims:
        n_elements *= d
    n_bytes = n_elements // block * type_size
    if offset % header.alignment:
        raise cur.refuse(what, f"has data offset {offset}, not a multiple of the alignment {header.alignment}")
    end = header.data_offset + offset + n_bytes
    if end > header.size:
        raise cur.refuse(what, f"({ggml_type.name}, dimensions {list(dims)}) needs {n_bytes} bytes at offset "
                               f"{header.data_offset + offset}, past the end of the file ({header.size} bytes); the "
                               "file is truncated or corrupt")
    return TensorInfo(name, ggml_type, dims, offset, n_bytes)
