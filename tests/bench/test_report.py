import json

import numpy as np
import pytest

from meshserve.utils import report


def test_percentile_interpolates_between_ranks():
    sample = [10.0, 20.0, 30.0, 40.0]
    # position (n-1)*q/100: p50 -> 1.5 (between 20 and 30), p90 -> 2.7, p0/p100 -> the extremes
    assert report.percentile(sample, 50) == pytest.approx(25.0)
    assert report.percentile(sample, 90) == pytest.approx(30.0 + 0.7 * 10.0)
    assert report.percentile(sample, 0) == 10.0
    assert report.percentile(sample, 100) == 40.0
    assert report.percentile([7.0], 99) == 7.0


def test_percentile_ignores_input_order_and_matches_numpy():
    sample = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for q in (1, 33, 50, 90, 99):
        assert report.percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        report.percentile([], 50)
    with pytest.raises(ValueError):
        report.percentile([1.0], 101)


def test_summarize_hand_sample():
    summary = report.summarize([1, 2, 3, 4, 100])
    assert summary["count"] == 5
    assert summary["mean"] == pytest.approx(22.0)
    assert summary["min"] == 1 and summary["max"] == 100
    assert summary["p50"] == pytest.approx(3.0)
    assert summary["p90"] == pytest.approx(4 + 0.6 * 96)  # position 3.6
    assert summary["p99"] == pytest.approx(4 + 0.96 * 96)  # position 3.96


def test_summarize_empty_sample_has_none_fields():
    summary = report.summarize([])
    assert summary == {"count": 0, "mean": None, "min": None, "max": None, "p50": None, "p90": None, "p99": None}


def test_write_json_creates_parent_dirs_and_converts_scalars(tmp_path):
    path = report.write_json(tmp_path / "a" / "b" / "result.json", {"x": np.float64(1.5), "nested": {"n": np.int64(3)}})
    assert json.loads(path.read_text()) == {"x": 1.5, "nested": {"n": 3}}
    assert report.png_path_for(path) == tmp_path / "a" / "b" / "result.png"


def test_figure_helpers_write_a_png(tmp_path):
    fig, axes = report.new_figure(ncols=2)
    report.plot_cdf(axes[0][0], [3.0, 1.0, 2.0], label="x", xlabel="ms")
    report.plot_cdf(axes[0][1], [], label="empty", xlabel="ms")
    path = report.save_figure(fig, tmp_path / "deep" / "fig.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
