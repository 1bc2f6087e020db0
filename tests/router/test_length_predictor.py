import json
import random
import struct

import pytest
import torch
from safetensors.torch import save_file

from meshserve.router.length_predictor import LengthExample, LengthPredictor, bucket_of, hashed_ngrams

BUCKET = 128
# marker token -> the range its outputs fall in: buckets 0, 1 and 2
MARKER_OUTPUTS = {7: (1, 120), 8: (140, 250), 9: (270, 380)}


def synthetic_examples(n, seed):
    """Random prompts with one marker token each; the marker decides the output length, max_tokens never binds."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        prompt = [rng.randrange(100, 2000) for _ in range(rng.randint(8, 60))]
        marker = rng.choice(sorted(MARKER_OUTPUTS))
        prompt.insert(rng.randrange(len(prompt) + 1), marker)
        examples.append(LengthExample(prompt, rng.randint(400, 900), rng.randint(*MARKER_OUTPUTS[marker])))
    return examples


@pytest.fixture(scope="module")
def trained():
    return LengthPredictor.train(synthetic_examples(600, seed=1), bucket_tokens=BUCKET, seed=0)


def test_bucket_edges():
    assert [bucket_of(n, 128) for n in (0, 1, 128, 129, 256, 257)] == [0, 0, 0, 1, 1, 2]


def test_hashed_ngrams_are_stable_and_counted():
    slots, weights = hashed_ngrams([5, 6, 5, 6], 4096)
    again, _ = hashed_ngrams([5, 6, 5, 6], 4096)
    assert slots == again and all(0 <= s < 4096 for s in slots)
    # unigrams 5, 6 and bigram (5, 6) twice each, bigram (6, 5) once: the larger weights are log(3)
    assert sorted(round(w, 4) for w in weights)[-3:] == [round(torch.log1p(torch.tensor(2.0)).item(), 4)] * 3
    assert hashed_ngrams([], 4096) == ([], [])


def test_learns_marker_rule_beyond_both_baselines(trained):
    result = trained.evaluate(synthetic_examples(300, seed=2))
    baselines = result["baselines"]
    assert result["n"] == 300
    assert result["accuracy"] >= 0.85
    assert result["accuracy"] > baselines["majority_bucket"] + 0.3
    assert result["accuracy"] > baselines["max_tokens_bucket"] + 0.3
    assert sum(map(sum, result["confusion"])) == 300
    diagonal = sum(result["confusion"][i][i] for i in range(len(result["confusion"])))
    assert diagonal == round(result["accuracy"] * 300)


def test_baselines_are_measured_on_the_given_examples(trained):
    examples = synthetic_examples(50, seed=3)
    truth = [bucket_of(e.output_tokens, BUCKET) for e in examples]
    result = trained.evaluate(examples)
    expected_max = sum(t == bucket_of(e.max_tokens, BUCKET) for t, e in zip(truth, examples)) / len(examples)
    expected_majority = sum(t == trained.majority_bucket for t in truth) / len(examples)
    assert result["baselines"] == {"majority_bucket": expected_majority, "max_tokens_bucket": expected_max}


def test_predictions_never_exceed_max_tokens(trained):
    long_prompt = [9, 300, 400, 500]  # marker of bucket 2
    assert trained.predict_bucket(long_prompt, 800) == 2
    assert trained.predict_tokens(long_prompt, 800) == 2 * BUCKET + BUCKET // 2
    assert trained.predict_bucket(long_prompt, 100) == 0
    assert trained.predict_tokens(long_prompt, 100) <= 100
    assert trained.predict_tokens(long_prompt, 20) == 20
    with pytest.raises(ValueError, match="max_tokens"):
        trained.predict_bucket(long_prompt, 0)


def test_training_is_deterministic_given_the_seed():
    examples = synthetic_examples(120, seed=4)
    a = LengthPredictor.train(examples, epochs=5, seed=3, hidden=16)
    b = LengthPredictor.train(examples, epochs=5, seed=3, hidden=16)
    c = LengthPredictor.train(examples, epochs=5, seed=4, hidden=16)
    state_a, state_b, state_c = (p._model.state_dict() for p in (a, b, c))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)


def test_save_load_round_trip_predicts_the_same(trained, tmp_path):
    path = trained.save(tmp_path / "sub" / "predictor.safetensors")
    loaded = LengthPredictor.load(path)
    assert (loaded.bucket_tokens, loaded.feature_dim, loaded.num_buckets, loaded.majority_bucket) == (
        trained.bucket_tokens, trained.feature_dim, trained.num_buckets, trained.majority_bucket)
    held_out = synthetic_examples(80, seed=5)
    requests = [(e.prompt_token_ids, e.max_tokens) for e in held_out]
    assert loaded.predict_buckets(requests) == trained.predict_buckets(requests)
    assert loaded.evaluate(held_out) == trained.evaluate(held_out)


def test_one_hidden_layer_model_round_trips(tmp_path):
    predictor = LengthPredictor.train(synthetic_examples(100, seed=6), epochs=3, hidden=8, feature_dim=256)
    loaded = LengthPredictor.load(predictor.save(tmp_path / "h.safetensors"))
    requests = [(e.prompt_token_ids, e.max_tokens) for e in synthetic_examples(30, seed=7)]
    assert loaded.hidden == 8 and loaded.predict_buckets(requests) == predictor.predict_buckets(requests)


def _rewrite_metadata(src, dst, **changes):
    """Copy a safetensors file with some metadata fields replaced."""
    raw = src.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    header["__metadata__"].update(changes)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    dst.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + size:])
    return dst


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("garbage", "not a safetensors file"),
    ("foreign", "not a length predictor file"),
    ("version", "version '99' is not supported"),
    ("shape", "weights do not match"),
    ("metadata", "incomplete or malformed"),
])
def test_bad_files_raise_clear_value_errors(trained, tmp_path, case, message):
    good = trained.save(tmp_path / "good.safetensors")
    path = tmp_path / "bad.safetensors"
    if case == "garbage":
        path.write_bytes(b"\x00\x01 this is not a tensor file")
    elif case == "foreign":
        save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "pt"})
    elif case == "version":
        _rewrite_metadata(good, path, version="99")
    elif case == "shape":
        _rewrite_metadata(good, path, num_buckets=str(trained.num_buckets + 2))
    elif case == "metadata":
        _rewrite_metadata(good, path, feature_dim="many")
    with pytest.raises(ValueError, match=message):
        LengthPredictor.load(path)


def test_bad_training_input():
    with pytest.raises(ValueError, match="no examples"):
        LengthPredictor.train([])
    with pytest.raises(ValueError, match="max_tokens"):
        LengthPredictor.train([LengthExample([1, 2], 0, 0)])
    with pytest.raises(ValueError, match="bucket_tokens"):
        LengthPredictor.train([LengthExample([1, 2], 5, 3)], bucket_tokens=0)
