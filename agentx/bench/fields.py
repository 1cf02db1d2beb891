"""Typed field access for trace records: every failure names the file, the record and the field.

A :class:`Where` is the location of one JSON object: the file, the record in it (``line 4``,
``session 2``, or nothing for a one-record file) and the path inside the record
(``requests[2].requests[0]``). Its getters return the typed value or raise :class:`TraceError`
with that location: ``trace.jsonl: line 4: requests[2]: field 'in': missing``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from agentx.errors import TraceError

_MISSING = object()
# A trace counts tokens and seconds: past these a value is a typo (or 1e300), and replaying it
# would build prompts (or waits) no machine holds.
MAX_INT = 1 << 31
MAX_FLOAT = 1e12


@dataclass(frozen=True, slots=True)
class Where:
    file: str
    record: str  # "line 4", "session 0", or "" when the file holds one record
    obj: dict[str, Any]
    path: str = ""  # "requests[2].requests[0]"; "" for the record itself

    @classmethod
    def of(cls, file: str, record: str, obj: Any, path: str = "") -> Where:
        where = cls(file, record, {}, path)
        if not isinstance(obj, dict):
            raise TraceError(f"{where.location}: expected a JSON object, got {_kind(obj)}")
        return cls(file, record, obj, path)

    @property
    def location(self) -> str:
        return ": ".join(part for part in (self.file, self.record, self.path) if part)

    def child(self, name: str, obj: Any) -> Where:
        return Where.of(self.file, self.record, obj, f"{self.path}.{name}" if self.path else name)

    def fail(self, key: str, message: str) -> TraceError:
        return TraceError(f"{self.location}: field {key!r}: {message}")

    def _get(self, key: str, default: Any) -> Any:
        value = self.obj.get(key, default)
        if value is _MISSING:
            raise self.fail(key, "missing")
        return value

    def get_int(
        self, key: str, default: Any = _MISSING, *, minimum: int = 0, maximum: int = MAX_INT
    ) -> int:
        value = self._get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {_kind(value)}")
        if value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, got {value}")
        if value > maximum:
            raise self.fail(key, f"expected an integer <= {maximum}, got {value:.3g}")
        return value

    def get_float(
        self, key: str, default: Any = _MISSING, *, optional: bool = False
    ) -> float | None:
        value = self._get(key, default)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"expected a number, got {_kind(value)}")
        if not math.isfinite(value) or value < 0 or value > MAX_FLOAT:
            raise self.fail(key, f"expected a number in [0, {MAX_FLOAT:g}], got {value:.3g}")
        return float(value)

    def get_str(self, key: str, default: Any = _MISSING, *, optional: bool = False) -> str | None:
        value = self._get(key, default)
        if value is None and optional:
            return None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # numeric ids are common
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {_kind(value)}")
        return value

    def get_ints(self, key: str, default: Any = _MISSING) -> tuple[int, ...]:
        value = self._get(key, default)
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list of integers, got {_kind(value)}")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                raise self.fail(key, f"item {i}: expected an integer, got {_kind(item)}")
        return tuple(value)

    def get_strs(self, key: str) -> tuple[str, ...]:
        value = self._get(key, [])
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(key, f"expected a list of strings, got {_kind(value)}")
        return tuple(value)

    def get_list(self, key: str) -> list[Any]:
        value = self._get(key, _MISSING)
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {_kind(value)}")
        return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
