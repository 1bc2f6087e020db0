"""Fixtures shared by every test area, and the test tiers.

Every test gets exactly one tier marker, by what it starts (docs/testing.md):
  unit        this process only: no process started, no model built (`make test-quick` runs these)
  model       torch work in this process (a tiny model built or loaded, kernels compiled and run) or a short
              helper process (`python -c` checks, the compiler); no engine, no server
  engine      engine processes (a master and its worker ranks) or worlds of ranks (gloo, transfer peers)
  deployment  several processes serving together: TEs with job executors, `meshserve serve`, memory pools,
              cluster managers, Ray
  bench       a benchmark command run end to end (tests/bench)
A module's tier is its folder's (FOLDER_TIERS) unless TIER_EXCEPTIONS names the module or one of its tests;
a fixture in FIXTURE_TIERS raises a test to at least that tier; in tests/bench every tier above unit is
`bench`. The tests run cheapest tier first, each module whole on one pytest-xdist worker (`--dist
loadscope`). A `unit` test that starts a process fails (`forbid_processes`).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import multiprocessing.process
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Two pytest workers run at once and each may run an engine of up to four ranks: more torch threads than
# cores. OpenMP's default wait spins, so a thread waiting at a parallel region's barrier burns the core
# another process needs (the engine tests ran about 30% longer). Set before torch loads in this process and
# inherited by every process the tests start; an environment that sets it keeps its own.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# For the same reason an engine a test starts without `num_threads` gives each rank one torch thread rather
# than the machine's cores (the engine tests ran about 25% faster: 165 s against 124 s for three modules).
# This process keeps torch's own count: the in-process kernel tests run their threaded paths.
os.environ.setdefault("MESHSERVE_NUM_THREADS", "1")

TESTS_DIR = Path(__file__).parent
# by what a test may start, least first: a test takes the highest tier any of its rules gives it
TIERS = ("unit", "model", "engine", "deployment", "bench")
BENCH_FOLDER = "bench"

FOLDER_TIERS = {
    "": "unit",  # the modules directly under tests/
    "bench": "unit",
    "cluster": "deployment",
    "config": "unit",
    "core": "unit",
    "docs": "deployment",  # test_docs.py runs the guide's commands, servers included
    "e2e": "deployment",
    "engine": "engine",
    "entrypoints": "unit",
    "entrypoints/openai": "unit",
    "layers": "model",
    "models": "model",
    "moe": "engine",
    "parallel": "unit",
    "pool": "unit",
    "quant": "model",
    "router": "unit",
    "sim": "unit",
    "structured_output": "unit",
    "train": "model",
    "transfer": "unit",
    "utils": "unit",
    "worker": "engine",
}

# Modules ("folder/test_x.py") and single tests ("folder/test_x.py::test_name", every parametrization) whose
# tier is not their folder's.
TIER_EXCEPTIONS = {
    "sim/test_calibrate.py": "engine",  # fits a profile from the real engine's steps
    **dict.fromkeys([
        "cluster/test_autoscaler.py",
        "cluster/test_dram_preload.py",
        "docs/test_blocks.py",
        "docs/test_dependencies.py",
        "docs/test_links.py",
        "engine/test_protocol.py",
        "engine/test_client_core.py",
        "engine/test_detokenizer.py",
        "engine/test_output_processor.py",
        "engine/test_sampler.py",
        "models/test_draft_vocab.py",
        "worker/test_step_agreement.py",
        "worker/test_worker_wakeup.py",
        "moe/test_eplb.py",
    ], "unit"),
    **dict.fromkeys([
        "config/test_config.py::test_the_config_package_imports_no_torch",
        "engine/test_sampler.py::test_temperature_sampling_matches_softmax",  # many draws: statistics
        "engine/test_sampler.py::test_top_k_and_top_p_renormalise_the_kept_tokens",
        "entrypoints/test_cli_parser.py::test_building_the_command_line_imports_no_torch",
        "entrypoints/openai/test_api_auth.py::test_serve_refuses_to_start_beyond_loopback_without_a_key",
        "entrypoints/openai/test_api_auth.py::test_the_eplb_cli_sends_the_admin_key",
        "router/test_deployment.py::test_cli_reports_a_bad_preset_in_one_line",
        "router/test_length_predictor.py",  # trains the predictor
        "test_layering.py::test_the_import_contracts_are_kept",
        "transfer/test_shm_sweep.py",
        "utils/test_cluster_auth.py::test_default_secret_file_is_created_private_and_shared",
        "utils/test_entry_points.py::test_the_runner_refuses_what_the_table_does_not_name",
        "utils/test_entry_points.py::test_an_exit_without_teardown_keeps_what_a_normal_exit_does",
        "utils/test_page_cache.py",
        "worker/test_spec_decode.py",
    ], "model"),
    **dict.fromkeys([
        "entrypoints/test_predictor_cli.py::test_predictor_train_end_to_end_on_a_micro_model",  # its outputs
        "models/test_fp8_checkpoint.py::test_engine_serves_an_fp8_checkpoint_as_its_dequantized_weights",
        "models/test_oproj_parallel.py",
        "models/test_parallel_models.py",
        "parallel/test_rollback.py::test_a_timed_out_collective_is_rolled_back_on_new_groups",
        "models/test_w8a8.py::test_engine_serves_int8_alike_on_dp2_ep2",
        "models/test_w8a8.py::test_engine_serves_int8_alike_on_tp2",
        "models/test_w8a8.py::test_engine_rounds_a_float_checkpoint_with_the_quantization_flag",
        "models/test_w8a8.py::test_mtp_drafts_on_a_w8a8_checkpoint_keep_the_greedy_tokens",
        "test_layering.py::test_a_serving_master_has_no_torch_loaded",
        "transfer/test_transfer_engine.py",
    ], "engine"),
    **dict.fromkeys([
        "entrypoints/openai/test_api.py::test_run_server_serves_and_stops_cleanly_on_signals",
        "entrypoints/openai/test_context_caches.py",
        "entrypoints/openai/test_tenant_connections.py",
        "entrypoints/openai/test_http_framing.py::test_ambiguous_framing_is_400_and_the_connection_closed",
        "entrypoints/openai/test_http_framing.py::test_one_reading_of_the_framing_is_still_served",
        "entrypoints/openai/test_http_framing.py::test_a_head_h11_cannot_parse_gets_openai_json",
        "entrypoints/openai/test_server_limits.py::test_a_body_declared_too_large_is_413",
        "entrypoints/openai/test_server_limits.py::test_a_chunked_body_that_grows_too_large_is_413",
        "entrypoints/openai/test_server_limits.py::test_a_body_shorter_than_its_content_length_is_408_not_a_hang",
        "entrypoints/openai/test_server_limits.py::test_headers_that_never_finish_are_408_and_closed",
        "entrypoints/openai/test_server_limits.py::test_connections_beyond_the_cap_are_503",
        "entrypoints/openai/test_server_limits.py::"
        "test_sigterm_lets_short_streams_finish_and_ends_long_ones_with_an_error_and_done",
        "pool/test_controller.py::test_controller_process_over_zmq",
        "pool/test_model_cache.py",
        "pool/test_pool_auth.py::test_a_server_without_the_secret_cannot_register",
        "pool/test_pool_auth.py::test_the_cli_without_the_secret_is_refused_at_once",
        "pool/test_sdk.py::test_pool_round_trip_failover_restart_and_quotas",
        "pool/test_server.py",
        "router/test_je_hold_and_reports.py",
        "router/test_kv_int8_pd.py",
        "router/test_link_failover_e2e.py",
        "router/test_locality_routing.py",
        "router/test_migration.py",
        "router/test_pd_deployment.py",
        "router/test_pd_structured.py",
        "router/test_router_hardening.py",
        "router/test_self_contained_te.py",
    ], "deployment"),
    **dict.fromkeys([
        "bench/test_a2e_bench.py::test_a_quick_run_writes_rows_ratios_and_a_png",
        "bench/test_disagg_bench.py::test_a_quick_run_compares_every_layout_and_draws_the_domains_taking_turns",
        "bench/test_calibrate.py::test_calibrate_writes_a_cluster_file_that_plan_reads",
        "bench/test_decode_step_bench.py",
        "bench/test_eplb_bench.py::test_bench_eplb_writes_json_png_and_tables",
        "bench/test_eplb_bench.py::test_bench_eplb_layer_time_only_writes_times_rows_and_ratios",
        "bench/test_microbatch_bench.py::test_a_quick_run_writes_rows_a_timeline_and_a_png",
        "bench/test_roofline.py::test_machine_measurements_are_positive_and_finite",  # the native kernels
        "bench/test_roofline.py::test_total_params_match_hf_transformers",
        "bench/test_transfer_bench.py::test_transfer_bench_measures_every_backend_and_size",
    ], "bench"),
}

# a test using one of these fixtures (directly or through another fixture) is at least of this tier
FIXTURE_TIERS = {
    "tiny_model": "model",
    "hf_tiny_dir": "model",  # bench/test_offline.py: a transformers model
    "ray_address": "deployment",
}


def folder_of(path: Path) -> str:
    return path.parent.relative_to(TESTS_DIR).as_posix().removeprefix(".")


def module_key(path: Path) -> str:
    return path.relative_to(TESTS_DIR).as_posix()


def tier_of(path: Path, test_name: str, fixture_names: tuple[str, ...] = ()) -> str | None:
    """The tier of test `test_name` of module `path` using `fixture_names`; None when its folder has none."""
    module = module_key(path)
    base = TIER_EXCEPTIONS.get(f"{module}::{test_name}") or TIER_EXCEPTIONS.get(module) or \
        FOLDER_TIERS.get(folder_of(path))
    if base is None:
        return None
    tier = max([base, *(FIXTURE_TIERS[name] for name in fixture_names if name in FIXTURE_TIERS)], key=TIERS.index)
    return "bench" if folder_of(path) == BENCH_FOLDER and tier != "unit" else tier


def may_hold_unit_tests(path: Path) -> bool:
    """Whether module `path` can hold a `unit` test: fixtures only raise a tier, exceptions of tests may lower it."""
    module = module_key(path)
    base = TIER_EXCEPTIONS.get(module) or FOLDER_TIERS.get(folder_of(path))
    return base in (None, "unit") or any(key.startswith(f"{module}::") and tier == "unit"
                                         for key, tier in TIER_EXCEPTIONS.items())


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With `-m unit` alone (`make test-quick`), a module that can hold no unit test is not even imported."""
    if config.option.markexpr != "unit" or collection_path.suffix != ".py" or \
            not collection_path.name.startswith("test_"):
        return None
    return None if may_hold_unit_tests(collection_path) else True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = {}
    for item in items:
        if any(item.get_closest_marker(name) for name in TIERS):
            raise pytest.UsageError(f"{item.nodeid}: tiers come from tests/conftest.py, not from a marker in the file")
        tier = tier_of(item.path, item.originalname, tuple(item.fixturenames))
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: folder {folder_of(item.path)!r} has no test tier: "
                                    "add it to FOLDER_TIERS in tests/conftest.py")
        item.add_marker(tier)
        tiers[item.nodeid] = TIERS.index(tier)
    # one process: the cheapest tiers first (a failure shows early). Under pytest-xdist (`make test`, with
    # --no-loadscope-reorder) the costliest first, so that both workers end on short unit modules rather
    # than one waiting on the other's last deployment. Each tier in the order collected: a stable sort.
    costliest_first = hasattr(config, "workerinput")
    items.sort(key=lambda item: -tiers[item.nodeid] if costliest_first else tiers[item.nodeid])


