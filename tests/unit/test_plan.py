import dataclasses

import pytest

from gateway.errors import APIError
from gateway.plan import ChatInput, NamedTool, Plan, SamplingParams, template_tool_call, tool_definitions
from gateway.sampling_defaults import SamplingDefaults
from gateway.structured import answer_grammar

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}


def test_the_tool_choice_narrows_the_tools_for_the_prompt():
    assert tool_definitions([WEATHER, TIME], "auto") == [WEATHER, TIME]
    assert tool_definitions([WEATHER, TIME], "required") == [WEATHER, TIME]
    assert tool_definitions([WEATHER, TIME], "none") is None
    assert tool_definitions([WEATHER, TIME], NamedTool("time")) == [TIME]
    assert tool_definitions([], "auto") is None


@pytest.mark.parametrize("choice", ["required", NamedTool("weather")])
def test_a_forced_tool_choice_without_tools_is_a_400(choice):
    with pytest.raises(APIError) as e:
        tool_definitions([], choice)
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_a_named_tool_that_is_not_offered_is_a_400():
    with pytest.raises(APIError) as e:
        tool_definitions([WEATHER], NamedTool("stocks"))
    assert e.value.status == 400


def test_the_models_defaults_fill_what_the_body_leaves_out():
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1)
    (sampling,) = SamplingParams(temperature=0.7).samplings(defaults, 100, 16, None)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (
        0.7, 0.9, 40, 0.05, 1.1)
    assert sampling.max_tokens == 16 and sampling.grammar is None


def test_each_choice_of_a_seeded_request_has_its_own_seed():
    samplings = SamplingParams(seed=7, n=3).samplings(SamplingDefaults(), 100, 8, "grammar")
    assert [s.seed for s in samplings] == [7, 8, 9] and all(s.grammar == "grammar" for s in samplings)
    assert [s.seed for s in SamplingParams(n=2).samplings(SamplingDefaults(), 100, 8, None)] == [None, None]


def test_a_negative_top_k_means_no_top_k():
    (sampling,) = SamplingParams(top_k=-1).samplings(SamplingDefaults(top_k=40), 100, 8, None)
    assert sampling.top_k == 0


def test_logit_bias_keys_must_be_token_ids_of_the_model():
    (sampling,) = SamplingParams(logit_bias={"5": -100.0}).samplings(SamplingDefaults(), 10, 8, None)
    assert sampling.logit_bias == {5: -100.0}
    for key in ("10", "-1", "five"):
        with pytest.raises(APIError) as e:
            SamplingParams(logit_bias={key: 1.0}).samplings(SamplingDefaults(), 10, 8, None)
        assert e.value.param == "logit_bias"


def test_a_forced_tool_call_wins_over_json_output():
    """The call is the answer (OpenAI takes both; this was a 400)."""
    forced = Plan("m", ChatInput([]), SamplingParams(), [], tools=[WEATHER], force_tool_call=True)
    assert dataclasses.replace(forced, json_output=True).grammar("hermes") == forced.grammar("hermes")


def test_strict_tools_constrain_auto_calls_where_the_format_has_an_opening():
    plan = Plan("m", ChatInput([]), SamplingParams(), [], tools=[WEATHER])
    strict = dataclasses.replace(plan, strict_tools=True)
    assert plan.grammar("hermes") is None
    assert strict.grammar("hermes") == answer_grammar([WEATHER], "hermes", prose=True, several=True)
    assert dataclasses.replace(strict, parallel_tool_calls=False).grammar("hermes") == answer_grammar(
        [WEATHER], "hermes", prose=True)
    assert strict.grammar("llama3") is strict.grammar(None) is None  # bare JSON calls: no opening to find


def test_an_unconstrained_plan_has_no_grammar_and_names_its_prompt_parameter():
    assert Plan("m", "text", SamplingParams(), []).grammar("hermes") is None
    assert Plan("m", [1, 2], SamplingParams(), []).prompt_param == "prompt"
    assert Plan("m", ChatInput([]), SamplingParams(), []).prompt_param == "messages"


def test_tool_call_arguments_become_an_object_when_they_are_one():
    assert template_tool_call("c1", "f", '{"x": 1}')["function"]["arguments"] == {"x": 1}
    assert template_tool_call("c1", "f", "not json")["function"]["arguments"] == "not json"
    # A call of no arguments sent back as "": templates that iterate the arguments (Qwen3-Coder's) refused it.
    assert template_tool_call("c1", "f", "")["function"]["arguments"] == {}
    assert template_tool_call("c1", "f", "[1, 2]")["function"]["arguments"] == "[1, 2]"
    assert template_tool_call("c1", "f", {"x": 1})["function"]["arguments"] == {"x": 1}


def test_a_top_p_of_zero_is_greedy():
    (sampling,) = SamplingParams(top_p=0.0, temperature=0.8).samplings(SamplingDefaults(), 100, 8, None)
    assert (sampling.temperature, sampling.top_p) == (0.0, 1.0)
