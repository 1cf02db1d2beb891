"""Shared fixtures: engines on the real default model, and the transformers reference."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its thread pool

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from agentx import CacheConfig, Engine, EngineConfig, SchedulerConfig, env  # noqa: E402
from agentx.engine.models.loader import default_model_path  # noqa: E402

CHAT = [{"role": "user", "content": "What is 2+2? Answer in one short sentence."}]


@pytest.fixture(scope="session")
def default_engine():
    """One engine on the default model (default config), shared by tests that only read from it."""
    engine = Engine(EngineConfig(cache=CacheConfig(kv_cache_bytes=256 << 20)))
    yield engine
    engine.close()


def _engine_factory():
    engines = []

    def build(cache=None, scheduler=None, **kw):
        engine = Engine(
            EngineConfig(
                cache=cache or CacheConfig(kv_cache_bytes=256 << 20),
                scheduler=scheduler or SchedulerConfig(),
                **kw,
            )
        )
        engines.append(engine)
        return engine

    return build, engines


@pytest.fixture
def make_engine():
    """Build engines with custom configs; every one is closed after the test."""
    build, engines = _engine_factory()
    yield build
    for engine in engines:
        engine.close()


@pytest.fixture(scope="module")
def make_engine_module():
    """Like make_engine, for engines shared by a module's tests."""
    build, engines = _engine_factory()
    yield build
    for engine in engines:
        engine.close()


@pytest.fixture(scope="session")
def greedy_prompts(default_engine):
    """Five prompts as token ids, one of them chat-templated."""
    tok = default_engine.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n",
        "Once upon a time, in a small village by the sea,",
        "List three primary colors:\n1.",
    ]
    prompts = [tok.encode(t) for t in texts]
    prompts.append(tok.encode(tok.apply_chat_template(CHAT)))
    return prompts


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """A private AGENTX_CACHE_DIR for one module (built tokenizers land there). Its kernels/
    is the real cache's, so the compiled CPU kernels are not built again for it."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("agentx-cache")
        shared_kernels = env.cache_dir() / "kernels"
        shared_kernels.mkdir(parents=True, exist_ok=True)
        (path / "kernels").symlink_to(shared_kernels, target_is_directory=True)
        patch.setenv("AGENTX_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def model_path() -> Path:
    # `make test` installs the default model; without it these tests must fail, not skip
    return default_model_path()


VLLM_MISSING = (
    "vllm is not installed in this venv: `make test` runs the vLLM backend's tests in a venv of "
    "their own (.venv-vllm, see the Makefile)"
)


@pytest.fixture(scope="session")
def vllm_engine():
    """One vLLM backend on the default model, shared by every test that runs on vLLM. One
    running sequence at a time, so priorities order the queue and cached counts are exact."""
    pytest.importorskip("vllm", reason=VLLM_MISSING)
    from agentx.engine.vllm import VLLMConfig, VLLMEngine

    engine = VLLMEngine(VLLMConfig(max_num_seqs=1, max_model_len=4096))
    yield engine
    engine.close()


@pytest.fixture(params=["agentx", pytest.param("vllm", marks=pytest.mark.vllm)])
def session_engine(request):
    """The same Session test on both backends: agentx's engine and the vLLM backend."""
    name = "default_engine" if request.param == "agentx" else "vllm_engine"
    return request.getfixturevalue(name)
