"""Deployment files and presets: TE groups, roles, P/D pairing rules, validation errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from meshserve.config import ConfigError
from meshserve.router.deployment import MultiDeployment, is_multi_te, load_multi


def test_presets_expand_to_named_tes():
    tes = MultiDeployment.preset("2p1d").tes()
    assert [(t.name, t.role, t.group) for t in tes] == [
        ("pd-prefill-0", "prefill", "pd"), ("pd-prefill-1", "prefill", "pd"), ("pd-decode-0", "decode", "pd")]
    assert all(t.engine["te_name"] == t.name for t in tes)
    mixed = MultiDeployment.preset("colocated2+1p2d")
    assert mixed.role_counts() == {"colocated": 2, "prefill": 1, "decode": 2}
    assert MultiDeployment.preset("none").tes() == []


@pytest.mark.parametrize("name", ["3x", "0p1d", "1p0d", "colocated0", "colocated+"])
def test_unknown_or_empty_presets_are_refused(name):
    with pytest.raises(ConfigError):
        MultiDeployment.preset(name)


def test_file_settings_merge_deployment_then_group(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("""
model: some/model
routing: combined
job_executors: 2
engine: {num_kv_blocks: 64, max_num_seqs: 8}
te_groups:
  - {group: pd, role: prefill, count: 1, parallel: "attn=TP2+DP1 moe=TP2+EP1"}
  - {group: pd, role: decode, count: 2, engine: {num_kv_blocks: 16}}
""")
    assert is_multi_te(str(path))
    deployment = load_multi(str(path))
    assert deployment.routing == "combined" and deployment.job_executors == 2
    prefill, decode0, decode1 = deployment.tes()
    assert prefill.engine["parallel"] == "attn=TP2+DP1 moe=TP2+EP1" and prefill.engine["num_kv_blocks"] == 64
    assert decode0.engine["num_kv_blocks"] == 16 and decode0.engine["max_num_seqs"] == 8
    assert decode1.name == "pd-decode-1" and prefill.model == "some/model"


def test_the_waiting_room_sums_the_tes_a_request_waits_at_first(tmp_path):
    """The frontend's --max-waiting-choices default: colocated and prefill TEs' max_waiting, not decode TEs'."""
    path = tmp_path / "d.yaml"
    path.write_text("""
engine: {max_waiting: 100}
te_groups:
  - {group: pd, role: prefill, count: 2, engine: {max_waiting: 40}}
  - {group: pd, role: decode, count: 1}
  - {group: main, role: colocated, count: 1}
""")
    deployment = load_multi(str(path))
    assert deployment.waiting_room() == 2 * 40 + 100
    assert deployment.waiting_room({"max_waiting": 7}) == 3 * 7  # a flag given to every TE wins
    # an autoscaled group counts at its most TEs: one scaled to zero still takes (and holds) requests
    path.write_text("""
engine: {max_waiting: 10}
te_groups:
  - {group: main, role: colocated, count: 0, min: 0, max: 3}
""")
    assert load_multi(str(path)).waiting_room() == 30


def test_one_te_deployment_files_are_not_multi(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text('parallel: "attn=TP1+DP2 moe=TP1+EP2"\n')
    assert not is_multi_te(str(path))
    assert is_multi_te("1p1d")


@pytest.mark.parametrize("text, message", [
    ("te_groups: [{role: prefill}]", "needs both prefill and decode"),
    ("te_groups: [{role: colocated, group: g}, {role: prefill, group: g}, {role: decode, group: g}]", "mixes"),
    ("te_groups: [{role: router}]", "role must be one of"),
    ("te_groups: [{role: colocated, count: -1}]", "count must be"),
    ("te_groups: [{role: colocated, engine: {warp_speed: 9}}]", "unknown engine setting"),
    ("te_groups: [{role: colocated, parallel: 'attn=TP3'}]", "parallel"),
    ("routing: fastest\nte_groups: []", "routing must be one of"),
    ("te_groups: []\njob_executors: 0", "job_executors"),
    ("te_groups: []\nextra: 1", "unknown key"),
    ("te_groups: {role: colocated}", "te_groups must be a list"),
])
def test_bad_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_multi(str(path))


def test_cli_reports_a_bad_preset_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "meshserve.entrypoints.cli", "serve", "--deployment", "3p", "--model",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown deployment preset" in lines[0]


@pytest.mark.parametrize("arch,refused", [("qwen3_moe", True), ("deepseek_v3", False)])
def test_pd_groups_with_different_attention_tp_need_mla(tiny_model, arch, refused):
    """GQA splits KV heads by TP rank, so prefill and decode must match; MLA ranks hold the whole latent cache."""
    from meshserve.config import EngineConfig
    from meshserve.router.deployment import check_pd_layouts

    model = str(tiny_model(arch))
    deployment = MultiDeployment.from_dict({"te_groups": [
        {"group": "pd", "role": "prefill", "parallel": "attn=TP2+DP1 moe=TP2+EP1"},
        {"group": "pd", "role": "decode"},
        {"group": "same", "role": "prefill"}, {"group": "same", "role": "decode"}]})
    tes = deployment.tes()
    configs = [EngineConfig.from_kwargs(model, **t.engine) for t in tes]
    if refused:
        with pytest.raises(ConfigError, match="group 'pd'.*attention TP 1, 2.*same attention TP"):
            check_pd_layouts(tes, configs)
    else:
        check_pd_layouts(tes, configs)
    same = [i for i, t in enumerate(tes) if t.group == "same"]
    check_pd_layouts([tes[i] for i in same], [configs[i] for i in same])  # equal layouts always pair
