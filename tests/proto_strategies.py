"""Hypothesis strategies for any protobuf message, read off its descriptor (splitspec/v1/*_pb2.py):
every field may be absent or set, numbers lean to their type's edges (0, -1, the largest and
smallest values, NaN and infinities for floats), strings and bytes may be empty or odd, enums
may hold values the schema never named, and messages nest a few levels deep."""
from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message
from hypothesis import strategies as st

MAX_DEPTH = 3
MAX_REPEATED = 4


def _ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    edges = sorted({low, high, 0, 1, min(high, 2), max(low, -1), min(high, 1 << 20)})
    return st.one_of(st.sampled_from(edges), st.integers(min_value=max(low, -1000), max_value=min(high, 1000)),
                     st.integers(min_value=low, max_value=high))


SCALARS = {
    F.TYPE_INT32: _ints(32, True), F.TYPE_SINT32: _ints(32, True), F.TYPE_SFIXED32: _ints(32, True),
    F.TYPE_INT64: _ints(64, True), F.TYPE_SINT64: _ints(64, True), F.TYPE_SFIXED64: _ints(64, True),
    F.TYPE_UINT32: _ints(32, False), F.TYPE_FIXED32: _ints(32, False),
    F.TYPE_UINT64: _ints(64, False), F.TYPE_FIXED64: _ints(64, False),
    F.TYPE_FLOAT: st.floats(width=32), F.TYPE_DOUBLE: st.floats(),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: st.one_of(st.just(""), st.sampled_from(["none", "ngram", "dflash", "auto", "greedy", "sampled"]),
                             st.text(max_size=24)),
    F.TYPE_BYTES: st.binary(max_size=64),
}


def _value(field, depth: int) -> st.SearchStrategy:
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type._concrete_class, depth + 1)
    if field.type == F.TYPE_ENUM:
        named = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(named), st.integers(min_value=-3, max_value=100))
    return SCALARS[field.type]


def _is_map(field) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


@st.composite
def _message(draw, cls: type[Message], depth: int) -> Message:
    msg = cls()
    if depth > MAX_DEPTH:
        return msg
    for field in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if _is_map(field):
            key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_value(key_f, depth), _value(value_f, depth), max_size=MAX_REPEATED))
            target = getattr(msg, field.name)
            for k, v in entries.items():
                if value_f.type == F.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            values = draw(st.lists(_value(field, depth), max_size=MAX_REPEATED))
            target = getattr(msg, field.name)
            if field.type == F.TYPE_MESSAGE:
                for v in values:
                    target.add().CopyFrom(v)
            else:
                target.extend(values)
        elif field.type == F.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(draw(_value(field, depth)))
        else:
            setattr(msg, field.name, draw(_value(field, depth)))
    return msg


def messages(cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    return _message(cls, depth)
