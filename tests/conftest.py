"""Shared fixtures: a private Redis per test, and whole stacks over real sockets (see tests/e2e_stack.py)."""

from __future__ import annotations

import os
import tempfile

# Before anything imports triton (torch._dynamo and transformers do): triton's own
# standard library is @jit-decorated at import, interpreted only if this is set,
# and tests/test_triton_kernels.py runs the kernels on CPU under the interpreter.
os.environ["TRITON_INTERPRET"] = "1"
# Tiny test models: one intra-op thread is fastest, and on a busy machine a second OpenMP thread makes
# every parallel op wait for a descheduled peer.
# Set before torch loads, so spawned worker processes inherit it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests never read or fill the user's model cache (a test that needs the cache sets its own).
os.environ.setdefault("PHASESERVE_CACHE_DIR", tempfile.mkdtemp(prefix="phaseserve-test-cache-"))

import pytest  # noqa: E402

from phaseserve.redis_server import EmbeddedRedis
from e2e_stack import e2e_model_dir, running_stack


@pytest.fixture
def redis_server():
    """A fresh embedded redis-server on a free port; yields its URL."""
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory):
    return e2e_model_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def stack(e2e_model, tmp_path_factory):
    """The whole stack (embedded Redis + scheduler + worker + gateway as subprocesses) on free ports."""
    with running_stack(e2e_model, tmp_path_factory.mktemp("stack-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    """The official openai client on `stack`."""
    import openai

    with openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(stack):
    """The tokenizer of `stack`'s model."""
    from phaseserve.models.tokenizer import Tokenizer

    return Tokenizer.from_folder(str(stack.model_dir))


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """The dispatch (kernels/__init__.py) decides every op family afresh, natively where it may: its choices
    are cached per process, and an earlier test may have left them (or its native switch) set otherwise."""
    from phaseserve.kernels import CHOICES, native

    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    CHOICES.reset()
    yield CHOICES
    CHOICES.reset()  # what the test pinned or decided under its own switches goes with it
