"""The `logit_bias` request field in OpenAI's shape: {"<token id>": bias in [-100, 100]}.

The schema checks the values' range and the entry count, `check_keys` that each key is a decimal token id,
`check_vocabulary` that it is in the model's vocabulary. Every failure is a 400 naming `logit_bias`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from phaseserve.gateway.errors import bad_request
from phaseserve.gateway.limits import MAX_LOGIT_BIAS
from phaseserve.params import LOGIT_BIAS_LIMIT

LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]],
                      Field(max_length=MAX_LOGIT_BIAS, description=(
                          f"token id (a decimal string) -> bias added to its logit, in [-100, 100]; at most "
                          f"{MAX_LOGIT_BIAS} entries, each id in the model's vocabulary"))]


def check_keys(logit_bias: dict[str, float] | None) -> None:
    """Every key a decimal token id that fits 64 bits (ValueError naming the field, for the schema's validator)."""
    for key in logit_bias or ():
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            raise ValueError(f"'logit_bias' keys must be token ids (decimal integers); got {key[:40]!r}")


def check_vocabulary(logit_bias: dict[str, float] | None, vocab_size: int) -> None:
    outside = [int(k) for k in logit_bias or () if int(k) >= vocab_size]
    if outside:
        raise bad_request(f"'logit_bias' has token ids outside the vocabulary (size {vocab_size}): {outside[:5]}",
                          "logit_bias")


def by_token_id(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """The checked field as SamplingParams.logit_bias: {token id: bias}."""
    return {int(k): float(v) for k, v in (logit_bias or {}).items()}
