"""An SSE event stays one data line whatever text a model writes into it."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.responses import sse_event


@given(st.text())
def test_any_text_is_one_data_line_that_decodes_back(text):
    event = sse_event({"text": text}, "delta").decode()
    # str.splitlines ends a line at every Unicode line break, the strictest reader there is.
    lines = event.splitlines()
    assert lines[0] == "event: delta" and lines[1].startswith("data: ") and lines[2:] == [""]
    assert json.loads(lines[1][6:]) == {"text": text}


def test_the_line_breaks_json_leaves_raw_are_escaped():
    assert sse_event({"t": "a\u2028b\u2029c\x85d"}) == b'data: {"t":"a\\u2028b\\u2029c\\u0085d"}\n\n'
