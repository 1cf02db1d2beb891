"""benchmarks/single_stream.py --paired: every engine loaded at once, each round's fresh 2K prompt
to each engine in turn (the order rotating), each round's TTFT over the first engine's."""

import asyncio

import pytest

from agentx.bench.adapter import Done, EngineInfo, Tokens
from tests.helpers.scripts import load_script


def _script(monkeypatch):
    return load_script(monkeypatch, "single_stream")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TimedEngine:
    """A prompt's first token after `costs[i]` seconds of a clock that only it advances."""

    def __init__(self, name, clock, costs, log) -> None:
        self.name, self.clock, self.costs, self.log = name, clock, list(costs), log
        self.closed = False

    async def start(self):
        return EngineInfo(self.name, "0")

    async def generate(self, request):
        self.log.append((self.name, request.request_id, tuple(request.prompt[:3])))
        if len(request.prompt) == 2048 and not request.request_id.startswith("warm"):
            self.clock.now += self.costs.pop(0)
        yield Tokens(1)
        yield Done(1, 0)

    async def end_session(self, session_id):
        pass

    async def close(self):
        self.closed = True


def test_paired_rounds_alternate_and_ratios_are_per_round(monkeypatch):
    script = _script(monkeypatch)
    clock, log = Clock(), []
    monkeypatch.setattr(script.time, "perf_counter", clock)
    engines = {
        "a": TimedEngine("a", clock, [1.0, 2.0, 1.5, 1.0], log),
        "b": TimedEngine("b", clock, [2.0, 3.0, 3.0, 2.5], log),
    }

    async def start(spec, settings, omp_wait):
        assert omp_wait == {"a": "spin", "b": "passive"}[spec]
        return engines[spec], await engines[spec].start()

    monkeypatch.setattr(script, "_start", start)
    settings = {"a": script.Setting(2, "spin"), "b": script.Setting(2, "passive")}
    out = asyncio.run(script._paired(["a", "b"], settings, None, True, 4))

    assert out["ttft_s"] == {"a": [1.0, 2.0, 1.5, 1.0], "b": [2.0, 3.0, 3.0, 2.5]}
    assert out["ratio_to"] == "a"
    assert out["ratio"]["b"] == {"median": 2.0, "min": 1.5, "max": 2.5}
    assert out["ratio"]["a"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert out["median_ttft_s"] == {"a": 1.25, "b": 2.75}
    assert all(e.closed for e in engines.values())
    timed = [(name, rid, head) for name, rid, head in log if not rid.startswith("warm")]
    # round i: engine (i + j) % 2 goes j-th; both get the round's same fresh prompt
    assert [(name, rid) for name, rid, _ in timed] == [
        ("a", "paired0"), ("b", "paired0"), ("b", "paired1"), ("a", "paired1"),
        ("a", "paired2"), ("b", "paired2"), ("b", "paired3"), ("a", "paired3"),
    ]  # fmt: skip
    heads = [head for _, _, head in timed]
    assert heads[0] == heads[1] and heads[2] == heads[3] and heads[0] != heads[2]
    assert heads[0] == tuple(script._prompt("paired0", 2048)[:3])


def test_paired_table_and_flag(monkeypatch):
    script = _script(monkeypatch)
    assert script.parse_args(["--paired", "6"]).paired == 6
    assert script.parse_args([]).paired == 0
    with pytest.raises(SystemExit):  # argparse's error: a count of rounds, not a negative one
        script.parse_args(["--paired", "-2"])
    record = {
        "command": "python benchmarks/single_stream.py --paired 4",
        "date": "2026-12-06T21:00:00+00:00",
        "machine": {"cpu": "AMD EPYC", "cores": 2},
        "sweep": {},
        "results": {},
        "paired": {"rounds": 4, "ratio_to": "a", "median_ttft_s": {"a": 1.25, "b": 2.75},
                   "ratio": {"a": {"median": 1.0, "min": 1.0, "max": 1.0},
                             "b": {"median": 2.0, "min": 1.5, "max": 2.5}}},
    }  # fmt: skip
    lines = script.render(record).splitlines()
    assert lines[-2:] == ["| a | 1.25 (1638) | 1.00 (1.00 - 1.00) |",
                          "| b | 2.75 (745) | 2.00 (1.50 - 2.50) |"]  # fmt: skip
