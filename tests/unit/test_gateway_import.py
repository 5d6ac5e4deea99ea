"""The gateway starts without importing transformers (over a second here):
`mlxd serve` imports it while its worker starts, not before starting it."""

import subprocess
import sys

from tests.conftest import ROOT


def test_the_gateway_imports_no_transformers_until_a_tokenizer_needs_it():
    probe = ("import sys, gateway.app, gateway.cli; assert 'transformers' not in sys.modules; "
             "from gateway.tokenizer import reserved_template_kwargs; assert 'tokenize' in reserved_template_kwargs()")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
