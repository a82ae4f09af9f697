"""What more than one service reads from a Hugging Face model folder without loading the model."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object file; {} when the file is missing, ValueError naming it when it is not JSON."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def token_ids(value: Any) -> list[int]:
    """A config's token-id field (an int, a list of ints, or absent) as a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def config_eos_token_ids(model_dir: str | os.PathLike) -> frozenset[int]:
    """The end-of-sequence ids of config.json and generation_config.json together."""
    ids = token_ids(read_json(os.path.join(model_dir, "config.json")).get("eos_token_id"))
    ids += token_ids(read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id"))
    return frozenset(ids)
