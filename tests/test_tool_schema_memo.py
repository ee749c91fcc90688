"""Tool argument schemas are checked once per distinct schema (an environment is built per
episode), and the memo never lets a bad schema or bad arguments through."""

import time

import jsonschema
import pytest

from mentorrl.envs import get_env
from mentorrl.envs.base import Tool, schema_validator

SCHEMA = {
    "type": "object",
    "properties": {"order_id": {"type": "string"}},
    "required": ["order_id"],
    "additionalProperties": False,
}


def test_equal_schemas_share_one_validator_and_still_validate():
    a = Tool("a", "", dict(SCHEMA), lambda **k: k)
    b = Tool("b", "", {**SCHEMA, "properties": {"order_id": {"type": "string"}}}, lambda **k: k)
    assert a._validator is b._validator
    assert a.validation_error({"order_id": "O-1"}) is None
    assert "order_id" in a.validation_error({})
    assert a.validation_error({"order_id": 3}) is not None
    other = Tool("c", "", {**SCHEMA, "properties": {"order_id": {"type": "integer"}}}, lambda **k: k)
    assert other._validator is not a._validator and other.validation_error({"order_id": 3}) is None


def test_an_invalid_schema_raises_every_time():
    for _ in range(2):
        with pytest.raises(jsonschema.SchemaError):
            Tool("bad", "", {"type": "no-such-type"}, lambda: None)


def test_a_schema_that_is_not_json_is_still_checked():
    with pytest.raises(jsonschema.SchemaError):
        schema_validator({"type": "nope", "default": object()})
    assert schema_validator({"type": "object", "default": object()}).is_valid({})


def test_building_an_environment_per_episode_is_cheap():
    entry = get_env("orders")
    entry.make_env().close()
    t = time.perf_counter()
    for _ in range(20):
        entry.make_env().close()
    assert (time.perf_counter() - t) / 20 < 0.02  # was ~60 ms: nine schemas re-checked per environment
