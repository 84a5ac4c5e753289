"""The value codec of the code sandbox: Python values as type-tagged JSON, both ways across the process boundary.

JSON alone cannot tell a tuple from a list or carry sets, bytes, big ints or complex numbers, and the parent must
never unpickle anything the sandboxed child produced; so every JSON object in an encoded value is a tag. A value
the codec cannot carry (a regex match, a generator, a custom object) becomes `Opaque`, equal to nothing, so an
always-equal object cannot pass an `==` assertion.

Stdlib-only on purpose (numpy is imported only to decode numpy values): the sandboxed child
(`sandbox_child.py`) loads this file by path, outside the repository's packages.
"""

from __future__ import annotations

from typing import Any


class Opaque:
    """Stand-in for a value the codec cannot carry (a regex match, a generator, a custom object).

    It is not None and equals nothing but itself, which is exactly what EvalPlus's not-None oracle
    and plain `==` comparisons need from such values.
    """

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"Opaque({self.type_name})"


_INT_JSON_MAX = 1 << 62  # larger ints travel as hex: str(int) is capped at 4300 digits in 3.11+


class ValueTooLarge(ValueError):
    """The value has more elements than the encoding budget allows."""


def encode_value(x: Any, max_items: int | None = None) -> Any:
    """Encode a Python value as JSON-able data; every JSON object in the result is a tag.

    With `max_items`, raise ValueTooLarge once more than that many values have been visited, so a
    gigantic output costs a bounded amount of work.
    """
    budget = [max_items if max_items is not None else -1]
    return _encode(x, budget)


def _encode(x: Any, budget: list[int]) -> Any:
    if budget[0] >= 0:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueTooLarge()
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if isinstance(x, int) and t.__module__ != "numpy":
        x = int(x)
        return x if -_INT_JSON_MAX < x < _INT_JSON_MAX else {"$i": hex(x)}
    if isinstance(x, float) and t.__module__ != "numpy":
        return float(x)  # json writes NaN/Infinity and reads them back
    if isinstance(x, str):
        return str(x)
    if isinstance(x, complex) and t.__module__ != "numpy":
        return {"$c": [x.real, x.imag]}
    if isinstance(x, list):
        return [_encode(v, budget) for v in x]
    if isinstance(x, tuple):
        return {"$t": [_encode(v, budget) for v in x]}
    if isinstance(x, frozenset):
        return {"$fs": [_encode(v, budget) for v in x]}
    if isinstance(x, set):
        return {"$s": [_encode(v, budget) for v in x]}
    if isinstance(x, dict):
        return {"$d": [[_encode(k, budget), _encode(v, budget)] for k, v in x.items()]}
    if isinstance(x, (bytes, bytearray)):
        return {"$b": bytes(x).hex()}
    if t.__module__ == "numpy" and hasattr(x, "dtype") and x.dtype.kind in "biufc":
        if hasattr(x, "shape") and x.shape != ():
            return {"$nd": [x.dtype.str, list(x.shape), _encode(x.tolist(), budget)]}
        return {"$np": [x.dtype.str, _encode(x.item(), budget)]}
    return {"$o": t.__name__}


def decode_value(obj: Any) -> Any:
    """Inverse of `encode_value` (numpy values need numpy in the decoding process)."""
    if isinstance(obj, list):
        return [decode_value(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    (tag, payload), = obj.items()
    if tag == "$t":
        return tuple(decode_value(v) for v in payload)
    if tag == "$s":
        return {decode_value(v) for v in payload}
    if tag == "$fs":
        return frozenset(decode_value(v) for v in payload)
    if tag == "$d":
        return {decode_value(k): decode_value(v) for k, v in payload}
    if tag == "$i":
        return int(payload, 16)
    if tag == "$c":
        return complex(payload[0], payload[1])
    if tag == "$b":
        return bytes.fromhex(payload)
    if tag == "$o":
        return Opaque(payload)
    import numpy as np

    if tag == "$np":
        return np.dtype(payload[0]).type(decode_value(payload[1]))
    if tag == "$nd":
        return np.array(decode_value(payload[2]), dtype=np.dtype(payload[0])).reshape(payload[1])
    raise ValueError(f"unknown value tag {tag!r}")
