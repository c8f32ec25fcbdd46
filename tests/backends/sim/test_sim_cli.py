import shlex

import pytest

from backends.sim.cli import build_parser, config_from_args, main
from backends.sim.config import DEFAULT_MODEL, Faults, SimConfig

ALL_FLAGS = """
    --name a --model m1 --model m2 --prefill-tps 1000 --ttft-base-ms 5 --decode-tps 30 --decode-slowdown 0.1
    --cache-tokens 4096 --block-size 32 --max-running 4 --time-scale 0 --seed 7 --reasoning
    --reasoning-tokens 3:9 --answer-tokens 5 --fail-next 2 --die-mid-stream-after 3 --stall-s 0.5
    --repeat-token --health-fail
"""


def test_defaults_match_the_config_defaults() -> None:
    cfg = config_from_args(build_parser().parse_args([]))
    assert cfg == SimConfig(name="sim", models=(DEFAULT_MODEL,))


def test_flags_fill_the_config() -> None:
    cfg = config_from_args(build_parser().parse_args(shlex.split(ALL_FLAGS)))
    assert cfg.models == ("m1", "m2") and cfg.name == "a"
    assert (cfg.prefill_tps, cfg.ttft_base_ms, cfg.decode_tps, cfg.decode_slowdown) == (1000, 5, 30, 0.1)
    assert (cfg.cache_tokens, cfg.block_size, cfg.max_running) == (4096, 32, 4)
    assert (cfg.time_scale, cfg.seed) == (0, 7)
    assert cfg.reasoning and cfg.reasoning_tokens == (3, 9) and cfg.answer_tokens == (5, 5)
    assert cfg.faults == Faults(2, 3, 0.5, True, True)


@pytest.mark.parametrize("argv", [["--block-size", "0"], ["--answer-tokens", "x:y"], ["--fail-next", "-1"]])
def test_invalid_values_exit_with_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err
