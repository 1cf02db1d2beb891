"""Start and stop a ``mooncake_master`` for the Mooncake tier (or find out we must not).

agentx starts a master only on loopback: ``--rpc_address=127.0.0.1``, metrics on 127.0.0.1, free
ports picked here. Mooncake clients (and its HTTP metadata server) still bind every interface
whatever the flags say, so anything that starts Mooncake must run in a private network namespace
that has only loopback (``unshare -n sh -c 'ip link set lo up && ...'``); the launcher refuses
otherwise unless told the network is intended. It stops only the process it started, by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from agentx.errors import OffloadError

__all__ = [
    "MooncakeMaster",
    "find_master_binary",
    "free_port",
    "has_private_network",
    "port_is_open",
]


def has_private_network() -> bool:
    """True when this process's network namespace has no interface but loopback."""
    return all(name == "lo" for _, name in socket.if_nameindex())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_open(host: str, port: int, timeout: float = 0.3) -> bool:
    """Can a TCP connection be opened within ``timeout`` seconds? (A cheap liveness probe.)"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def find_master_binary() -> str:
    """The ``mooncake_master`` of the installed ``mooncake-transfer-engine`` package."""
    candidates = [shutil.which("mooncake_master"), Path(sys.prefix) / "bin" / "mooncake_master"]
    try:
        import mooncake

        candidates.append(Path(mooncake.__file__).parent / "mooncake_master")
    except ImportError:
        pass
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return str(path)
    raise OffloadError(
        "mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
        "(and apt-get install libibverbs1)"
    )


class MooncakeMaster:
    """One ``mooncake_master`` process on loopback; ``start``/``stop``/``kill``, restartable on
    the same ports (a restarted master has lost its objects: the store is in memory)."""

    def __init__(
        self,
        rpc_port: int | None = None,
        extra_args: tuple[str, ...] = (),
        log_path: str | os.PathLike | None = None,
        allow_network: bool = False,
    ) -> None:
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = free_port()
        self.extra_args = extra_args
        self.log_path = log_path
        self.allow_network = allow_network
        self._proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> MooncakeMaster:
        """Start the master and wait until its RPC port accepts connections."""
        if self.running:
            return self
        if not self.allow_network and not has_private_network():
            raise OffloadError(
                "refusing to start Mooncake outside a private network namespace (its clients "
                "bind every interface); run under: unshare -n sh -c 'ip link set lo up && ...'"
            )
        args = [
            find_master_binary(),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            *self.extra_args,
        ]
        log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115  (owned by the process)
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise OffloadError(f"mooncake_master exited with {self._proc.returncode}")
            if port_is_open("127.0.0.1", self.rpc_port, timeout=0.2):
                return self
            time.sleep(0.05)
        self.kill()
        raise OffloadError(f"mooncake_master not ready on {self.address} after {timeout}s")

    def stop(self, timeout: float = 1.0) -> None:
        """SIGTERM the process this object started, SIGKILL if it lingers (it holds only a
        cache, nothing to flush)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL it (a crash, for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
