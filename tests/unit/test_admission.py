import pytest

from gateway.admission import Admission
from gateway.errors import APIError


def test_admits_up_to_the_per_client_limit_then_429():
    admission = Admission(total=10, per_client=2)
    admission.admit("a")
    admission.admit("a")
    with pytest.raises(APIError) as e:
        admission.admit("a")
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    admission.admit("b")  # another client is not affected


def test_the_total_limit_is_503():
    admission = Admission(total=2, per_client=5)
    admission.admit("a")
    admission.admit("b")
    with pytest.raises(APIError) as e:
        admission.admit("c")
    assert e.value.status == 503 and e.value.code == "overloaded"


def test_release_counts_out_once():
    admission = Admission(total=1, per_client=1)
    release = admission.admit("a")
    release()
    release()
    assert admission.total == 0 and "a" not in admission.by_client
    admission.admit("a")
