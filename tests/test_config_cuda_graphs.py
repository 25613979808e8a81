"""``CUDA_GRAPHS``: parsed as the launcher writes it and stock's shard reads it, carried to the runner."""

from __future__ import annotations

import pytest

from integration.launcher_spawn import DEFAULT_CUDA_GRAPHS
from tgi_paged_backend.config import LAUNCHER_CUDA_GRAPHS, ConfigError, ModelConfig
from tgi_paged_backend.envs import build_config, parse_cuda_graphs, read_env


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, ()),  # unset: stock's shard captures no graphs without the variable
        ("", ()),
        ("0", ()),  # --cuda-graphs 0
        ("1,2,4,8,16,32", (1, 2, 4, 8, 16, 32)),  # the launcher's default
        ("32,1, 4", (1, 4, 32)),  # any order; blanks around a size, as Python's int() takes them
        ("0,4", (4,)),  # zeros dropped, as the launcher drops them
        ("8,8,2", (2, 8)),
    ],
)
def test_cuda_graphs_parse_as_the_launcher_writes_them(raw: str | None, expected: tuple[int, ...]) -> None:
    assert parse_cuda_graphs(raw) == expected
    env = {} if raw is None else {"CUDA_GRAPHS": raw}
    assert read_env(env).cuda_graphs == expected


@pytest.mark.parametrize("raw", ["1,,2", "x", "-1", "1.5", "4;8", "1,2,"])
def test_bad_cuda_graphs_name_the_variable_the_value_and_what_is_allowed(raw: str) -> None:
    with pytest.raises(ConfigError) as err:
        read_env({"CUDA_GRAPHS": raw})
    assert str(err.value) == (
        f"CUDA_GRAPHS={raw!r} is invalid: allowed comma-separated decode batch sizes >= 1 "
        "(e.g. 1,2,4,8,16,32), or 0 to disable"
    )


def test_the_launchers_default_round_trips_into_the_model_config() -> None:
    assert LAUNCHER_CUDA_GRAPHS == tuple(DEFAULT_CUDA_GRAPHS)
    env = {"CUDA_GRAPHS": ",".join(map(str, DEFAULT_CUDA_GRAPHS))}  # what launcher_spawn puts there
    assert build_config({"model_id": "m"}, env).model.cuda_graphs == LAUNCHER_CUDA_GRAPHS
    assert build_config({"model_id": "m"}, {}).model.cuda_graphs == ()


@pytest.mark.parametrize("bad", [(0,), (4, 2), (2, 2), (-1, 4)])
def test_model_config_checks_its_buckets(bad: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match="cuda_graphs"):
        ModelConfig(model_id="m", cuda_graphs=bad)
