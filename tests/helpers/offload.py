"""Offload test doubles: a transfer worker that runs jobs only when told, and device pages in a
tensor (the model runner's page gather/scatter, no model)."""

from collections import deque

import torch

from agentx.engine.offload.transfer import TransferEvent, TransferJob


class StepWorker:
    """The transfer worker's interface, run on the caller's thread: a job lands only when the
    test calls ``run`` (FIFO, as the real worker), so a test decides what is in flight when."""

    def __init__(self) -> None:
        self.queue: deque[TransferJob] = deque()
        self.events: list[TransferEvent] = []

    @property
    def num_pending(self) -> int:
        return len(self.queue)

    def submit(self, job: TransferJob) -> None:
        self.queue.append(job)

    def run(self, num_jobs: int | None = None) -> int:
        """Run the next ``num_jobs`` queued jobs (None: all); returns how many ran."""
        num = len(self.queue) if num_jobs is None else min(num_jobs, len(self.queue))
        for _ in range(num):
            job = self.queue.popleft()
            try:
                event = job.run()
            except Exception as exc:  # noqa: BLE001  (as the real worker: a failed transfer)
                event = job.fail(exc)
            self.events.append(event)
        return num

    def take_events(self) -> list[TransferEvent]:
        out, self.events = self.events, []
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        self.run()
        return True

    def close(self, timeout: float | None = None) -> None:
        self.run()


class DevicePages:
    """Device KV pages, one ``page_bytes`` row per block id (the runner's ``PageIO``)."""

    def __init__(self, num_blocks: int, page_bytes: int = 16) -> None:
        self.page_bytes = page_bytes
        self.pages = torch.zeros((num_blocks, page_bytes), dtype=torch.uint8)
        self.num_scattered = 0

    def gather_pages(self, block_ids: list[int]) -> torch.Tensor:
        return self.pages[block_ids].clone()

    def scatter_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        self.pages[block_ids] = pages
        self.num_scattered += len(block_ids)

    def write(self, block_id: int, data: bytes) -> None:
        """What a forward writes into a block (the test's stand-in for its KV)."""
        self.pages[block_id] = torch.frombuffer(
            bytearray(data[: self.page_bytes]), dtype=torch.uint8
        )

    def read(self, block_id: int) -> bytes:
        return bytes(self.pages[block_id].tolist())
