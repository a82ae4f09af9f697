"""`up --api-key` end to end: the official openai client with the right key gets a completion, a
wrong key gets 401, and the key never shows on a child's command line (up passes it by environment)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from e2e_stack import running_stack

KEY = "sk-e2e-secret-key"


def test_up_with_an_api_key(e2e_model, tmp_path):
    with running_stack(e2e_model, tmp_path, api_key=KEY) as stack:
        with openai.OpenAI(base_url=stack.api_url, api_key=KEY, max_retries=0, timeout=120) as client:
            r = client.completions.create(model=stack.model, prompt="Hello", max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 4
        with openai.OpenAI(base_url=stack.api_url, api_key="sk-wrong", max_retries=0, timeout=30) as client:
            with pytest.raises(openai.AuthenticationError) as e:
                client.models.list()
            assert e.value.code == "invalid_api_key"
            # /tokenize and /detokenize run the model's tokenizer: keyed like /v1; /version stays open
            for path, body in (("/../tokenize", {"prompt": "hi"}), ("/../detokenize", {"tokens": [1]})):
                with pytest.raises(openai.AuthenticationError):
                    client.post(path, body=body, cast_to=object)
            assert client.get("/../version", cast_to=object)["version"]
        with openai.OpenAI(base_url=stack.api_url, api_key=KEY, max_retries=0, timeout=30) as client:
            assert client.post("/../tokenize", body={"prompt": "hi"}, cast_to=object)["count"] >= 1
        for proc in stack.stack.procs.values():
            assert KEY.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        gateway = stack.stack.procs["gateway"].pid
        assert f"PHASESERVE_API_KEY={KEY}".encode() in Path(f"/proc/{gateway}/environ").read_bytes()
