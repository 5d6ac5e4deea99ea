import pytest

from gateway.errors import APIError, convert, decode_body, error_payload
from gateway.openai_responses_schema import InputImage
from gateway.openai_schema import ChatCompletionRequest


def error_of(body: bytes) -> APIError:
    with pytest.raises(APIError) as e:
        decode_body(body, ChatCompletionRequest)
    return e.value


def test_malformed_json():
    error = error_of(b"{")
    assert error.status == 400 and error.code == "invalid_json"


def test_an_unknown_field_is_named():
    error = error_of(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}')
    assert error.code == "unsupported_parameter" and error.param == "frobnicate"
    assert "frobnicate" in error.message


def test_a_value_out_of_range_names_its_path():
    error = error_of(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9}')
    assert error.param == "temperature"


def test_a_missing_field():
    assert error_of(b'{"messages": []}').status == 400


def scope(path: str, *headers: tuple[bytes, bytes]) -> dict:
    return {"path": path, "headers": list(headers)}


def test_error_payloads_follow_the_api_of_the_request():
    assert b'"type":"error"' in error_payload(scope("/v1/messages"), 404, "no", "not_found_error")
    assert b'"param":null' in error_payload(scope("/v1/chat/completions"), 404, "no", "not_found_error")
    assert b'"error":"no"' in error_payload(scope("/api/chat"), 404, "no", "not_found_error")
    # /v1/models is both APIs': Anthropic's SDKs say which with their version header.
    assert b'"param":null' in error_payload(scope("/v1/models/x"), 404, "no", "not_found_error")
    anthropic = scope("/v1/models/x", (b"anthropic-version", b"2023-06-01"))
    assert b'"type":"error"' in error_payload(anthropic, 404, "no", "not_found_error")


def test_openai_error_types_by_status():
    from gateway.errors import openai_error_type

    assert [openai_error_type(s) for s in (400, 404, 405, 499, 500, 503)] == [
        "invalid_request_error", "not_found_error", "invalid_request_error", "cancelled", "server_error",
        "service_unavailable"]


def test_an_empty_stop_string_is_refused():
    from gateway.plan import nonempty_stops

    assert nonempty_stops(["a", "b"], "stop") == ["a", "b"]
    with pytest.raises(APIError) as e:
        nonempty_stops(["a", ""], "stop_sequences")
    assert e.value.status == 400 and e.value.param == "stop_sequences"


def test_values_the_spec_allows_in_the_forms_clients_write_them():
    body = decode_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2.0, "seed": 3.0,'
                       b' "stream": null, "top_p": 0, "max_tokens": "8"}', ChatCompletionRequest)
    assert (body.n, body.seed, body.stream, body.top_p, body.max_tokens) == (2, 3, None, 0, 8)


@pytest.mark.parametrize("field", ['"n": 1.5', '"stream": "yes"', '"top_p": 1.5', '"max_tokens": "many"'])
def test_values_that_do_not_convert_exactly_are_still_refused(field):
    error = error_of(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], ' + field.encode() + b"}")
    assert error.status == 400 and error.param == field.split('"')[1]


@pytest.mark.parametrize("detail", ["auto", "low", "high", "original"])
def test_every_image_detail_of_the_responses_api_is_taken(detail):
    """The SDK requires `detail` on an input image; "original" is one of the spec's values."""
    image = convert({"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": detail}, InputImage,
                    "input[0].content[0]")
    assert image.detail == detail
