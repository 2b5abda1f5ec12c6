"""A small checker of a value against the snapshot's TypedDicts (pymtrace.sources.snapshot),
read through typing.get_type_hints: required and optional keys, no undeclared key, and the
types inside (TypedDict, Dict, List, Optional/Union, Any, int, float, str, bool)."""

import typing

from pymtrace.sources import snapshot


def _is_typeddict(tp):
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def problems(value, tp=snapshot.Snapshot, path="snapshot", json_keys=False):
    """[one line per way VALUE does not fit TP]; JSON_KEYS: VALUE went through JSON, so int
    dict keys arrive as strings of digits."""
    if tp is typing.Any:
        return []
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        alternatives = [problems(value, t, path, json_keys) for t in typing.get_args(tp)]
        return [] if any(not a for a in alternatives) else [f"{path}: {value!r} fits none of {tp}"]
    if _is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{path}: not a dict ({tp.__name__})"]
        hints = typing.get_type_hints(tp)
        out = [f"{path}: missing {k!r} ({tp.__name__})" for k in sorted(tp.__required_keys__ - set(value))]
        for key, v in value.items():
            if key not in hints:
                out.append(f"{path}: key {key!r} not in {tp.__name__}")
            else:
                out += problems(v, hints[key], f"{path}.{key}", json_keys)
        return out
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            return [f"{path}: not a dict"]
        key_tp, value_tp = typing.get_args(tp)
        out = []
        for k, v in value.items():
            if key_tp is int and json_keys and isinstance(k, str) and k.lstrip("-").isdigit():
                k = int(k)
            out += problems(k, key_tp, f"{path}[{k!r}] key", json_keys)
            out += problems(v, value_tp, f"{path}[{k!r}]", json_keys)
        return out
    if origin in (list, typing.List):
        if not isinstance(value, list):
            return [f"{path}: not a list"]
        (item_tp,) = typing.get_args(tp)
        return [p for i, v in enumerate(value) for p in problems(v, item_tp, f"{path}[{i}]", json_keys)]
    if tp is type(None):
        return [] if value is None else [f"{path}: {value!r} is not None"]
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    return [] if ok else [f"{path}: {value!r} is not {tp.__name__}"]
