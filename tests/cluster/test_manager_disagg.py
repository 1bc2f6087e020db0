"""The cluster manager starts a disaggregated TE (attention ranks + expert ranks) as it starts any: from the
deployment file's engine settings, with every rank of both roles, and it serves."""
from __future__ import annotations

from meshserve.utils.processes import rank_processes
from tests.cluster.cluster_processes import complete, managed_deployment, status

DEPLOYMENT = """
te_groups:
  - {group: main, role: colocated, count: 1}
engine: {num_kv_blocks: 64, num_threads: 1, parallel: "attn=DP2 moe=EP2 disagg"}
"""


def test_the_manager_starts_a_te_of_attention_and_expert_ranks(tiny_model, tmp_path):
    model = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    path = tmp_path / "deployment.yaml"
    path.write_text(DEPLOYMENT)
    with managed_deployment(str(path), str(model), tmp_path / "state") as base_url:
        reply = complete(base_url)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        [te] = status(tmp_path / "state")["tes"]
        assert te["state"] == "ready"
        assert sorted(rank_processes(te["pid"])) == [0, 1, 2, 3]  # two attention ranks, two expert ranks
