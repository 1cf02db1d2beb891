"""The kernels' thread team (csrc/parallel.h): every index of a loop runs once whatever the split
and the thread count, a loop inside a loop runs inline, a chunk's error reaches the caller from a
worker thread, a second thread's loop while the team is busy falls back to OpenMP with the same
result, a forked child gets a team of its own, and a 2-thread decode runs its loops on the team
with the same greedy tokens as one thread."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from agentx import ConfigError, SamplingParams, env, kernels
from agentx.kernels import cpu

pytestmark = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)
NO_FAIL = -1


def _stats() -> dict[str, int]:
    runs, fallbacks, workers, sleeps = torch.ops.agentx.team_stats()
    return {"runs": runs, "fallbacks": fallbacks, "workers": workers, "sleeps": sleeps}


def _fill(n: int, grain: int, nested: bool = False, fail_at: int = NO_FAIL) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.long)
    torch.ops.agentx.team_fill(out, grain, nested, fail_at)
    return out


def _want(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.long)
    return i * i


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n,grain", [(1, 1), (2, 1), (3, 2), (7, 1), (64, 64), (65, 64), (1000, 3)])
def test_every_index_once_at_any_split(two_threads, n, grain):
    before = _stats()["runs"]
    assert torch.equal(_fill(n, grain), _want(n))
    # one chunk (n <= grain) runs inline; two or more go to the team
    assert _stats()["runs"] - before == (1 if n > grain else 0)
    torch.set_num_threads(1)
    assert torch.equal(_fill(n, grain), _want(n))
    assert _stats()["runs"] - before == (1 if n > grain else 0)  # one thread: inline


def test_a_loop_inside_a_loop_runs_inline(two_threads):
    before = _stats()
    assert torch.equal(_fill(100, 1, nested=True), _want(100))
    after = _stats()
    assert after["runs"] - before["runs"] == 1  # the outer loop only
    assert after["fallbacks"] == before["fallbacks"]


@pytest.mark.parametrize("fail_at", [0, 99])  # the caller's chunk, the worker's chunk
def test_a_chunks_error_reaches_the_caller_and_the_team_goes_on(two_threads, fail_at):
    with pytest.raises(RuntimeError, match=r"team_fill: chunk \[\d+, \d+\) failed"):
        _fill(100, 1, fail_at=fail_at)
    assert torch.equal(_fill(100, 1), _want(100))  # the team is not stuck


def test_loops_of_changing_thread_counts_run_every_chunk_once():
    """A worker a loop does not need still answers it, so it never reads the next loop's
    fields half-written (a chunk run twice would show as 2 * i * i: ``+=``)."""
    before = torch.get_num_threads()
    try:
        for step in range(300):
            torch.set_num_threads((4, 2, 3, 2)[step % 4])
            assert torch.equal(_fill(257, 1), _want(257)), step
    finally:
        torch.set_num_threads(before)
    assert _stats()["workers"] >= 3


def test_loops_from_two_threads_at_once_all_complete(two_threads):
    results: list[bool] = []
    errors: list[BaseException] = []

    def worker():
        torch.set_num_threads(2)  # per thread (OpenMP's ICV)
        try:
            for _ in range(300):
                results.append(torch.equal(_fill(4096, 16), _want(4096)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    before = _stats()
    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [True] * 900
    after = _stats()
    # each loop ran once, on the team or (the team busy with another thread's) on OpenMP
    assert (after["runs"] - before["runs"]) + (after["fallbacks"] - before["fallbacks"]) == 900
    assert after["workers"] >= 1


def test_a_forked_child_gets_a_team_of_its_own():
    code = (
        "import os, torch\n"
        "from agentx.kernels import cpu\n"
        "assert cpu.available()\n"
        "torch.set_num_threads(2)\n"
        "def fill():\n"
        "    out = torch.zeros(1000, dtype=torch.long)\n"
        "    torch.ops.agentx.team_fill(out, 1, False, -1)\n"
        "    return bool(torch.equal(out, torch.arange(1000) ** 2))\n"
        "assert fill()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = fill() and torch.ops.agentx.team_stats()[0] == 1\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "child 0"  # it ran its loop on a new team of one loop


def test_a_two_thread_decode_runs_on_the_team_with_one_threads_tokens(make_engine, greedy_prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one = make_engine(num_threads=1)
    want = [g.token_ids for g in one.generate(greedy_prompts, greedy)]
    two = make_engine(num_threads=2)
    before = _stats()["runs"]
    got = [g.token_ids for g in two.generate(greedy_prompts, greedy)]
    assert got == want
    if kernels.cpu_kernels_enabled():  # the team runs the compiled kernels' loops (not ref's ops)
        assert two.core.runner.step_threads == 2  # decode steps too (small_step_tokens=0)
        assert _stats()["runs"] - before > 100  # its projections' and attention's loops
    two.check_integrity()


def test_spin_us_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("AGENTX_SPIN_US", raising=False)
    assert env.spin_us() == 2000
    monkeypatch.setenv("AGENTX_SPIN_US", "0")
    assert env.spin_us() == 0
    for bad in ("-1", "1.5", "fast"):
        monkeypatch.setenv("AGENTX_SPIN_US", bad)
        with pytest.raises(ConfigError, match="AGENTX_SPIN_US"):
            env.spin_us()


def test_workers_sleep_after_their_spin_and_wake_for_the_next_loop(two_threads):
    try:
        torch.ops.agentx.team_spin_us(0)  # sleep as soon as a loop ends
        assert torch.equal(_fill(100, 1), _want(100))
        before = _stats()["sleeps"]
        for _ in range(3):
            time.sleep(0.01)
            assert torch.equal(_fill(100, 1), _want(100))  # woken, not lost
        assert _stats()["sleeps"] - before >= 3
        torch.ops.agentx.team_spin_us(1_000_000)  # a second: a worker does not sleep between
        _fill(100, 1)  # wakes the sleeping worker; from here on it spins for up to a second
        time.sleep(0.01)
        before = _stats()["sleeps"]
        for _ in range(50):
            _fill(100, 1)
        assert _stats()["sleeps"] == before
    finally:
        torch.ops.agentx.team_spin_us(env.spin_us())
