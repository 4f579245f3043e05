"""The evaluate stage on a tiny random nested checkpoint: outputs, tracker calls, comparisons, eval sets,
chat-template prompts, answer formats, multi-token markers, bad inputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from components.data.answers import AnswerFormat
from components.data.tokenizer import ReasoningMarkers, TextTokenizer, build_demo_tokenizer
from components.eval_plots import accuracy_at, best_elastic_vs_standard, latency_for, pareto_front
from components.eval_sets import EvalItem, thinking_prompt
from components.evaluate import EvalConfig, PhaseResult, problem_sets, run_evaluate, score
from components.tracking import Tracker
from model.config import HybridConfig
from model.elastic import Architecture, ElasticSpace, count_params
from model.elastic.budgets import BudgetSet
from model.elastic.export import export_nested
from model.hybrid import HybridLM

SMALL = Architecture(hidden=16, moe_ffn=8, experts=2)


class RecordingTracker(Tracker):
    """Keeps every call for the assertions."""

    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = []
        self.metrics: dict[str, float] = {}
        self.artifacts: list[tuple[str, str | None]] = []
        self.tags: dict[str, Any] = {}

    def log_params(self, params):
        self.params.append(dict(params))

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append((Path(path).name, artifact_path))

    def set_tags(self, tags):
        self.tags.update(tags)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("eval")
    tok = TextTokenizer(build_demo_tokenizer())
    config = HybridConfig(
        vocab_size=tok.vocab_size, hidden_size=32, pattern="M*E", num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, mamba_num_heads=2, mamba_head_dim=8, n_groups=1, ssm_state_size=8, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
    )  # fmt: skip
    model = HybridLM(config).init_weights(0).eval()
    with torch.no_grad():
        model.model.layers[2].mixer.gate.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    tok_dir = tmp / "tok"
    tok.save(tok_dir)
    files = {p.name: p for p in tok_dir.iterdir()}
    frac = count_params(config, SMALL).active / count_params(config).active
    space = ElasticSpace(hidden=[32, 16], moe_ffn=[16, 8], experts=[4, 2])
    budgets = BudgetSet.of({"full": 1.0, "small": round(frac, 4)})
    nested = export_nested(model, {"full": Architecture(), "small": SMALL}, budgets, space, tmp / "nested",
                           extra_files=files)  # fmt: skip
    plain = model.save_pretrained(tmp / "plain", extra_files=files)
    return {"nested": nested, "plain": plain, "root": tmp}


def _config(ckpt: Path, out: Path, **kw) -> EvalConfig:
    base = dict(checkpoint_uri=str(ckpt), levels=[1, 2], n_per_level=2, think_caps=[0, 3], think_limit=5,
                max_answer_tokens=3, batch_size=2, output_dir=str(out), progress=False)  # fmt: skip
    base.update(kw)
    return EvalConfig(**base)


def test_evaluate_writes_json_csv_png_and_logs(checkpoints):
    out = checkpoints["root"] / "out"
    tracker = RecordingTracker()
    res = run_evaluate(_config(checkpoints["nested"], out, carry_state_compare=True, seed=3), tracker)
    data = json.loads(Path(res.results_json).read_text())
    assert data["full_budget"] == "full" and [b["name"] for b in data["budgets"]] == ["full", "small"]
    rows = data["rows"]
    pairs = {(r["think_budget"], r["answer_budget"]) for r in rows}
    assert pairs == {("full", "full"), ("small", "small"), ("small", "full")}
    std_caps = {r["think_cap"] for r in rows if r["control"] == "standard"}
    assert std_caps == {0, 3, None}  # the uncapped run is always added for standard control
    assert {r["level"] for r in rows} == {"1", "2", "all"}
    assert any(r["carry_state"] for r in rows) and "carry_vs_re_prefill" in data
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and r["mean_latency_s"] > 0
        if r["think_cap"] == 0:
            assert r["mean_think_tokens"] == 0
        if r["think_cap"] == 3:
            assert r["mean_think_tokens"] <= 3
    with open(res.results_csv, newline="") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == len(rows) and {"none", "0", "3"} >= {t["think_cap"] for t in table}
    assert Path(res.plot_png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"acc/full", "acc/small", "acc/full/L1", "latency_s/small"} <= set(tracker.metrics)
    assert {name for name, _ in tracker.artifacts} == {
        "results.json",
        "results.csv",
        "pareto.png",
        "pareto_weight_passes.png",
    }
    assert tracker.params and tracker.params[0]["budgets"].keys() == {"full", "small"}
    assert res.comparison["full_budget"] == "full" and "small->full" in res.comparison["pairs"]
    # deterministic for a fixed seed (latencies aside)
    again = run_evaluate(
        _config(checkpoints["nested"], checkpoints["root"] / "again", carry_state_compare=True, seed=3)
    )
    strip = [{k: v for k, v in r.items() if k != "mean_latency_s"} for r in rows]
    rows2 = json.loads(Path(again.results_json).read_text())["rows"]
    assert strip == [{k: v for k, v in r.items() if k != "mean_latency_s"} for r in rows2]


def test_plain_checkpoint_is_one_budget(checkpoints):
    res = run_evaluate(_config(checkpoints["plain"], checkpoints["root"] / "plain-out", levels=[1], think_caps=[0]))
    rows = json.loads(Path(res.results_json).read_text())["rows"]
    assert {(r["think_budget"], r["answer_budget"]) for r in rows} == {("full", "full")}
    assert res.comparison["best_pair"] is None and "acc/full" in res.metrics


def test_bad_inputs_name_the_field(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"elastic_pairs\[0\]\[1\]: unknown answer budget 'huge'"):
        run_evaluate(_config(checkpoints["nested"], tmp_path, elastic_pairs=[["small", "huge"]]))
    with pytest.raises(ValueError, match=r"elastic_pairs\[0\]: think budget 'full' is larger"):
        run_evaluate(_config(checkpoints["nested"], tmp_path, elastic_pairs=[["full", "small"]]))
    with pytest.raises(ValidationError, match=r"think_caps\[1\]"):
        _config(checkpoints["nested"], tmp_path, think_caps=[0, -2])
    with pytest.raises(ValidationError, match="think_caps"):
        _config(checkpoints["nested"], tmp_path, think_caps=[4, 4])
    with pytest.raises(ValidationError, match="extra"):
        _config(checkpoints["nested"], tmp_path, n_levels=3)
    with pytest.raises(ValueError, match=r"eval_sets\[0\]\.path: .*missing.jsonl: no such file"):
        run_evaluate(_config(checkpoints["nested"], tmp_path, eval_sets=[str(tmp_path / "missing.jsonl")]))
    with pytest.raises(ValueError, match="checkpoint_uri"):
        run_evaluate(_config(tmp_path, tmp_path))


def test_jsonl_sets_and_explicit_pairs(checkpoints, tmp_path):
    path = tmp_path / "extra.jsonl"
    path.write_text('{"prompt": "Q:1+1\\n", "answer": 2}\n{"prompt": "Q:2*3\\n", "answer": "6"}\n')
    cfg = _config(checkpoints["nested"], tmp_path / "o", levels=None, eval_sets=[str(path)],
                  elastic_pairs=[["small", "full"]], think_caps=[2])  # fmt: skip
    rows = json.loads(Path(run_evaluate(cfg).results_json).read_text())["rows"]
    assert {r["level"] for r in rows} == {"extra", "all"} and all(r["n"] == 2 for r in rows)


def _result(text: str) -> PhaseResult:
    return PhaseResult([], [], "", text, 0, "none", "length", "prefill", 1, 0.1, 0.1)


def test_answer_extraction_never_crashes():
    from components.data import Problem

    p = Problem(prompt="Q:1+1\n", reasoning="", answer="2")
    assert score(p, _result("A:2<eos>")) and not score(p, _result("A:3")) and not score(p, _result(""))
    assert not score(p, _result("\x00<unk></think>garbage")) and score(p, _result("junk 2"))


def test_curves_and_best_pair():
    front = pareto_front([(1.0, 0.2), (2.0, 0.5), (1.5, 0.1), (4.0, 0.9), (3.0, 0.4)])
    assert front == [(1.0, 0.2), (2.0, 0.5), (4.0, 0.9)]
    assert accuracy_at(front, 3.0) == pytest.approx(0.7) and accuracy_at(front, 0.5) is None
    assert accuracy_at(front, 9.0) == 0.9
    assert latency_for(front, 0.7) == pytest.approx(3.0) and latency_for(front, 0.95) is None
    assert latency_for(front, 0.1) == 1.0

    def row(t, a, cap, lat, acc):
        return dict(think_budget=t, answer_budget=a, think_cap=cap, level="all", carry_state=False,
                    mean_latency_s=lat, accuracy=acc)  # fmt: skip

    rows = [row("full", "full", c, lat, acc) for c, lat, acc in [(0, 1.0, 0.2), (8, 2.0, 0.5), (None, 4.0, 0.9)]]
    rows += [row("mid", "full", c, lat, acc) for c, lat, acc in [(0, 1.0, 0.3), (8, 1.5, 0.7)]]
    rows += [row("small", "full", c, lat, acc) for c, lat, acc in [(0, 0.5, 0.1), (8, 1.0, 0.25)]]
    comp = best_elastic_vs_standard({"rows": rows, "full_budget": "full"})
    assert comp["best_pair"] == "mid->full"
    gain = comp["accuracy_gain_at_equal_latency"]
    assert gain["think_cap"] == 8 and gain["accuracy_gain"] == pytest.approx(0.7 - 0.35)
    speed = comp["speedup_at_equal_accuracy"]
    assert speed["think_cap"] == 8 and speed["speedup"] == pytest.approx(3.0 / 1.5)
    assert comp["pairs"]["small->full"]["points"][0]["accuracy_gain"] is None  # faster than any standard point


def test_weight_pass_proxy_counts_passes_by_active_share():
    from components.evaluate import weight_passes

    # 10 thinking tokens decoded on a budget of 0.5 (prefill + 10 passes), then a re-prefill of 30 tokens
    # and 3 answer tokens on the full budget (the re-prefill pass yields the first, 2 more passes)
    elastic = PhaseResult([1] * 9, [5, 6, 7], "", "", 10, "close", "stop", "prefill", 30, 0.1, 0.1)
    assert weight_passes(elastic, 0.5, 1.0) == pytest.approx(11 * 0.5 + 1 + 2)
    # a continued row with nothing left to feed: only the answer decode passes after the first token
    continued = PhaseResult([1] * 9, [5, 6, 7], "", "", 10, "close", "stop", "continued", 0, 0.1, 0.1)
    assert weight_passes(continued, 1.0, 1.0) == pytest.approx(11 + 2)

    def row(t, cap, passes, acc):
        return dict(think_budget=t, answer_budget="full", think_cap=cap, level="all", carry_state=False,
                    mean_latency_s=1.0, mean_weight_passes=passes, accuracy=acc)  # fmt: skip

    rows = [row("full", c, p, a) for c, p, a in [(0, 5.0, 0.2), (None, 40.0, 0.8)]]
    rows += [row("small", None, 20.0, 0.8)]  # the same accuracy at half the weight reads
    comp = best_elastic_vs_standard({"rows": rows, "full_budget": "full"}, "mean_weight_passes")
    assert comp["cost"] == "mean_weight_passes" and comp["best_pair"] == "small->full"
    assert comp["speedup_at_equal_accuracy"]["speedup"] == pytest.approx(2.0)


# ---------------------------------------------------------------------- prompts, eval sets, answer formats, markers
def test_demo_prompt_is_bos_question_think():
    tok = TextTokenizer(build_demo_tokenizer())
    # <bos> Q : 7 + 5 * 3 - 2 \n <think> in the demo vocabulary
    expected = [1, 57, 34, 31, 19, 29, 18, 27, 21, 26, 7, 4]
    assert thinking_prompt(tok, [{"role": "user", "content": "Q:7+5*3-2\n"}]) == expected


def test_template_without_the_open_marker_gets_it_appended():
    hf = build_demo_tokenizer()
    hf.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tok = TextTokenizer(hf)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.decode(thinking_prompt(tok, chat)) == "<bos>user: hi\nassistant: <think>"
    assert tok.decode(thinking_prompt(tok, chat, open_think=False)) == "<bos>user: hi\nassistant: "


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_eval_set_rows_groups_and_labels(tmp_path):
    path = _write_jsonl(
        tmp_path / "math.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": 4, "level": 2},
            "",
            {
                "messages": [{"role": "user", "content": "3*3?"}, {"role": "assistant", "content": "\\boxed{9}"}],
                "answer": "9",
                "level": 10,
            },
            {"prompt": "1+0?", "prompt_is_ignored_for": "messages", "answer": "1", "level": 2},
            {"prompt": "past the limit", "answer": "0", "level": 3},
        ],
    )
    one = {"path": str(path), "group_by": "level", "system_prompt": "Be brief.", "limit": 3}
    sets = problem_sets(EvalConfig(checkpoint_uri="x", eval_sets=[one], answer_format={"kind": "boxed"}))
    assert list(sets) == ["2", "10"]  # numeric order; a single source has no name prefix
    assert [it.answer for it in sets["2"]] == ["4", "1"] and len(sets["10"]) == 1
    assert sets["10"][0].messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "3*3?"})
    assert sets["2"][0].messages[1] == {"role": "user", "content": "What is 2+2?"}
    assert {it.answer_format.kind for items in sets.values() for it in items} == {"boxed"}
    # with the built-in levels as a second source, labels carry the set's name; a set may bring its own format
    two = {**one, "name": "m", "answer_format": {"kind": "hash"}}
    both = problem_sets(EvalConfig(checkpoint_uri="x", eval_sets=[two], levels=[1], n_per_level=2))
    assert list(both) == ["m/2", "m/10", "1"]
    assert both["m/2"][0].answer_format.kind == "hash" and both["1"][0].answer_format.kind == "prefix"
    assert both["1"][0].messages[0]["content"].startswith("Q:") and len(both["1"]) == 2
    # levels null: the default levels only without eval sets
    assert EvalConfig(checkpoint_uri="x").builtin_levels == [1, 2, 3, 4, 5, 6]
    assert EvalConfig(checkpoint_uri="x", eval_sets=[str(path)]).builtin_levels == []


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"answer": 1}', "missing field 'prompt' \\(a string\\) or 'messages'"),
        ('{"prompt": "x"}', "missing field 'answer'"),
        ('{"prompt": 3, "answer": 1}', "field 'prompt' must be a string"),
        ('{"messages": [{"role": "bot", "content": "x"}], "answer": 1}', r"messages\[0\] must be"),
        (
            '{"messages": [{"role": "assistant", "content": "x"}], "answer": 1}',
            "field 'messages' holds no message before the assistant",
        ),
        ('{"prompt": "x", "answer": [1]}', "field 'answer' must be a string or a number"),
        ("[1, 2]", "expected a JSON object"),
        ("{bad", "invalid JSON"),
    ],
)
def test_eval_set_errors_name_the_line_and_field(tmp_path, line, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": 1}, line])
    with pytest.raises(ValueError, match=rf"eval_sets\[0\] .*bad.jsonl:2: {message}"):
        problem_sets(EvalConfig(checkpoint_uri="x", eval_sets=[str(path)]))


def test_config_defaults_and_validation(tmp_path):
    cfg = EvalConfig(checkpoint_uri="x")
    assert (cfg.think_limit, cfg.max_answer_tokens, cfg.batch_size) == (4096, 1024, 32)
    assert cfg.answer_format == AnswerFormat(kind="prefix", prefix="A:")
    assert (cfg.markers.think_open, cfg.markers.think_close) == ("<think>", "</think>")
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert cfg.resolved_device() == expected_device
    assert cfg.resolved_dtype() == (torch.bfloat16 if expected_device == "cuda" else torch.float32)
    assert EvalConfig(checkpoint_uri="x", device="cuda").resolved_dtype() == torch.bfloat16
    assert EvalConfig(checkpoint_uri="x", device="cuda", dtype="float32").resolved_dtype() == torch.float32
    with pytest.raises(ValidationError, match="nothing to evaluate"):
        EvalConfig(checkpoint_uri="x", levels=[])
    with pytest.raises(ValidationError, match="exactly one capturing group"):
        EvalConfig(checkpoint_uri="x", answer_format={"kind": "regex", "pattern": "x"})
    with pytest.raises(ValidationError, match="extra"):
        EvalConfig(checkpoint_uri="x", eval_sets=[{"path": "a.jsonl", "group": "level"}])


def test_score_reads_with_the_items_answer_format():
    boxed = EvalItem(({"role": "user", "content": "q"},), "1/2", "x", AnswerFormat(kind="boxed"))
    assert score(boxed, _result("so \\boxed{\\frac{1}{2}}.<eos>\\boxed{7}"))
    assert not score(boxed, _result("\\boxed{0.4}"))
    hashed = EvalItem(({"role": "user", "content": "q"},), "1234", "x", AnswerFormat(kind="hash"))
    assert score(hashed, _result("work\n#### 1,234\n")) and not score(hashed, _result("#### 12\n"))


@pytest.mark.parametrize("close", ["</think>", "[END]"])
def test_markers_reach_budget_control(checkpoints, tmp_path, close):
    """Answering directly (cap 0) prefills prompt + the whole close marker: 1 id, or 5 for '[END]'."""
    markers = {"think_open": "<think>", "think_close": close}
    tok = TextTokenizer.load(checkpoints["plain"], ReasoningMarkers(**markers))
    assert len(tok.think_close_ids) == (1 if close == "</think>" else 5)
    cfg = _config(checkpoints["plain"], tmp_path, levels=[1], n_per_level=4, think_caps=[0, 3], markers=markers)
    rows = json.loads(Path(run_evaluate(cfg).results_json).read_text())["rows"]
    items = problem_sets(cfg)["1"]
    prompt_len = sum(len(tok.encode("<bos>" + it.messages[0]["content"] + "<think>")) for it in items) / len(items)
    direct = next(r for r in rows if r["think_cap"] == 0 and r["level"] == "all")
    assert direct["mean_answer_fed"] == pytest.approx(prompt_len + len(tok.think_close_ids))
    capped = next(r for r in rows if r["think_cap"] == 3 and r["level"] == "all")
    assert capped["mean_think_tokens"] <= 3 and capped["mean_think_generated"] <= 3 + len(tok.think_close_ids) - 1