# ---------------------------------------------------------------- no process from a unit test
class ProcessInUnitTestError(RuntimeError):
    """A `unit` test (or a fixture it uses) tried to start a process."""


@functools.cache
def _list_fonts() -> None:
    """matplotlib lists the system's fonts with `fc-list` the first time it draws on a machine (then caches them on
    disk): not the test's doing either."""
    import matplotlib.font_manager  # noqa: F401 - the import builds the font list


@contextlib.contextmanager
def forbid_processes(attempts: list[str]) -> Iterator[None]:
    """Every way this process could start another raises ProcessInUnitTestError (and is noted in `attempts`)."""
    def refusing(what: str) -> Callable:
        def refuse(*args, **kwargs):
            attempts.append(what)
            raise ProcessInUnitTestError(f"a `unit` test may not start a process ({what}): give the test a tier "
                                         "in tests/conftest.py (TIER_EXCEPTIONS)")
        return refuse

    platform.processor()  # runs `uname -p` once per process (then cached): not the test's doing
    _list_fonts()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refusing("subprocess"))  # run, check_output, asyncio
        patch.setattr(multiprocessing.process.BaseProcess, "start", refusing("multiprocessing"))  # every context
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                patch.setattr(os, name, refusing(f"os.{name}"))
        yield


# the processes a `unit` test tried to start in the current phase (setup, call)
PROCESS_ATTEMPTS = pytest.StashKey[list[str]]()


