"""The registered family is a real MLflow model: MLflow loads it by alias, describes it, and it answers on a
chosen budget; one version per format with aliases and tags to select by. Against a real MLflow server."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NAME = "pyfunc-test"
INPUTS = [
    "messages",
    "prompt",
    "budget",
    "max_tokens",
    "reasoning_budget",
    "think_model",
    "temperature",
    "top_p",
    "seed",
    "n",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
]
OUTPUTS = [
    "text", "reasoning", "budget", "think_model", "finish_reason", "prompt_tokens", "reasoning_tokens",
    "completion_tokens", "tool_calls", "choices",
]  # fmt: skip
QUESTION = [{"role": "user", "content": "7+5*3-2"}]


@pytest.fixture(scope="module")
def registered(mlflow_server, tiny_nested_checkpoint, tmp_path_factory):
    """The tiny nested checkpoint and an FP8 copy registered as one family (versions 1 and 2), promoted."""
    from components.register import RegisterConfig, run_register
    from components.settings import MlflowStore
    from components.tracking import MlflowTracker
    from model.elastic.export import read_elastic
    from model.quant.quantize import quantize_checkpoint

    fp8 = quantize_checkpoint(tiny_nested_checkpoint, tmp_path_factory.mktemp("fp8") / "nested", "fp8")
    budgets = [
        {"name": b.name, "architecture": b.architecture.to_dict(), "total_params": b.total_params}
        | {"active_params": b.active_params, "fraction": b.fraction, "accuracy": 0.5}
        for b in read_elastic(tiny_nested_checkpoint).budgets
    ]
    cfg = RegisterConfig(
        model_name=NAME, checkpoint_uri=str(tiny_nested_checkpoint), budgets=budgets, formats={"fp8": str(fp8)}
    )
    with MlflowTracker(mlflow_server, "pyfunc-test", run_name="register") as tracker:
        out = run_register(cfg, tracker)
    # mlflow.pyfunc.load_model("models:/...") looks the store up process-wide; the scope puts back exactly what
    # was there (an unset URI stays unset), so later tests still see MLFLOW_TRACKING_URI.
    with MlflowStore.of(mlflow_server).process_wide():
        yield {"out": out, "budgets": budgets, "fp8": Path(fp8), "run_id": tracker.run_id}


@pytest.fixture(scope="module")
def champion(registered):
    import mlflow

    return mlflow.pyfunc.load_model(f"models:/{NAME}@champion")


def test_one_version_per_format_with_aliases_and_tags(registered, mlflow_server):
    from mlflow import MlflowClient

    out = registered["out"]
    assert out["promoted"] and out["versions"] == {"dense": "1", "fp8": "2"}
    assert out["aliases"] == {"champion": "1", "champion-fp8": "2"}
    client = MlflowClient(mlflow_server, registry_uri=mlflow_server)
    assert client.get_model_version_by_alias(NAME, "champion").version == "1"
    assert client.get_model_version_by_alias(NAME, "champion-fp8").version == "2"
    dense, fp8 = client.get_model_version(NAME, "1"), client.get_model_version(NAME, "2")
    assert (dense.tags["format"], fp8.tags["format"]) == ("dense", "fp8")
    for mv in (dense, fp8):
        assert mv.tags["formats"] == "dense,fp8"
        assert (mv.tags["version.dense"], mv.tags["version.fp8"]) == ("1", "2")
        assert mv.tags["budgets"] == "full,medium,small"
        assert mv.tags["promotion"] == "promoted"
        assert mv.run_id == registered["run_id"] and mv.source.startswith("models:/m-")  # a logged model
        for b in registered["budgets"]:
            assert mv.tags[f"budget.{b['name']}.active_params"] == str(b["active_params"])
    assert dense.tags["budget.small.accuracy"] == "0.5"
    assert "budget.small.accuracy" not in fp8.tags  # accuracy was measured on the dense weights only
    outputs = {m.model_id for m in client.get_run(registered["run_id"]).outputs.model_outputs}
    assert outputs == {mv.source.removeprefix("models:/") for mv in (dense, fp8)}  # both link to the run


def test_get_model_info_describes_a_pyfunc(registered):
    import mlflow

    info = mlflow.models.get_model_info(f"models:/{NAME}@champion")
    assert "python_function" in info.flavors
    (request,) = info.signature.inputs.inputs  # one object per request, typed by GenerationRequest
    assert sorted(p.name for p in request.type.properties) == sorted(INPUTS)
    assert not any(p.required for p in request.type.properties)
    (result,) = info.signature.outputs.inputs
    assert sorted(p.name for p in result.type.properties) == sorted(OUTPUTS)
    assert info.saved_input_example_info is not None


def test_the_checkpoint_lives_inside_the_model(registered, tiny_nested_checkpoint, tmp_path):
    import mlflow

    from components.model_uri import checkpoint_folder, resolve_model_uri

    local = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}@champion", dst_path=str(tmp_path / "m")))
    assert (local / "MLmodel").is_file() and (local / "code" / "components" / "mlflow_model.py").is_file()
    inside = checkpoint_folder(local)
    for f in ("model.safetensors", "config.json", "manifest.json", "tokenizer.json", "tokenizer_config.json"):
        assert (inside / f).read_bytes() == (tiny_nested_checkpoint / f).read_bytes(), f
    server = mlflow.get_tracking_uri()
    fp8 = resolve_model_uri(f"models:/{NAME}@champion", server, tmp_path / "cache", fmt="fp8")
    assert (fp8 / "model.safetensors").read_bytes() == (registered["fp8"] / "model.safetensors").read_bytes()
    assert fp8.is_relative_to(tmp_path / "cache" / f"{NAME}-v2")
    with pytest.raises(ValueError, match="no nvfp4 sibling; its family has formats dense,fp8"):
        resolve_model_uri(f"models:/{NAME}@champion", server, fmt="nvfp4")
    with pytest.raises(ValueError, match="has no alias 'best'"):
        resolve_model_uri(f"models:/{NAME}@best", server)


def test_champion_answers_on_a_chosen_budget(champion, tiny_nested_checkpoint):
    """A completion prompt that opens the thinking, on budget ``small``: exactly what the project's own
    budget control decodes on the same checkpoint (greedy)."""
    from components.serving.config import ServingConfig
    from components.serving.loading import LoadedModel
    from model.generate import SamplingParams
    from model.phases import budget_control

    prompt = "<bos>Q:7+5*3-2\n<think>"
    (out,) = champion.predict([{"prompt": prompt, "budget": "small", "max_tokens": 12, "reasoning_budget": 16}])
    loaded = LoadedModel.load(tiny_nested_checkpoint, ServingConfig())
    tok = loaded.tokenizer
    (ref,) = budget_control(
        loaded.registry, "small", "small", loaded.tokens, [tok.encode(prompt)], 16, 12, SamplingParams(temperature=0)
    )
    answer = ref.answer_tokens[:-1] if ref.answer_stop == "stop_id" else ref.answer_tokens
    assert out.budget == out.think_model == "small"
    assert out.text == tok.decode(answer, skip_special=True)
    assert out.reasoning == tok.decode(ref.think_tokens, skip_special=True)
    assert out.reasoning_tokens == ref.think_generated <= 16
    assert out.completion_tokens == ref.think_generated + len(ref.answer_tokens)
    assert out.finish_reason == ("length" if ref.answer_stop == "length" else "stop")
    assert out.prompt_tokens == len(tok.encode(prompt))


def test_chat_rows_go_through_the_chat_template(champion):
    tok = champion.unwrap_python_model().loaded.tokenizer
    rendered = tok.render_chat(QUESTION, add_generation_prompt=True)
    assert rendered.endswith("<think>")  # the demo template opens the thinking itself
    chat, completion = champion.predict(
        [
            {"messages": QUESTION, "budget": "medium", "max_tokens": 8, "reasoning_budget": 8},
            {"prompt": rendered, "budget": "medium", "max_tokens": 8, "reasoning_budget": 8},
        ]
    )
    assert chat.model_dump() == completion.model_dump()


def test_dataframe_rows_with_different_budgets_and_elastic_control(champion):
    import pandas as pd

    rows = pd.DataFrame(
        [
            {"messages": QUESTION, "budget": "full", "think_model": "small", "max_tokens": 6, "reasoning_budget": 6},
            {"messages": QUESTION, "budget": "medium", "think_model": "medium", "max_tokens": 4, "reasoning_budget": 0},
        ]
    )
    elastic, direct = champion.predict(rows)
    assert (elastic.budget, elastic.think_model) == ("full", "small")
    assert (direct.budget, direct.think_model, direct.reasoning_tokens, direct.reasoning) == ("medium", "medium", 0, "")
    tok = champion.unwrap_python_model().loaded.tokenizer
    for out in (elastic, direct):  # no special token or reasoning marker in returned text
        assert tok.contains_special(out.text + out.reasoning) == []
        assert "<think>" not in out.text + out.reasoning and "</think>" not in out.text + out.reasoning


def test_requests_of_both_kinds_in_one_call(champion):
    chat, plain = champion.predict(
        [
            {"messages": QUESTION, "max_tokens": 3, "reasoning_budget": 2},
            {"prompt": "Q:2+2", "budget": "full", "max_tokens": 5, "seed": 3, "temperature": 0.8},
        ]
    )
    assert chat.budget == chat.think_model == "full"  # the largest budget by default
    assert chat.reasoning_tokens <= 2 and chat.completion_tokens - chat.reasoning_tokens <= 3
    assert plain.reasoning is None and plain.think_model is None and plain.reasoning_tokens == 0
    assert 1 <= plain.completion_tokens <= 5


def test_bad_requests_name_the_field(champion):
    from mlflow.exceptions import MlflowException

    with pytest.raises(ValueError, match=r"row 1: budget: unknown budget 'tiny'"):
        champion.predict([{"prompt": "Q:1", "max_tokens": 2}, {"prompt": "Q:1", "budget": "tiny", "max_tokens": 2}])
    with pytest.raises(ValueError, match="row 0: think_model / reasoning_budget: this prompt has no thinking"):
        champion.predict([{"prompt": "Q:1", "reasoning_budget": 4}])
    with pytest.raises(
        ValueError, match=r"row 0: think_model: 'full' \([0-9,]+ active parameters\) is larger than budget 'small'"
    ):
        champion.predict([{"messages": QUESTION, "budget": "small", "think_model": "full", "max_tokens": 2}])
    with pytest.raises(MlflowException, match="exactly one of messages"):
        champion.predict([{"budget": "full"}])
    with pytest.raises(MlflowException, match="max_tokens"):
        champion.predict([{"prompt": "Q:1", "max_tokens": 0}])
    with pytest.raises(MlflowException, match="bogus"):
        champion.predict([{"prompt": "Q:1", "bogus": 1}])


def test_structured_outputs_and_tool_calls(champion):
    """The server's arguments: a JSON schema the random model's answer follows, a forced tool call whose
    arguments validate, and a two-turn exchange with the call and its result in the messages."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"]}  # fmt: skip
    add = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": add}}]
    base = {"messages": QUESTION, "budget": "small", "max_tokens": 96, "reasoning_budget": 4}
    js, call, free = champion.predict(
        [
            {**base, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
            {**base, "tools": tools, "tool_choice": "add", "parallel_tool_calls": False},
            {**base, "max_tokens": 24},
        ]
    )
    jsonschema.validate(json.loads(js.text), schema)
    assert js.reasoning == free.reasoning  # the grammar constrains the answer only
    (c,) = call.tool_calls
    assert (c.name, call.finish_reason, call.text) == ("add", "stop", "")
    jsonschema.validate(json.loads(c.arguments), add)
    turn = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    messages = [*QUESTION, {"role": "assistant", "tool_calls": [turn]}, {"role": "tool", "tool_call_id": c.id,
                                                                        "content": "5"}]  # fmt: skip
    (second,) = champion.predict([{**base, "messages": messages, "tools": tools, "max_tokens": 4}])
    assert second.prompt_tokens > call.prompt_tokens + len(c.arguments)  # the call and its result are in the prompt
    with pytest.raises(ValueError, match=r"row 0: tool_choice.function.name: 'mul' is not one of the tools"):
        champion.predict([{**base, "tools": tools, "tool_choice": "mul"}])
    with pytest.raises(ValueError, match=r"row 0: response_format.json_schema.schema: cannot be enforced"):
        champion.predict([{**base, "response_format": {"type": "json_schema", "json_schema": {"schema": {"if": {}}}}}])


def test_the_fp8_champion_loads_as_fp8(registered):
    import mlflow

    model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion-fp8")
    assert model.unwrap_python_model().loaded.format == "fp8"
    (out,) = model.predict([{"messages": QUESTION, "budget": "small", "max_tokens": 4, "reasoning_budget": 4}])
    assert out.budget == "small" and out.completion_tokens >= 1


def test_a_new_champion_without_fp8_drops_the_stale_fp8_alias(registered, mlflow_server, tiny_nested_checkpoint):
    """Runs last: it moves the aliases the tests above read."""
    from mlflow import MlflowClient

    from components.register import RegisterConfig, run_register
    from components.tracking import MlflowTracker

    cfg = RegisterConfig(model_name=NAME, checkpoint_uri=str(tiny_nested_checkpoint), budgets=registered["budgets"])
    with MlflowTracker(mlflow_server, "pyfunc-test", run_name="register-again") as tracker:
        out = run_register(cfg, tracker)
    assert out["promoted"] and out["versions"] == {"dense": "3"} and out["previous_champion"] == "1"
    aliases = MlflowClient(mlflow_server, registry_uri=mlflow_server).get_registered_model(NAME).aliases
    assert aliases == {"champion": "3"}
