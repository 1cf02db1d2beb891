"""What a replay measured: one record per request, one result per run. Times are seconds since
the run started (``time.perf_counter`` at the driver, on receipt of each event)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from agentx.bench.adapter import EngineInfo


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    session_id: str  # the session tree (root agent)
    agent_id: str  # the agent that sent it: the session id, or "<session>/<agent>"
    num_prompt_tokens: int
    num_output_tokens: int  # tokens received
    num_cached_tokens: int | None  # reported by the engine
    theoretical_hit_tokens: int
    submit_time: float
    token_times: tuple[float, ...]  # receipt time of every output token (a batch shares one)
    end_time: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.submit_time if self.token_times else None

    @property
    def interactivity(self) -> float | None:
        """Output tokens per second after the first token: (n - 1) / (t_last - t_first)."""
        times = self.token_times
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])

    def to_json(self) -> dict:
        out = asdict(self)
        out["token_times"] = [round(t, 6) for t in self.token_times]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> RequestRecord:
        return cls(**{**obj, "token_times": tuple(obj["token_times"])})


@dataclass(frozen=True, slots=True)
class RunResult:
    engine: EngineInfo
    concurrency: int
    wall_time: float  # first submit to last event
    records: tuple[RequestRecord, ...]
    interrupted: bool = False
    num_devices: int = 1
    num_requests_planned: int = 0
    engine_stats: dict | None = None  # the engine's own counters at the end, when it has them

    def to_json(self, with_records: bool = True) -> dict:
        out = {
            "engine": asdict(self.engine),
            "concurrency": self.concurrency,
            "wall_time": self.wall_time,
            "interrupted": self.interrupted,
            "num_devices": self.num_devices,
            "num_requests_planned": self.num_requests_planned,
            "engine_stats": self.engine_stats,
        }
        if with_records:
            out["records"] = [r.to_json() for r in self.records]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> RunResult:
        return cls(
            engine=EngineInfo(**obj["engine"]),
            concurrency=obj["concurrency"],
            wall_time=obj["wall_time"],
            records=tuple(RequestRecord.from_json(r) for r in obj.get("records", [])),
            interrupted=obj.get("interrupted", False),
            num_devices=obj.get("num_devices", 1),
            num_requests_planned=obj.get("num_requests_planned", 0),
            engine_stats=obj.get("engine_stats"),
        )