@contextlib.contextmanager
def _guarded(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("unit") is None:
        yield
        return
    attempts = item.stash[PROCESS_ATTEMPTS] = []
    with forbid_processes(attempts):
        yield
    if attempts:  # also when the test caught the error
        pytest.fail(f"{item.nodeid} is a `unit` test but started a process ({', '.join(attempts)})", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if any(item.get_closest_marker(tier) for tier in RANK_TEMPLATE_TIERS):
        _rank_template.ensure_running()
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _guarded(item):
        return (yield)


# ---------------------------------------------------------------- one rank template per pytest process
# the tiers whose tests may start engines: their engines' forkservers fork from the template
RANK_TEMPLATE_TIERS = ("engine", "deployment", "bench")
_RANK_TEMPLATE_START_S = 30.0


class RankTemplate:
    """This pytest process's rank template (`meshserve rank-template`): started before its first test that may
    start an engine and named in MESHSERVE_RANK_TEMPLATE, which every process started later inherits, so
    each engine's forkserver is forked with torch already imported (about 5 s of CPU less per engine start;
    a run starts a few hundred). An environment that already names a template keeps it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None

    def ensure_running(self) -> None:
        if self.proc is not None or os.environ.get("MESHSERVE_RANK_TEMPLATE"):
            return
        from meshserve.utils.processes import launch

        self.dir = tempfile.mkdtemp(prefix="meshserve-rank-template-")
        socket_path = os.path.join(self.dir, "socket")
        self.proc = launch("rank-template", socket_path=socket_path, parent_pid=os.getpid(),
                           log_level=logging.WARNING)
        deadline = time.monotonic() + _RANK_TEMPLATE_START_S
        while not os.path.exists(socket_path):  # bound at once; the imports that follow hold requests back
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rank template did not start (exit status {self.proc.poll()})")
            time.sleep(0.05)
        os.environ["MESHSERVE_RANK_TEMPLATE"] = socket_path

    def stop(self) -> None:
        if self.proc is None:
            return
        from meshserve.utils.processes import stop_process

        os.environ.pop("MESHSERVE_RANK_TEMPLATE", None)
        self.proc.terminate()
        stop_process(self.proc, grace_s=5.0)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.proc = None


_rank_template = RankTemplate()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _rank_template.stop()


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """`tiny_model(arch="deepseek_v3", preset="tiny", *, seed=0, overrides=None, name="model")`: the directory
    of a random HF checkpoint (meshserve.models.factory.make_model), written once per session for each
    distinct set of arguments. Tests only read it; one that changes a checkpoint makes its own."""
    # imported here so that collecting the tests that need no model stays free of torch
    from meshserve.models.factory import make_model

    made: dict[str, Path] = {}

    def make(arch: str = "deepseek_v3", preset: str = "tiny", *, seed: int = 0, overrides: dict | None = None,
             name: str = "model") -> Path:
        key = json.dumps([arch, preset, seed, overrides, name], sort_keys=True)
        if key not in made:
            out_dir = tmp_path_factory.mktemp(f"{arch}-{preset}") / name
            made[key] = make_model(arch, preset, out_dir, seed=seed, overrides=overrides)
        return made[key]

    return make
