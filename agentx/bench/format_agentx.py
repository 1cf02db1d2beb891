"""The SemiAnalysis AgentX ("weka") trace format: read and write.

One session is one JSON object::

    {"id": str, "block_size": 64, "hash_id_scope": "local" | "global",
     "system_tokens": int, "tool_tokens": int, "requests": [entry, ...]}

    request entry:  {"t": s, "type": "s" | "n", "in": int, "out": int, "hash_ids": [int, ...],
                     "input_types": [str], "output_types": [str], "stop": str,
                     "api_time": s, "think_time": s}
    subagent entry: {"t": s, "type": "subagent", "agent_id": str, "subagent_type": str,
                     "duration_ms": number | null, "requests": [entry, ...]}

A file holds one session (``.json``), a list of sessions (``.json``) or one session per line
(``.jsonl``). ``hash_id_scope: "local"`` (the default) means ids are private to their session
(the same number in two sessions is different text); ``"global"`` shares them across the file.
Unknown fields are ignored; a missing ``think_time`` reads as 0. A trace written by ``agentx
bench synth`` carries its :class:`~agentx.bench.synth.SynthConfig` as ``"synth"`` in every session
(read back into ``Trace.meta["synth"]``: such a trace replays closed loop by default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentx.bench.fields import Where
from agentx.bench.trace import SessionTrace, Step, Subagent, Trace, TraceRequest
from agentx.errors import TraceError

REQUEST_TYPES = ("s", "n")


def load_agentx(path: str | Path) -> Trace:
    path = Path(path)
    objects = list(_read_objects(path))
    if not objects:
        raise TraceError(f"{path}: no sessions in the file")
    sessions, block_sizes = [], set()
    for record, obj in objects:
        where = Where.of(str(path), record, obj)
        block_sizes.add(where.get_int("block_size", 64, minimum=1))
        sessions.append(_session(where, len(sessions)))
    if len(block_sizes) != 1:
        raise TraceError(f"{path}: sessions disagree on block_size: {sorted(block_sizes)}")
    ids = [s.session_id for s in sessions]
    if len(set(ids)) != len(ids):
        raise TraceError(f"{path}: duplicate session ids")
    trace_id = sessions[0].session_id if len(sessions) == 1 else path.stem
    synth = [obj.get("synth") for _, obj in objects]
    meta = {"synth": synth[0]} if all(isinstance(x, dict) for x in synth) else {}
    return Trace(trace_id, block_sizes.pop(), tuple(sessions), "agentx", meta)


def _read_objects(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    if path.suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                yield f"line {i}", _parse(path, f"line {i}", line)
        return
    data = _parse(path, "file", text)
    if isinstance(data, list):
        for i, obj in enumerate(data):
            yield f"session {i}", obj
    else:
        yield "", data


def _parse(path: Path, record: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: {record}: invalid JSON: {exc}") from exc
    except RecursionError:
        raise TraceError(f"{path}: {record}: invalid JSON: nested too deeply") from None


def _session(where: Where, index: int) -> SessionTrace:
    session_id = where.get_str("id", f"session-{index}")
    scope = where.get_str("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise where.fail("hash_id_scope", f"expected 'local' or 'global', got {scope!r}")
    return SessionTrace(
        session_id=session_id,
        steps=_steps(where, where.get_list("requests")),
        scope=session_id if scope == "local" else "",
        system_tokens=where.get_int("system_tokens", 0),
        tool_tokens=where.get_int("tool_tokens", 0),
    )


def _steps(where: Where, entries: list[Any]) -> tuple[Step, ...]:
    steps: list[Step] = []
    for i, obj in enumerate(entries):
        entry = where.child(f"requests[{i}]", obj)
        kind = entry.get_str("type")
        if kind == "subagent":
            steps.append(_subagent(entry))
        elif kind in REQUEST_TYPES:
            steps.append(_request(entry, kind))
        else:
            raise entry.fail("type", f"expected 's', 'n' or 'subagent', got {kind!r}")
    return tuple(steps)


def _request(entry: Where, kind: str) -> TraceRequest:
    return TraceRequest(
        t=entry.get_float("t"),
        num_input_tokens=entry.get_int("in"),
        num_output_tokens=entry.get_int("out"),
        hash_ids=entry.get_ints("hash_ids"),
        think_time=entry.get_float("think_time", 0.0, optional=True) or 0.0,
        kind=kind,
        api_time=entry.get_float("api_time", None, optional=True),
        stop=entry.get_str("stop", None, optional=True),
        input_types=entry.get_strs("input_types"),
        output_types=entry.get_strs("output_types"),
    )


def _subagent(entry: Where) -> Subagent:
    return Subagent(
        t=entry.get_float("t"),
        agent_id=entry.get_str("agent_id"),
        steps=_steps(entry, entry.get_list("requests")),
        subagent_type=entry.get_str("subagent_type", "", optional=True) or "",
        duration_ms=entry.get_float("duration_ms", None, optional=True),
    )


# ---- writing ---------------------------------------------------------------------------------


def dump_agentx(trace: Trace, path: str | Path) -> None:
    """Write one session per line (``.jsonl``) or a list of sessions (``.json``)."""
    path = Path(path)
    objects = [session_to_json(s, trace.block_size) for s in trace.sessions]
    if "synth" in trace.meta:
        objects = [{**o, "synth": trace.meta["synth"]} for o in objects]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(o, separators=(",", ":")) + "\n" for o in objects))
    else:
        path.write_text(json.dumps(objects if len(objects) != 1 else objects[0]))


def session_to_json(session: SessionTrace, block_size: int) -> dict[str, Any]:
    return {
        "id": session.session_id,
        "block_size": block_size,
        "hash_id_scope": "global" if session.scope == "" else "local",
        "system_tokens": session.system_tokens,
        "tool_tokens": session.tool_tokens,
        "requests": [_step_to_json(s) for s in session.steps],
    }


def _step_to_json(step: Step) -> dict[str, Any]:
    if isinstance(step, Subagent):
        return {
            "t": step.t,
            "type": "subagent",
            "agent_id": step.agent_id,
            "subagent_type": step.subagent_type,
            "duration_ms": step.duration_ms,
            "requests": [_step_to_json(s) for s in step.steps],
        }
    return {
        "t": step.t,
        "type": step.kind,
        "in": step.num_input_tokens,
        "out": step.num_output_tokens,
        "hash_ids": list(step.hash_ids),
        "input_types": list(step.input_types),
        "output_types": list(step.output_types),
        "stop": step.stop,
        "api_time": step.api_time,
        "think_time": step.think_time,
    }
