import json

import pytest

from meshserve.router.pd_heatmap import PDHeatmap, measure_cell

PREFILL = [0, 512, 2048, 8192]  # 3 rows
RATIO = [0, 0.25, 1, 4]  # 3 columns


def make_heatmap():
    return PDHeatmap(PREFILL, RATIO, {
        2.0: [[-0.2, -0.1, None], [0.3, 0.1, -0.05], [0.9, 0.4, None]],
        8.0: [[-0.3, None, None], [0.5, 0.2, 0.1], [1.2, None, None]],
    })


def test_combined_sums_over_rps_and_skips_none_cells():
    combined = make_heatmap().combined()
    expected = [[-0.5, -0.1, 0.0], [0.8, 0.3, 0.05], [2.1, 0.4, 0.0]]
    assert [[round(v, 9) for v in row] for row in combined] == expected
    assert all(isinstance(v, float) for row in combined for v in row)
    assert make_heatmap().has_data() == [[True, True, False], [True, True, True], [True, True, False]]


def test_value_looks_up_prefill_and_ratio_cell():
    heatmap = make_heatmap()
    assert heatmap.value(100, 10) == pytest.approx(-0.5)  # row 0, ratio 0.1 -> column 0
    assert heatmap.value(100, 50) == pytest.approx(-0.1)  # ratio 0.5 -> column 1
    assert heatmap.value(1000, 1000) == pytest.approx(0.05)  # ratio exactly 1 -> column 2 (left edge inclusive)
    assert heatmap.value(512, 0) == pytest.approx(0.8)  # prefill exactly 512 -> row 1
    assert heatmap.value(4000, 2000) == pytest.approx(0.4)


def test_value_clamps_to_outer_bins():
    heatmap = make_heatmap()
    assert heatmap.cell(100_000, 10) == (2, 0)  # beyond the last prefill edge
    assert heatmap.cell(1000, 100_000) == (1, 2)  # beyond the last ratio edge
    assert heatmap.cell(0, 5) == (0, 2)  # empty prompt: unbounded ratio
    assert heatmap.value(100_000, 10) == pytest.approx(2.1)
    assert heatmap.value(1000, 100_000) == pytest.approx(0.05)
    clamped_below = PDHeatmap([100, 200], [0.5, 1.0], {1.0: [[0.7]]})
    assert clamped_below.value(10, 1) == pytest.approx(0.7)  # below the first edges of both axes
    with pytest.raises(ValueError, match="non-negative"):
        heatmap.value(-1, 5)


def test_cell_without_data_reads_zero():
    assert make_heatmap().value(100, 500) == 0.0  # row 0, ratio 5 -> column 2, never measured


def test_json_round_trip(tmp_path):
    heatmap = make_heatmap()
    path = heatmap.save(tmp_path / "deep" / "heatmap.json")
    loaded = PDHeatmap.load(path)
    assert loaded.to_dict() == heatmap.to_dict()
    assert loaded.grids[8.0][0][1] is None
    assert PDHeatmap.from_dict(json.loads(path.read_text())).combined() == heatmap.combined()


def test_plot_writes_a_png(tmp_path):
    path = make_heatmap().plot(tmp_path / "fig" / "heatmap.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_measure_cell_is_ratio_of_means_minus_one():
    assert measure_cell([3.0, 5.0], [2.0, 2.0]) == pytest.approx(1.0)
    assert measure_cell([1.0], [2.0, 2.0]) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="at least one"):
        measure_cell([], [1.0])
    with pytest.raises(ValueError, match="positive"):
        measure_cell([1.0], [0.0])


@pytest.mark.parametrize("prefill, ratio, grids, message", [
    ([0], RATIO, {1.0: []}, "at least two edges"),
    ([0, 512, 256], RATIO, {1.0: [[0.0] * 3] * 2}, "strictly increasing"),
    (PREFILL, RATIO, {}, "at least one RPS"),
    (PREFILL, RATIO, {1.0: [[0.0] * 3] * 2}, "3 rows"),
    (PREFILL, RATIO, {1.0: [[0.0] * 3, [0.0] * 3, [0.0] * 2]}, "row 2 must have 3 values"),
    (PREFILL, RATIO, {1.0: [[0.0, "x", 0.0]] * 3}, "must be a number"),
    (PREFILL, RATIO, {-1.0: [[0.0] * 3] * 3}, "RPS must be positive"),
])
def test_bad_construction(prefill, ratio, grids, message):
    with pytest.raises(ValueError, match=message):
        PDHeatmap(prefill, ratio, grids)


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "not a JSON file"),
    (json.dumps([1, 2]), "must be a JSON object"),
    (json.dumps({"format": "something-else"}), "not a PD heatmap"),
    (json.dumps({"format": "meshserve-pd-heatmap", "version": 7}), "version 7 is not supported"),
    (json.dumps({"format": "meshserve-pd-heatmap", "version": 1, "prefill_edges": [0, 1]}), "lacks ratio_edges"),
    (json.dumps({"format": "meshserve-pd-heatmap", "version": 1, "prefill_edges": [0, 1], "ratio_edges": [0, 1],
                 "grids": [{"rps": 1, "values": [[0.1]]}, {"rps": 1.0, "values": [[0.2]]}]}), "appears twice"),
])
def test_bad_files_raise_clear_value_errors(tmp_path, content, message):
    path = tmp_path / "heatmap.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        PDHeatmap.load(path)
