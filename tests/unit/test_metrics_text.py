"""The /metrics text stays readable whatever a model is named."""

from gateway.metrics import Metrics


def test_a_model_name_with_quotes_backslashes_or_newlines_is_escaped():
    name = 'ti"ny\\x\nend'
    ledger = {"budget": 100, "models": {name: {"status": "loaded", "memory": {"weights": 5, "total": 5}}}}
    text = Metrics().render({"state": "ready"}, None, ledger)
    assert 'mlxd_model_loaded{model="ti\\"ny\\\\x\\nend"} 1' in text
    assert 'mlxd_memory_charged_bytes{model="ti\\"ny\\\\x\\nend",part="weights"} 5' in text
