"""The /metrics text stays readable whatever a model is named."""

from gateway.metrics import Metrics


def test_a_model_name_with_quotes_backslashes_or_newlines_is_escaped():
    name = 'ti"ny\\x\nend'
    ledger = {"budget": 100, "models": {name: {"status": "loaded", "waiting_for_memory": 0, "memory": {"weights": 5, "total": 5}}}}
    worker = {"model": name, "pid": 7, "ready": True, "epoch": 1, "running": 0, "waiting": 0, "steps": 3}
    text = Metrics().render({"ready": True}, [worker], 0, ledger)
    assert 'mlxd_model_loaded{model="ti\\"ny\\\\x\\nend"} 1' in text
    assert 'mlxd_memory_charged_bytes{model="ti\\"ny\\\\x\\nend",part="weights"} 5' in text
    assert 'mlxd_worker_steps_total{model="ti\\"ny\\\\x\\nend",pid="7"} 3' in text


def test_a_worker_without_a_prefix_cache_has_no_prefix_cache_series():
    """A number a worker does not report is left out, not written as 0."""
    bare = {"model": "a", "pid": 1, "ready": True, "epoch": 1, "running": 0, "waiting": 0, "steps": 0}
    cached = dict(bare, model="b", pid=2, prefix_cache={"lookups": 4, "hits": 3})
    text = Metrics().render({"ready": True}, [bare, cached], 0)
    assert 'mlxd_prefix_cache_lookups_total{model="b",pid="2"} 4\n' in text
    assert 'pid="1"' in text and not any('pid="1"' in line for line in text.splitlines() if "prefix_cache" in line)
