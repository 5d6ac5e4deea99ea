import json

from gateway.sampling_defaults import SamplingDefaults, sampling_defaults


def config(**values) -> dict[str, bytes]:
    return {"generation_config.json": json.dumps(values).encode()}


def test_no_generation_config_keeps_the_api_defaults():
    assert sampling_defaults({}) == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                                     repetition_penalty=1.0)


def test_the_models_values_are_taken():
    defaults = sampling_defaults(config(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1,
                                        do_sample=True, max_new_tokens=100))
    assert defaults == SamplingDefaults(0.6, 0.95, 20, 0.05, 1.1)


def test_values_out_of_range_are_ignored_one_by_one():
    defaults = sampling_defaults(config(temperature=0.3, top_p=7, top_k=-1, repetition_penalty="high"))
    assert defaults == SamplingDefaults(temperature=0.3)


def test_unreadable_files_are_ignored():
    assert sampling_defaults({"generation_config.json": b"{not json"}) == SamplingDefaults()
    assert sampling_defaults({"generation_config.json": b"[1, 2]"}) == SamplingDefaults()
