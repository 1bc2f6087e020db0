"""Model caching: put-model, loading from the pool (whole and per-rank shards), versions, eviction, failover."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from meshserve.entrypoints.cli import main
from meshserve.models.factory import make_model
from meshserve.models.loader import load_model
from meshserve.parallel.context import ParallelContext
from meshserve.parallel.strategy import ParallelStrategy, parse_strategy
from meshserve.parallel.topology import spawn_local_world
from meshserve.pool.sdk import PoolClient
from meshserve.worker import model_cache as mc
from tests.pool.pool_processes import free_address, pool_processes, start_pool, stop, wait_until

CHUNK_MB = "0.25"  # 256 KiB: the tiny models' larger tensors are split into several chunks
TP2_EP2 = ParallelStrategy(attn_tp=2, attn_dp=1, moe_tp=1, moe_ep=2)
DISAGG = parse_strategy("attn=DP1 moe=EP1 disagg")  # rank 0 attends, rank 1 holds the experts


def params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def assert_same_params(a, b) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("model-cache")
    return {"deepseek_v3": make_model("deepseek_v3", "tiny", root / "ds" / "tiny-model"),
            "qwen3_moe": make_model("qwen3_moe", "tiny", root / "qwen3_moe"),
            # same directory name and shapes as the first, other weights: a second version of one model id
            "deepseek_v3_retrained": make_model("deepseek_v3", "tiny", root / "ds2" / "tiny-model", seed=1),
            # FP8 block weights with their scales: stored as they are, dequantized by the loader
            "deepseek_v3_fp8": make_model("deepseek_v3", "tiny", root / "fp8" / "fp8-model", fp8=True,
                                          overrides={"num_hidden_layers": 2})}


def _shard_worker(rank: int, world_size: int, controller: str, disk_dir: str, pool_only_dir: str,
                  out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = ParallelContext.build(TP2_EP2)
    from_disk = params(load_model(disk_dir, parallel=ctx))
    with PoolClient(controller, timeout_s=5.0) as pool:
        results = {}
        for label, model_dir in (("pool_only_equal", pool_only_dir), ("with_disk_equal", disk_dir)):
            loaded = params(load_model(model_dir, parallel=ctx, read_weights=mc.pool_weights(pool, model_dir)))
            results[label] = loaded.keys() == from_disk.keys() and all(
                torch.equal(t, from_disk[n]) for n, t in loaded.items())
        # attention and experts on different ranks: rank 1 holds only experts, and reads them from the pool too
        roles = ParallelContext.build(DISAGG)
        role_from_disk = params(load_model(disk_dir, parallel=roles))
        role_loaded = params(load_model(disk_dir, parallel=roles, read_weights=mc.pool_weights(pool, disk_dir)))
        results["disagg_equal"] = role_loaded.keys() == role_from_disk.keys() and all(
            torch.equal(t, role_from_disk[n]) for n, t in role_loaded.items())
        results["disagg_expert_only"] = roles.is_expert_rank and all(".experts." in n for n in role_loaded)
    results["numel"] = sum(t.numel() for t in from_disk.values())
    torch.save(results, Path(out_dir) / f"shard-rank{rank}.pt")


def put_model_cli(controller: str, model_dir: Path, *extra: str) -> int:
    return main(["pool", "put-model", str(model_dir), "--controller", controller, "--chunk-mb", CHUNK_MB,
                 "--timeout", "10", *extra])


def test_put_load_shards_versions_eviction_and_failover(models, tmp_path, capsys, caplog):
    controller = free_address()
    with pool_processes() as procs:
        procs.append(start_pool(["controller", "--bind", controller, "--server-timeout", "1.0"],
                                tmp_path / "controller.log"))
        for sid in ("s0", "s1"):
            procs.append(start_pool(["server", "--controller", controller, "--bind", free_address(), "--id", sid,
                                     "--dram-gb", "0.5", "--heartbeat", "0.2"], tmp_path / f"{sid}.log"))
        with PoolClient(controller, timeout_s=5.0, view_refresh_s=0.2) as pool:
            wait_until(lambda: (v := pool.view()) is not None and len(v.servers) == 2, 30, "two servers")

            # ---- put-model, then load from the pool alone: identical parameters, both architectures
            for arch in ("deepseek_v3", "qwen3_moe"):
                assert put_model_cli(controller, models[arch]) == 0
                out = capsys.readouterr().out
                assert "%)" in out and "stored" in out  # progress lines
                model_id, version = mc.default_model_id(models[arch]), mc.model_version(models[arch])
                manifest = mc.fetch_manifest(pool, model_id, version)
                assert manifest is not None and any(t.chunks > 1 for t in manifest.tensors)
                assert "config.json" in manifest.files and "tokenizer.json" in manifest.files
                pool_only = mc.fetch_model_files(pool, model_id, tmp_path / f"{arch}-from-pool")
                assert not list(pool_only.glob("*.safetensors"))
                reference = load_model(models[arch])
                assert_same_params(load_model(pool_only, read_weights=mc.pool_weights(pool, pool_only)), reference)
                from_pool = load_model(models[arch], read_weights=mc.pool_weights(pool, models[arch]))
                assert_same_params(from_pool, reference)
            # an FP8 checkpoint: its FP8 tensors and scales come from the pool, the same weights as from disk
            fp8_dir = models["deepseek_v3_fp8"]
            assert put_model_cli(controller, fp8_dir) == 0
            capsys.readouterr()
            fp8_from_pool = mc.fetch_model_files(pool, "fp8-model", tmp_path / "fp8-from-pool")
            assert_same_params(load_model(fp8_from_pool, read_weights=mc.pool_weights(pool, fp8_from_pool)),
                               load_model(fp8_dir))
            # converted to INT8 W8A8 at load: the pool's tensors give the same INT8 weights as the disk's
            int8_from_pool = load_model(fp8_from_pool, read_weights=mc.pool_weights(pool, fp8_from_pool),
                                        quantization="int8")
            assert int8_from_pool.layers[1].mlp.experts.w13.dtype == torch.int8
            assert_same_params(int8_from_pool, load_model(fp8_dir, quantization="int8"))
            assert main(["pool", "models", "--controller", controller, "--evict", "fp8-model"]) == 0
            capsys.readouterr()
            # storing it again only stamps it as used
            assert put_model_cli(controller, models["qwen3_moe"]) == 0
            assert "already in the pool" in capsys.readouterr().out

            # ---- each TP2/EP2 rank reads only its shard, equal to its shard from disk
            reference = load_model(models["deepseek_v3"])
            spawn_local_world(_shard_worker, 2, args=(controller, str(models["deepseek_v3"]),
                                                      str(tmp_path / "deepseek_v3-from-pool"), str(tmp_path)),
                              timeout_s=60)
            full = sum(p.numel() for p in reference.parameters())
            for rank in range(2):
                result = torch.load(tmp_path / f"shard-rank{rank}.pt")
                assert result["pool_only_equal"] and result["with_disk_equal"], result
                assert result["disagg_equal"] and result["disagg_expert_only"] == (rank == 1), result
                assert result["numel"] < full  # really a shard

            # ---- a second version of the same model id never mixes with the first
            ds, retrained = models["deepseek_v3"], models["deepseek_v3_retrained"]
            v1, v2 = mc.model_version(ds), mc.model_version(retrained)
            assert v1 != v2 and mc.default_model_id(ds) == mc.default_model_id(retrained) == "tiny-model"
            assert put_model_cli(controller, retrained) == 0
            capsys.readouterr()
            m1, m2 = mc.fetch_manifest(pool, "tiny-model", v1), mc.fetch_manifest(pool, "tiny-model", v2)
            assert not set(mc.value_keys(m1)) & set(mc.value_keys(m2))
            v2_dir = mc.fetch_model_files(pool, "tiny-model", tmp_path / "v2-from-pool")  # newest version
            v1_dir = mc.fetch_model_files(pool, "tiny-model", tmp_path / "v1-from-pool", version=v1)
            ref_v1, ref_v2 = load_model(ds), load_model(retrained)
            assert any(not torch.equal(a, b) for a, b in zip(ref_v1.parameters(), ref_v2.parameters()))
            assert_same_params(load_model(v2_dir, read_weights=mc.pool_weights(pool, v2_dir)), ref_v2)
            assert_same_params(load_model(v1_dir, read_weights=mc.pool_weights(pool, v1_dir)), ref_v1)

            # ---- listing, and evicting one version as a whole
            assert main(["pool", "models", "--controller", controller]) == 0
            listing = capsys.readouterr().out
            assert listing.count("tiny-model") == 2 and "qwen3_moe" in listing and v1 in listing and v2 in listing
            assert main(["pool", "models", "--controller", controller, "--evict", f"tiny-model:{v1}"]) == 0
            assert f"evicted tiny-model version {v1}" in capsys.readouterr().out
            assert not any(pool.exists(mc.NAMESPACE, mc.value_keys(m1)))
            assert all(pool.exists(mc.NAMESPACE, mc.value_keys(m2)))
            assert {(e.model_id, e.version) for e in mc.list_models(pool)} == {
                ("tiny-model", v2), ("qwen3_moe", mc.model_version(models["qwen3_moe"]))}
            assert main(["pool", "models", "--controller", controller, "--evict", "nothing-like-it"]) == 1
            capsys.readouterr()

            # ---- a budget evicts whole least-recently-used models first
            assert main(["pool", "models", "--controller", controller, "--prefetch", "tiny-model"]) == 0
            assert "prefetched tiny-model" in capsys.readouterr().out  # tiny-model v2 is now the most recent
            qwen = mc.fetch_manifest(pool, "qwen3_moe", mc.model_version(models["qwen3_moe"]))
            budget = m1.total_bytes + m2.total_bytes + 1024  # room for two tiny-models, not for three models
            assert put_model_cli(controller, ds, "--max-bytes", str(budget)) == 0
            assert "evicting qwen3_moe@" in capsys.readouterr().out
            assert not any(pool.exists(mc.NAMESPACE, mc.value_keys(qwen)))
            assert {e.version for e in mc.list_models(pool)} == {v1, v2}
            assert put_model_cli(controller, models["qwen3_moe"], "--max-bytes", "1K") == 1
            assert "more than the models budget" in capsys.readouterr().err

            # ---- a killed pool server: the load still succeeds, its tensors come from disk
            stop(procs[1])
            caplog.set_level(logging.INFO, logger="meshserve.worker.model_cache")
            assert_same_params(load_model(ds, read_weights=mc.pool_weights(pool, ds)), ref_v1)
            # half the chunks (or the manifest itself) were on the killed server
            assert any("came from disk" in r.getMessage() or "not in the pool; loading from disk" in r.getMessage()
                       for r in caplog.records)
            # a pool-only directory has nothing to fall back on: that fails, naming the tensor
            with pytest.raises(mc.ModelCacheError, match="from the pool"):
                load_model(v1_dir, read_weights=mc.pool_weights(pool, v1_dir))


def test_bad_arguments_exit_with_one_line(models, tmp_path, capsys):
    controller = free_address()
    with pytest.raises(SystemExit) as exc:
        main(["pool", "put-model", str(models["qwen3_moe"]), "--controller", controller, "--max-bytes", "lots"])
    assert exc.value.code == 2
    assert "not a byte count" in capsys.readouterr().err
    # no live server: one line, exit 1, nothing hangs past the timeout
    assert main(["pool", "put-model", str(models["qwen3_moe"]), "--controller", controller, "--timeout", "0.3"]) == 1
    assert "no live server" in capsys.readouterr().err
