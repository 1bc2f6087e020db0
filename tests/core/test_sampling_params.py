"""SamplingParams refuses what no model could take (types, 64-bit range, NaN) and checks ids against a vocabulary."""
from __future__ import annotations

import math

import msgpack
import pytest

from meshserve.wire.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, SamplingParamsError

BAD_PARAMS = {
    "seed beyond int64": ({"seed": 2**70}, "seed"),
    "seed below int64": ({"seed": INT64_MIN - 1}, "seed"),
    "seed + n beyond int64": ({"seed": INT64_MAX, "n": 2}, "seed"),
    "top_k beyond int64": ({"top_k": 2**63}, "top_k"),
    "max_tokens beyond int64": ({"max_tokens": 2**64}, "max_tokens"),
    "min_tokens beyond int64": ({"min_tokens": 2**64, "max_tokens": None}, "min_tokens"),
    "n beyond int64": ({"n": 2**64}, "n"),
    "stop id beyond int64": ({"stop_token_ids": [2**64]}, "stop_token_ids[0]"),
    "negative stop id": ({"stop_token_ids": [3, -1]}, "stop_token_ids[1]"),
    "stop id as text": ({"stop_token_ids": ["7"]}, "stop_token_ids[0]"),
    "stop ids not a list": ({"stop_token_ids": 7}, "stop_token_ids"),
    "stop not text": ({"stop": [3]}, "stop"),
    "NaN repetition_penalty": ({"repetition_penalty": math.nan}, "repetition_penalty"),
    "infinite temperature": ({"temperature": math.inf}, "temperature"),
    "NaN top_p": ({"top_p": math.nan}, "top_p"),
    "NaN min_p": ({"min_p": math.nan}, "min_p"),
    "infinite presence_penalty": ({"presence_penalty": -math.inf}, "presence_penalty"),
    "NaN frequency_penalty": ({"frequency_penalty": math.nan}, "frequency_penalty"),
    "bool for n": ({"n": True}, "n"),
    "float for max_tokens": ({"max_tokens": 3.0}, "max_tokens"),
    "text for temperature": ({"temperature": "0.5"}, "temperature"),
    "int for ignore_eos": ({"ignore_eos": 1}, "ignore_eos"),
    "zero repetition_penalty": ({"repetition_penalty": 0.0}, "repetition_penalty"),
}


@pytest.mark.parametrize("kwargs,param", BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_bad_values_raise_naming_the_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(**kwargs)
    assert raised.value.param == param
    assert "\n" not in str(raised.value)


def test_every_accepted_value_packs_into_msgpack():
    extremes = SamplingParams(n=1, seed=INT64_MAX, top_k=INT64_MAX, max_tokens=INT64_MAX, min_tokens=INT64_MAX,
                              stop_token_ids=[INT64_MAX], temperature=2, repetition_penalty=1e308)
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(extremes.to_dict()))) == extremes
    assert SamplingParams(seed=INT64_MIN).seed == INT64_MIN


def test_verify_checks_ids_against_the_vocabulary():
    SamplingParams(stop_token_ids=[0, 31999]).verify(32000)
    for ids, bad_index in (([5, 32000], 1), ([2**40], 0)):
        with pytest.raises(SamplingParamsError, match="outside the vocabulary") as raised:
            SamplingParams(stop_token_ids=ids).verify(32000)
        assert raised.value.param == f"stop_token_ids[{bad_index}]"


@pytest.mark.parametrize("data", [None, [1, 2], {"bogus": 1}, {"n": "2"}, {"stop_token_ids": [-1]}])
def test_from_dict_refuses_malformed_peers_with_one_error_type(data):
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict(data)


def test_round_trip_and_normalisation():
    params = SamplingParams(stop="x", stop_token_ids=(1, 2), top_k=None, temperature=0)
    assert (params.stop, params.stop_token_ids, params.top_k) == (["x"], [1, 2], -1)
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert params.greedy
