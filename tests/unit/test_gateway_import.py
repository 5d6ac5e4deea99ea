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


# A worker's Hello can come while the gateway's start still imports transformers in a thread.
RACE = """
import threading, time
import gateway.tokenizer as tokenizer
seen = []
def late():
    time.sleep(0.1)
    seen.append(hasattr(tokenizer.transformers_module(), "AutoTokenizer"))
threads = [threading.Thread(target=tokenizer.transformers_module), threading.Thread(target=late)]
for t in threads: t.start()
for t in threads: t.join()
assert seen == [True], seen
"""


def test_a_tokenizer_made_while_transformers_is_being_imported_finds_it_whole():
    """transformers puts a half-made module in sys.modules while its import runs."""
    run = subprocess.run([sys.executable, "-c", RACE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
