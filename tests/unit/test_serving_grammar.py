"""Structured outputs and tool calls without a server: grammar masks against their slow reference, the compile
cache, schema closing, the request rules, the tool formats (grammar, parse, stream), and a batch mixing
constrained and free rows, each row getting exactly what it gets alone."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from components.data.tokenizer import TextTokenizer, build_demo_tokenizer
from components.serving.constraints import (
    ConstraintError,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    build_constraint,
)
from components.serving.grammar import (
    GrammarError,
    Grammars,
    GrammarSpec,
    allowed_reference,
    allowed_tokens,
    closed_schema,
)
from components.serving.tools import FORMATS, ToolSpec, ToolStream, tool_format
from tests.conftest import TINY
from tests.unit.data_tokenizers import chatml_bpe

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
}
WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}})
ADD = ToolSpec("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.fixture(scope="module")
def demo() -> TextTokenizer:
    return TextTokenizer(build_demo_tokenizer())


@pytest.fixture(scope="module")
def grammars(demo) -> Grammars:
    return Grammars(demo, demo.vocab_size, demo.stop_ids)


def _consume_checked(g: Grammars, spec: GrammarSpec, text: str, tok: TextTokenizer) -> None:
    """Feed ``text`` token by token; at every step the fast mask equals the reference and allows the token."""
    m = g.matcher(spec)
    ids = tok.encode(text)
    for t in [*ids, tok.eos_id]:
        fast = allowed_tokens([m], g.n_vocab)[0]
        assert torch.equal(fast, allowed_reference(m, g.n_vocab, tok.stop_ids))
        assert fast[t], (text, t)
        assert m.consume_token(t)
    assert m.is_stopped()


# ---------------------------------------------------------------------- masks and the compile cache
@pytest.mark.parametrize("which", ["demo character tokenizer", "byte-level BPE"])
def test_mask_equals_the_reference_at_every_step(which, demo):
    """Both ways of reading a tokenizer: bytes from decode (the demo's WordLevel) and llguidance's own reader."""
    tok = demo if which.startswith("demo") else TextTokenizer(chatml_bpe())
    g = Grammars(tok, tok.vocab_size + 7, tok.stop_ids)  # a model vocabulary padded past the tokenizer's
    doc = '{"name": "Ada", "age": 36, "tags": ["a"]}'
    _consume_checked(g, GrammarSpec.json_schema(PERSON, "response_format"), doc, tok)
    padded = allowed_tokens([g.matcher(GrammarSpec.json_schema(PERSON, "x"))], g.n_vocab)[0]
    assert not padded[tok.vocab_size :].any()  # ids the tokenizer does not have are never allowed


def test_json_layouts(demo):
    doc = {"name": "Ada", "age": 3, "tags": []}
    spaced = json.dumps(doc)
    compact = json.dumps(doc, separators=(",", ":"))
    for style, ok, bad in (("spaced", spaced, compact), ("compact", compact, spaced)):
        g = Grammars(demo, demo.vocab_size, demo.stop_ids, style=style)
        spec = GrammarSpec.json_schema(PERSON, "x")
        assert g.matcher(spec).validate_tokens(demo.encode(ok)) == len(demo.encode(ok))
        assert g.matcher(spec).validate_tokens(demo.encode(bad)) < len(demo.encode(bad))
    flexible = Grammars(demo, demo.vocab_size, demo.stop_ids, style="flexible")
    pretty = json.dumps(doc, indent=2)
    ids = demo.encode(pretty)
    assert flexible.matcher(GrammarSpec.json_schema(PERSON, "x")).validate_tokens(ids) == len(ids)


def test_each_grammar_compiles_once_and_copies_are_independent(demo):
    g = Grammars(demo, demo.vocab_size, demo.stop_ids, capacity=2)
    spec = GrammarSpec.json_schema(PERSON, "response_format")
    a, b = g.matcher(spec), g.matcher(GrammarSpec.json_schema(PERSON, "other.param"))  # same schema, same grammar
    stats = g.stats()
    assert (stats["compiles"], stats["cache_hits"], stats["cached"]) == (1, 1, 1)
    assert stats["compile_s_total"] > 0 and stats["compile_s_max"] <= stats["compile_s_total"]
    assert a.consume_tokens(demo.encode('{"name": "x'))  # one sequence's progress ...
    start = demo.encode('{"name"')
    assert b.validate_tokens(start) == len(start) > a.validate_tokens(start)  # ... is not the other's
    for pattern in ("[0-9]+", "[a-z]+"):  # capacity 2: the least recently used grammar (the schema) is dropped
        g.matcher(GrammarSpec("regex", pattern, "structured_outputs.regex"))
    g.matcher(GrammarSpec("regex", "[a-z]+", "x"))
    assert (g.stats()["compiles"], g.stats()["cache_hits"], g.stats()["cached"]) == (3, 2, 2)
    g.matcher(spec)  # compiled again
    assert (g.stats()["compiles"], g.stats()["cached"]) == (4, 2)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (GrammarSpec.json_schema({"type": "object", "if": {}}, "response_format.json_schema.schema"), "Unimplemented"),
        (GrammarSpec("regex", "(", "structured_outputs.regex"), "unclosed group"),
        (GrammarSpec("lark", "start: undefined_rule", "structured_outputs.grammar"), "undefined_rule"),
    ],
)
def test_a_grammar_that_does_not_compile_names_the_field(grammars, spec, fragment):
    with pytest.raises(GrammarError) as info:
        grammars.compiled(spec)
    assert info.value.param == spec.param and info.value.message.startswith(f"{spec.param}: cannot be enforced")
    assert fragment in info.value.message


def test_choice_and_regex(grammars, demo):
    _consume_checked(grammars, GrammarSpec("choice", json.dumps(["yes", "no"]), "x"), "no", demo)
    _consume_checked(grammars, GrammarSpec("regex", "[0-9]{3}", "x"), "042", demo)
    m = grammars.matcher(GrammarSpec("choice", json.dumps(["yes", "no"]), "x"))
    assert m.validate_tokens(demo.encode("maybe")) == 0


def test_closed_schema_closes_listed_objects_only():
    schema = {
        "$defs": {"N": {"type": "object", "properties": {"v": {"type": "integer"}}}},
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "object", "properties": {"w": {}}}]},
            "b": {"type": "array", "items": {"type": "object", "properties": {"x": {}}}},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
            "typed": {"type": "object", "properties": {"z": {}}, "additionalProperties": {"type": "integer"}},
        },
    }
    before = json.dumps(schema)
    out = closed_schema(schema)
    assert json.dumps(schema) == before  # a new schema; the request's is untouched
    assert out["additionalProperties"] is False
    assert out["$defs"]["N"]["additionalProperties"] is False
    assert out["properties"]["a"]["anyOf"][1]["additionalProperties"] is False
    assert out["properties"]["b"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["free"]  # no listed properties: any object
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["properties"]["typed"]["additionalProperties"] == {"type": "integer"}


# ---------------------------------------------------------------------- request rules
def _tools(*specs: ToolSpec) -> list[Tool]:
    return [
        Tool.model_validate({"type": "function", "function": {"name": s.name, "parameters": s.parameters}})
        for s in specs
    ]


def _build(**kw):
    return build_constraint(tool_format("hermes"), "spaced", **kw)


def test_constraint_rules():
    tools = _tools(WEATHER, ADD)
    assert _build().grammar is None and not _build().reads_tools
    auto = _build(tools=tools)
    assert (auto.choice, auto.grammar, auto.reads_tools) == ("auto", None, True)
    assert not _build(tools=tools, tool_choice="none").reads_tools
    required = _build(tools=tools, tool_choice="required")
    assert required.grammar.kind == "lark" and required.grammar.param == "tools" and required.choice == "required"
    named = _build(tools=tools, tool_choice=NamedToolChoice(type="function", function={"name": "add"}))
    assert '"const": "add"' in named.grammar.source and "get_weather" not in named.grammar.source
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    js = _build(response_format=fmt, tools=tools)
    assert js.grammar.kind == "json_schema" and js.grammar.param == "response_format.json_schema.schema"
    assert js.reads_tools  # auto: calls are still read back
    assert _build(response_format=ResponseFormat(type="json_object")).grammar.kind == "json_object"
    assert _build(response_format=ResponseFormat(type="text")).grammar is None
    so = _build(structured_outputs=StructuredOutputs.model_validate({"json": json.dumps(PERSON)}))
    assert so.grammar == GrammarSpec.json_schema(PERSON, "structured_outputs.json")


@pytest.mark.parametrize(
    ("kw", "param", "fragment"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": "two", "tool_choice": NamedToolChoice(type="function", function={"name": "f"})},
         "tool_choice.function.name", "not one of the tools"),
        ({"tools": "dup"}, "tools.1.function.name", "is also tool 0"),
        ({"tools": "two", "tool_choice": "required", "response_format": "json"}, "response_format.json_schema.schema",
         "its own grammar"),
        ({"response_format": "json", "structured_outputs": StructuredOutputs(regex="a")}, "response_format",
         "not both"),
        ({"structured_outputs": StructuredOutputs.model_validate({"json": "{nope"})}, "structured_outputs.json",
         "not valid JSON"),
    ],
)  # fmt: skip
def test_constraint_errors_name_the_field(kw, param, fragment):
    tools = {"two": _tools(WEATHER, ADD), "dup": _tools(ADD, ADD)}
    if isinstance(kw.get("tools"), str):
        kw = {**kw, "tools": tools[kw["tools"]]}
    if kw.get("response_format") == "json":
        kw = {**kw, "response_format": ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"schema": PERSON}})}  # fmt: skip
    with pytest.raises(ConstraintError) as info:
        _build(**kw)
    assert info.value.param == param and fragment in info.value.message


# ---------------------------------------------------------------------- tool formats
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_grammar_accepts_what_the_parser_reads(name, parallel, grammars, demo):
    fmt = tool_format(name)
    calls = [("get_weather", {"city": "Paris"}), ("add", {"a": 7})]
    spec = GrammarSpec("lark", fmt.grammar([WEATHER, ADD], parallel, "spaced"), "tools")
    one = fmt.render(calls[:1])
    _consume_checked(grammars, spec, one, demo)
    both = fmt.render(calls)
    accepted = grammars.matcher(spec).validate_tokens(demo.encode(both)) == len(demo.encode(both))
    assert accepted == parallel  # more than one call only when parallel
    content, parsed = fmt.parse("Sure. " + both)
    assert content == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert len(fmt.parse(both, parallel=False)[1]) == 1
    broken = fmt.open + '{"name": "add", "arguments": {"a": 1}junk'  # a block that never closes nor parses
    assert fmt.parse(broken) == (broken, [])  # nothing parses: the whole answer is content
    extra = grammars.matcher(spec)  # arguments the schema does not list are refused (closed objects)
    wrong = fmt.render([("add", {"a": 1, "b": 2})])
    assert extra.validate_tokens(demo.encode(wrong)) < len(demo.encode(wrong))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tool_stream_sends_what_parse_reads(name):
    """Fed the answer one character at a time, the stream sends exactly the parsed content and calls."""
    fmt = tool_format(name)
    texts = [
        "Let me check.\n" + fmt.render([("get_weather", {"city": "Rome"})]) + "\n" + fmt.render([("add", {"a": 1})]),
        "no call here <tool but not a tag",
        fmt.open + '{"name": broken',  # an unclosed block that never parses: all of it is content
    ]
    for text in texts:
        stream = ToolStream(fmt)
        content, calls = "", []
        for k in range(1, len(text) + 1):
            c, new = stream.feed(text[:k])
            content += c
            calls += new
        c, new = stream.finish(text)
        content, calls = content + c, calls + new
        want_content, want_calls = fmt.parse(text)
        assert content == (want_content or "")
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


# ---------------------------------------------------------------------- a batch mixing constrained and free rows
def _decode(model, rows) -> None:
    from components.serving.batch import Group

    group = Group(model, rows, frozenset(), lambda ids: "")
    while group.rows:
        group.step()


def _rows(g: Grammars, demo: TextTokenizer, loop) -> list:
    from components.serving.batch import Row
    from components.serving.job import Job
    from model.generate import RowStart, SamplingParams

    schema = GrammarSpec.json_schema(PERSON, "response_format")
    prompts = [demo.encode("<bos>Q:1+2\n"), demo.encode("<bos>Q:7*7-1\n"), demo.encode("<bos>Q:3\n")]
    specs = [  # (prompt, grammar, temperature, seed)
        (prompts[0], schema, 0.0, None),
        (prompts[1], None, 0.0, None),
        (prompts[2], schema, 1.0, 11),
        (prompts[0], None, 1.0, 5),
        (prompts[1], GrammarSpec("regex", "[0-9]{2,4}", "x"), 0.7, 3),
    ]
    rows = []
    for prompt, spec, temperature, seed in specs:
        sampling = SamplingParams(max_new_tokens=48, temperature=temperature, seed=seed)
        job = Job(prompt, "m", None, None, 48, sampling, (), False, loop, grammar=g.matcher(spec) if spec else None)
        rows.append(Row(job, "answer", "m", RowStart(list(prompt)), 48, frozenset(demo.stop_ids), (), seed))
    return rows


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(demo):
    """Constrained (JSON schema, regex; greedy and sampled) and free rows in one batch of prompts of different
    lengths (left-padded histories after the merge): every row's tokens equal the row decoded alone, and each
    constrained row's text follows its grammar."""
    from components.serving.batch import Group
    from model.config import HybridConfig
    from model.hybrid import HybridLM

    model = HybridLM(HybridConfig(**{**TINY, "vocab_size": demo.vocab_size})).init_weights(0).eval()
    g = Grammars(demo, demo.vocab_size, demo.stop_ids)
    loop = asyncio.new_event_loop()
    try:
        with torch.inference_mode():
            alone = []
            for row in _rows(g, demo, loop):
                _decode(model, [row])
                alone.append(row.tokens)
            rows = _rows(g, demo, loop)
            groups = [Group(model, [r], frozenset(), lambda ids: "") for r in rows]  # one prefill per prompt
            batch = groups[0]
            for other in groups[1:]:
                batch.absorb(other)  # one decoding batch: shorter histories left-padded
            assert len(batch.rows) == len(rows)
            while batch.rows:
                batch.step()
    finally:
        loop.close()
    assert [r.tokens for r in rows] == alone
    for r, spec_kind in zip(rows, ["json", None, "json", None, "regex"], strict=True):
        text = demo.decode(r.tokens[:-1] if r.reason == "stop_id" else r.tokens)
        if spec_kind == "json":
            assert r.reason == "stop_id", text  # the grammar ended the answer: only end-of-sequence was allowed
            jsonschema.validate(json.loads(text), PERSON)
        elif spec_kind == "regex":
            assert r.reason == "stop_id" and text.isdigit() and 2 <= len(text) <= 4, text
    assert batch.stats["grammar_masked_tokens"] >= sum(len(r.tokens) for r in rows if r.matcher is not None)
