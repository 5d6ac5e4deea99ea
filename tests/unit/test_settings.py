import argparse

import msgspec
import pytest

from gateway.settings import GatewaySettings
from protocol.settings import add_arguments, explicit_values, resolve, to_arguments, to_environment
from protocol.worker_settings import DEFAULT_MODEL_NAME, WorkerSettings, announced_name, model_workers


def parsed(settings_type, argv: list[str], environ: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, settings_type)
    return resolve(settings_type, parser.parse_args(argv), environ or {})


def test_flags_win_over_variables_which_win_over_defaults():
    settings = parsed(GatewaySettings, ["--port", "9000"], {"MLXD_PORT": "9001", "MLXD_DRAIN_S": "3"})
    assert settings.port == 9000 and settings.drain_s == 3.0 and settings.host == "127.0.0.1"


def test_lists_take_repeats_and_commas():
    settings = parsed(GatewaySettings, ["--api-key", "a,b", "--api-key", "c"])
    assert settings.api_key == ["a", "b", "c"]
    assert parsed(GatewaySettings, [], {"MLXD_API_KEYS": "x, y"}).api_key == ["x", "y"]


@pytest.mark.parametrize("argv, environ, named", [
    (["--port", "70000"], {}, "--port / MLXD_PORT"),
    ([], {"MLXD_PORT": "abc"}, "--port / MLXD_PORT"),
    (["--log-level", "verbose"], {}, "--log-level / MLXD_LOG_LEVEL"),
    (["--stream-keepalive-s", "0.001"], {}, "--stream-keepalive-s / MLXD_STREAM_KEEPALIVE_S"),
    (["--max-body-bytes", "8 megs"], {}, "--max-body-bytes / MLXD_MAX_BODY_BYTES"),
])
def test_a_bad_value_names_its_flag_and_variable(argv, environ, named):
    with pytest.raises(ValueError, match=f"^{named}: "):
        parsed(GatewaySettings, argv, environ)


def test_byte_settings_take_sizes():
    """As --memory-budget does: --prefix-cache-bytes 1M was "Expected `int`, got `str`"."""
    settings = parsed(WorkerSettings, ["--model", "m", "--prefix-cache-bytes", "1M"], {"MLXD_PREFIX_CACHE_DISK_BYTES": "2G"})
    assert (settings.prefix_cache_bytes, settings.prefix_cache_disk_bytes) == (1 << 20, 2 << 30)
    assert parsed(WorkerSettings, ["--model", "m", "--prefix-cache-bytes", "4096"]).prefix_cache_bytes == 4096


def test_booleans_take_a_no_form():
    assert parsed(WorkerSettings, ["--no-cpu-dequantize"]).cpu_dequantize is False


def test_arguments_and_environment_reproduce_the_settings():
    settings = parsed(WorkerSettings, ["--model", "m", "--max-batch", "4", "--no-cpu-dequantize"])
    assert parsed(WorkerSettings, to_arguments(settings)) == settings
    assert parsed(WorkerSettings, [], to_environment(settings)) == settings


def test_settings_at_their_defaults_are_not_written_out():
    assert explicit_values(GatewaySettings()) == []
    assert to_environment(GatewaySettings(port=1)) == {"MLXD_PORT": "1"}


def test_the_announced_name():
    assert announced_name(WorkerSettings()) == DEFAULT_MODEL_NAME
    assert announced_name(WorkerSettings(model="org/model")) == "org/model"


def test_each_models_group_listens_on_ports_of_its_own():
    """Two models' groups on one --distributed-port joined each other's ranks, as they happened to start."""
    base = WorkerSettings(distributed_hosts="127.0.0.1,127.0.0.1", distributed_port=40000)
    assert [(w.model, w.distributed_port) for w in model_workers(base, ["a=/m/a", "b=/m/b", "c=/m/c"])] == [
        ("a=/m/a", 40000), ("b=/m/b", 40002), ("c=/m/c", 40004)]
    assert [w.distributed_port for w in model_workers(WorkerSettings(), ["a=/m/a", "b=/m/b"])] == [32323, 32323]
    with pytest.raises(ValueError, match="past 65535"):
        model_workers(msgspec.structs.replace(base, distributed_port=65534), ["a=/m/a", "b=/m/b"])
