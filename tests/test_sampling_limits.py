"""Sampling fields at their float limits (issue 50): every value a float64 check lets through either samples (200,
finite output) or is refused with a 400 that names the field; never a 500. The sampler works in float32, where
5e-324 is 0 and 1e-45 divides a logit into infinity."""
import math

import httpx
import pytest

from minivllm.engine import LLMEngine
from minivllm.server import BackgroundServer, build_app

EDGES = [5e-324, 1e-310, 1.4e-45, 1e-45, 1e-40, 1.1754942e-38, 1.1754944e-38, 1e-30, 1e-7, 0.0, -0.0, -5e-324,
         1 - 1e-17, 1.0000000000000002, 2.0, 2.0000000000000004, 1e308, -1e308]
FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]


@pytest.fixture(scope="module")
def url(tiny):
    model, tok = tiny
    with BackgroundServer(build_app(LLMEngine(model, tok, block_size=4, num_kv_blocks=256), "tiny")) as srv:
        yield srv.url


@pytest.mark.parametrize("field", FIELDS)
def test_a_sampling_field_at_its_float_limits_is_sampled_or_refused_by_name(url, field):
    outcomes = {}
    for value in EDGES:
        for extra in ({}, {"temperature": 0.8, "seed": 1}):  # greedy, and sampled
            body = {"prompt": "Hello there", "max_tokens": 4, **extra, field: value}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code in (200, 400), (field, value, extra, r.status_code, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["param"] == field, (value, r.text)
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"
            outcomes[value] = r.status_code
    assert 200 in outcomes.values() and 400 in outcomes.values()
