"""The runtime a command's options describe, and the budgets a replay asks for: the command line's
adapter (:func:`relayout.cli.arguments.runtime_config`) and the pure rules of
:mod:`relayout.planning.replay_setup` it and the replay commands call."""

import doctest

import pytest

import relayout.planning.replay_setup
from containers.errors import InputError
from relayout.cli.arguments import runtime_config
from relayout.cli.parser import build_parser
from relayout.planning.replay_setup import RuntimeRequest, check_ram, hypothesis_selection, sweep_ram_gb
from replay.model.config import RuntimeConfig

REPLAY = ["replay", "--layout", "p.json", "--trace", "t.rt", "--device", "single-nvme"]
MEASURE = ["measure", "--container", "c", "--trace", "t.rt"]


def test_the_doctests_of_the_pure_rules_hold():
    assert doctest.testmod(relayout.planning.replay_setup).failed == 0


def test_own_read_path_options_become_the_model_config_in_its_units():
    args = build_parser().parse_args([*REPLAY, "--workers", "4", "--ram-gb", "2.5", "--pin-gb", "0.5", "--dense-ms", "2",
                                      "--compute-gbps", "20", "--other-ms", "3", "--coalesce", "--coalesce-max-mb", "1",
                                      "--prefetch", "coupled", "--prefetch-experts", "3", "--prefetch-budget-mb", "7",
                                      "--source-caps", "0.5", "--page-cache-gb", "1.5", "--buffered"])
    assert runtime_config(args) == RuntimeConfig(
        ram_bytes=2_500_000_000, workers=4, batched=False, coalesce=True, coalesce_max_bytes=1_000_000, direct=False,
        pin_bytes=500_000_000, dense_seconds=0.002, compute_bytes_per_second=20e9, other_seconds_per_token=0.003,
        prefetch="coupled", prefetch_experts=3, prefetch_bytes=7_000_000, source_caps=[0.5],
        page_cache_bytes=1_500_000_000)


def test_the_harness_takes_relayout_s_own_read_path_whatever_else_is_set():
    config = runtime_config(build_parser().parse_args([*MEASURE, "--dense-ms", "0.5"]))
    assert config.workers == 8 and config.direct and config.pin_bytes == 0 and config.dense_seconds == 0.0005
    assert config == RuntimeConfig(dense_seconds=0.0005, coalesce_max_bytes=268_435_456)


def test_own_read_path_and_a_colibri_run_together_are_refused():
    args = build_parser().parse_args([*REPLAY, "--batched", "--runtime-env", "PIPE=1"])
    with pytest.raises(InputError, match="choose relayout's own read path"):
        runtime_config(args)
    with pytest.raises(InputError, match="choose relayout's own read path"):
        relayout.planning.replay_setup.runtime_config(RuntimeRequest(coalesce_max_mb=1.0, dense_ms=1.0, workers=2,
                                                            colibri_run=True, runtime_env_from="run.txt"))


def test_a_colibri_run_differs_from_the_own_read_path_and_keeps_the_compute_model():
    args = build_parser().parse_args([*REPLAY, "--runtime-env", "PIPE=1 PIPE_WORKERS=4", "--compute-gbps", "20"])
    config = runtime_config(args)
    own = runtime_config(build_parser().parse_args([*REPLAY, "--workers", "4", "--compute-gbps", "20"]))
    assert config.compute_bytes_per_second == own.compute_bytes_per_second == 20e9
    assert config != own


def test_sweep_budgets_are_shares_of_the_routed_bytes_or_as_given_and_checked():
    assert sweep_ram_gb(10_000_000_000, None, 0.0) == [0.0, 1.25, 2.5, 5.0]
    assert sweep_ram_gb(10_000_000_000, None, 2.5) == [0.0, 1.25, 2.5, 5.0]
    assert sweep_ram_gb(10_000_000_000, (3.0, 1.0), 2.5) == [3.0, 1.0]
    with pytest.raises(InputError, match="--ram-gb 11 is more than all 10 GB"):
        sweep_ram_gb(10_000_000_000, (1.0, 11.0), 0.0)
    check_ram(10_000_000_000, 10_000_000_000)


def test_the_stall_value_arm_is_always_run_and_unknown_hypotheses_are_refused():
    policies, keys = hypothesis_selection("probability,,deadline", "H3a,H5", False)
    assert policies == ("probability", "deadline", "stall-value") and keys == ("H3a", "H5")
    assert "stall-value" in hypothesis_selection("all", None, False)[0]
    with pytest.raises(InputError, match="unknown hypothesis 'H4'"):
        hypothesis_selection(None, "H2,H4", True)
