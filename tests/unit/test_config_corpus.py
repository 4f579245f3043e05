"""A corpus of malformed pipeline configs and flags: each is refused before anything starts.

Every case is the demo config plus one change (a ``--set``, a YAML edit, a removed key or a flag).
``--dry-run``'s checks (:func:`pipelines.preflight.pipeline_problems`, run in-process) must refuse it
with exactly one line that starts with the YAML path of the problem: no case is accepted, none
raises, and no line carries a traceback or a raw pydantic dump. A few cases go through the command
line too, for the exit code and the shape of the output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines.preflight import pipeline_problems

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "pipelines" / "configs" / "demo.yaml"


def sets(*overrides: str) -> dict[str, Any]:
    return {"set": list(overrides)}


def budgets(third: str) -> dict[str, Any]:
    """The demo's budgets with the third one replaced."""
    return sets(f"elastic.budgets=[{{name: full, fraction: 1.0}}, {{name: medium, fraction: 0.78}}, {third}]")


# (case id, change, the YAML path (or flag / file position) the one line must start with)
CASES: list[tuple[str, dict[str, Any], str]] = [
    # top level
    ("unknown-top-key", sets("bogus=1"), "bogus"),
    ("misspelt-section", sets("registr.alias=x"), "registr"),
    ("threads-zero", sets("threads=0"), "threads"),
    ("threads-word", sets("threads=two"), "threads"),
    ("run-name-space", sets("run_name=bad name"), "run_name"),
    ("runs-dir-null", sets("runs_dir="), "runs_dir"),
    ("experiment-empty", sets("experiment=''"), "experiment"),
    ("tracking-scheme-typo", sets("tracking_uri=htp://bad"), "tracking_uri"),
    ("storage-not-uri", sets("storage_uri=not-a-uri"), "storage_uri"),
    ("storage-s3-no-bucket", sets("storage_uri=s3:/bucket"), "storage_uri"),
    ("elastic-missing", {"drop": ["elastic"]}, "elastic"),
    # parent
    ("parent-missing-folder", sets("parent.uri=/nonexistent/parent"), "parent.uri"),
    ("parent-unknown-key", sets("parent.urii=x"), "parent.urii"),
    ("parent-train-typo", sets("parent.train.stepz=3"), "parent.train.stepz"),
    ("parent-train-output-dir", sets("parent.train.output_dir=/x"), "parent.train.output_dir"),
    ("parent-train-lr", sets("parent.train.lr=-1"), "parent.train.lr"),
    (
        "parent-trained-space-misaligned",
        sets("parent.uri=null", "elastic.space.hidden=[64, 50]"),
        "elastic.space.hidden",
    ),
    # elastic space (field rules, then against the parent's config.json)
    ("space-typo", sets("elastic.space.hiden=[64]"), "elastic.space.hiden"),
    ("space-empty", sets("elastic.space={}"), "elastic.space"),
    ("space-ascending", sets("elastic.space.hidden=[32, 64]"), "elastic.space.hidden"),
    ("space-empty-axis", sets("elastic.space.mlp_ffn=[]"), "elastic.space.mlp_ffn"),
    ("space-not-bool", sets("elastic.space.nvfp4_aligned=maybe"), "elastic.space.nvfp4_aligned"),
    ("space-larger-than-parent", sets("elastic.space.hidden=[80, 64]"), "elastic.space.hidden"),
    ("space-mamba-heads-groups", sets("elastic.space.mamba_heads=[8, 5]"), "elastic.space.mamba_heads"),
    ("space-nvfp4-hidden", sets("elastic.space.hidden=[64, 50]"), "elastic.space.hidden"),
    ("space-experts-below-topk", sets("elastic.space.experts=[8, 1]"), "elastic.space.experts"),
    ("space-depth-too-deep", sets("elastic.space.depth=[9, 8]"), "elastic.space.depth"),
    ("space-attn-heads-groups", sets("elastic.space.attn_heads=[4, 3]"), "elastic.space.attn_heads"),
    # budgets
    ("budgets-empty", sets("elastic.budgets=[]"), "elastic.budgets"),
    ("budgets-string", sets("elastic.budgets=all"), "elastic.budgets"),
    ("budget-unreachable", budgets("{name: tiny, fraction: 0.01}"), "elastic.budgets"),
    ("budget-name-slash", budgets("{name: sm/all, fraction: 0.56}"), "elastic.budgets[2]"),
    ("budget-names-repeated", budgets("{name: medium, fraction: 0.56}"), "elastic.budgets"),
    (
        "budget-no-full",
        sets("elastic.budgets=[{name: a, fraction: 0.9}, {name: b, fraction: 0.7}, {name: c, fraction: 0.5}]"),
        "elastic.budgets",
    ),
    ("budget-name-empty", budgets("{name: '', fraction: 0.56}"), "elastic.budgets[2].name"),
    ("budget-not-a-mapping", budgets("small"), "elastic.budgets[2]"),
    ("budget-extra-key", budgets("{name: small, fraction: 0.56, frac: 1}"), "elastic.budgets[2].frac"),
    ("budgets-as-section", sets("elastic.budgets.x=1"), "elastic.budgets"),
    # rank
    ("rank-calibration-typo", sets("rank.calibration.num_sampls=3"), "rank.calibration.num_sampls"),
    ("rank-unknown-axis", sets("rank.axes=[hiddn]"), "rank.axes"),
    ("rank-num-tasks-zero", sets("rank.num_tasks=0"), "rank.num_tasks"),
    ("rank-output-dir-filled", sets("rank.output_dir=x"), "rank.output_dir"),
    ("rank-parent-uri-filled", sets("rank.parent_uri=x"), "rank.parent_uri"),
    ("rank-expert-score", sets("rank.expert_score=best"), "rank.expert_score"),
    # distillation
    ("distill-lr-zero", sets("distill_phase1.lr=0"), "distill_phase1.lr"),
    ("distill-zero-stage", sets("distill_phase1.zero_stage=4"), "distill_phase1.zero_stage"),
    ("distill-space-filled", sets("distill_phase1.space={hidden: [64]}"), "distill_phase1.space"),
    ("distill-teacher-filled", sets("distill_phase1.teacher_uri=x"), "distill_phase1.teacher_uri"),
    ("distill-experiment-filled", sets("distill_phase2.experiment=x"), "distill_phase2.experiment"),
    ("distill-probs-sum", sets("distill_phase2.budget_probs=[0.5, 0.6, 0.2]"), "distill_phase2.budget_probs"),
    ("distill-probs-count", sets("distill_phase2.budget_probs=[0.5, 0.5]"), "distill_phase2"),
    ("distill-router-per-layer", sets("distill_phase1.router.per_layer=true"), "distill_phase1"),
    ("distill-workers-zero", sets("distill_phase1.num_workers=0"), "distill_phase1.num_workers"),
    ("distill-steps-negative", sets("distill_phase1.steps=-5"), "distill_phase1.steps"),
    ("distill-seq-len-short", sets("distill_phase2.seq_len=4"), "distill_phase2.seq_len"),
    ("distill-dead-zone", sets("distill_phase2.dead_zone=1.5"), "distill_phase2.dead_zone"),
    ("distill-router-typo", sets("distill_phase1.router.hiden=8"), "distill_phase1.router.hiden"),
    # export, evaluate, quantize
    ("export-select", sets("export.select=best"), "export.select"),
    ("export-tolerance", sets("export.tolerance=0"), "export.tolerance"),
    ("export-output-dir-filled", sets("export.output_dir=x"), "export.output_dir"),
    ("evaluate-level-zero", sets("evaluate.levels=[0]"), "evaluate.levels"),
    ("evaluate-no-caps", sets("evaluate.think_caps=[]"), "evaluate.think_caps"),
    ("evaluate-pair-unknown-budget", sets("evaluate.elastic_pairs=[[small, huge]]"), "evaluate.elastic_pairs"),
    ("evaluate-pairs-number", sets("evaluate.elastic_pairs=3"), "evaluate.elastic_pairs"),
    ("evaluate-dtype", sets("evaluate.dtype=fp64"), "evaluate.dtype"),
    ("evaluate-top-p", sets("evaluate.top_p=0"), "evaluate.top_p"),
    ("quantize-format", sets("quantize.formats=[fp4]"), "quantize.formats[0]"),
    ("quantize-no-formats", sets("quantize.formats=[]"), "quantize.formats"),
    ("quantize-preset", sets("quantize.preset=aggressive"), "quantize.preset"),
    ("quantize-evaluate-key", sets("quantize.evaluate={bogus: 1}"), "quantize.evaluate.bogus"),
    # register
    ("register-alias-empty", sets("register.alias=''"), "register.alias"),
    ("register-name-empty", sets("register.model_name=''"), "register.model_name"),
    ("register-alias-slash", sets("register.alias=a/b"), "register.alias"),
    ("register-regression", sets("register.gate.max_regression=2"), "register.gate.max_regression"),
    ("register-gate-budget", sets("register.gate.min_accuracy={huge: 0.5}"), "register.gate.min_accuracy"),
    ("register-gate-typo", sets("register.gat={}"), "register.gat"),
    # serve
    ("serve-unknown-key", sets("serve.bogus=1"), "serve.bogus"),
    ("serve-max-tokens-zero", sets("serve.max_tokens_limit=0"), "serve.max_tokens_limit"),
    ("serve-default-above-limit", sets("serve.default_max_tokens=4096"), "serve"),
    ("serve-unknown-budget", sets("serve.budgets=[huge]"), "serve.budgets"),
    ("serve-format", sets("serve.format=int4"), "serve.format"),
    ("serve-autoscaling", sets("serve.autoscaling.min_replicas=3"), "serve.autoscaling"),
    # the sections every stage inherits
    ("data-no-sources", sets("data.sources=[]"), "data.sources"),
    ("data-overlong-word", sets("data.overlong=cut"), "data.overlong"),
    ("markers-typo", sets("markers.thinking_open=x"), "markers.thinking_open"),
    ("markers-same-open-close", sets("markers.think_close=<think>"), "markers"),
    # flags
    ("set-without-equals", sets("threads"), "--set threads"),
    ("set-bad-yaml", sets("threads=[1"), "threads"),
    ("only-unknown-stage", {"only": ["nosuchstage"]}, "--only"),
    ("from-unknown-stage", {"from": "nosuchstage"}, "--from"),
    # the YAML file itself (positions relative to the end of the demo config)
    ("yaml-unclosed-list", {"append": "extra: [1, 2\n"}, "{file}:{end+2}"),
    ("yaml-tab-indent", {"append": "extra:\n\tkey: 1\n"}, "{file}:{end+2}"),
    ("yaml-mapping-in-value", {"append": "extra: a: b\n"}, "{file}:{end+1}"),
    ("yaml-repeated-top-key", {"append": "threads: 4\n"}, "{file}:{end+1}"),
    ("yaml-repeated-nested-key", {"replace": ("  num_tasks: 2", "  num_tasks: 2\n  num_tasks: 3")}, "{file}:{at+1}"),
    ("yaml-top-level-list", {"text": "- run_name: demo\n"}, "{file}"),
]


def _write_case(change: dict[str, Any], tmp_path: Path) -> tuple[Path, list[str], dict[str, Any]]:
    """(config file, overrides, flags) of one case."""
    text = DEMO.read_text()
    if "drop" in change:
        data = yaml.safe_load(text)
        for key in change["drop"]:
            del data[key]
        text = yaml.safe_dump(data)
    if "append" in change:
        text = text.rstrip("\n") + "\n" + change["append"]
    if "replace" in change:
        old, new = change["replace"]
        assert old in text, f"the demo config no longer has {old!r}; update the case"
        text = text.replace(old, new, 1)
    if "text" in change:
        text = change["text"]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    flags = {"only": change.get("only"), "force_from": change.get("from")}
    return path, [f"runs_dir={tmp_path / 'runs'}", *change.get("set", [])], flags


def _expected(where: str, path: Path, change: dict[str, Any]) -> str:
    """``{file}``: the case's file; ``{end+k}``: k lines after the demo's last; ``{at+k}``: after the replaced line."""
    text = DEMO.read_text()
    end = len(text.rstrip("\n").splitlines())
    at = text[: text.find(change["replace"][0])].count("\n") + 1 if "replace" in change else 0
    for k in (1, 2):
        where = where.replace(f"{{end+{k}}}", str(end + k)).replace(f"{{at+{k}}}", str(at + k))
    return where.replace("{file}", str(path))


def _section(where: str) -> str:
    """The top-level YAML key a case's line starts with (``rank`` of ``rank.num_tasks``)."""
    return where.split(".")[0].split("[")[0]


def test_the_corpus_reaches_every_section_of_the_config() -> None:
    """The keys come from the config class, not from this file: a section added to the pipeline config is
    reported here until the corpus holds a mistake in it that the check refuses at its path."""
    from pipelines.config import PipelineConfig

    sections = {field.alias or name for name, field in PipelineConfig.model_fields.items()}
    refused_in = {_section(where) for _, _, where in CASES}
    assert sections - refused_in == set(), "sections of the pipeline config with no malformed case"


def test_the_demo_config_itself_passes(tmp_path: Path) -> None:
    cfg, problems = pipeline_problems(DEMO, [f"runs_dir={tmp_path}"])
    assert problems == [] and cfg is not None


@pytest.mark.parametrize("case, change, where", CASES, ids=[c[0] for c in CASES])
def test_each_malformed_config_is_refused_in_one_line(case: str, change: dict[str, Any], where: str, tmp_path) -> None:
    path, overrides, flags = _write_case(change, tmp_path)
    cfg, problems = pipeline_problems(path, overrides, **flags)
    assert len(problems) == 1, f"{case}: expected one line, got {problems}"
    (line,) = problems
    assert line.startswith(_expected(where, path, change) + ":"), line
    assert "\n" not in line and "Traceback" not in line and "errors.pydantic.dev" not in line, line


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The installed ``star-elastic`` console script (``pip install -e .`` puts it beside the interpreter)."""
    script = Path(sys.executable).with_name("star-elastic")
    return subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_cli_dry_run_refuses_with_exit_2_and_one_line(tmp_path: Path) -> None:
    bad_set = _cli(
        "run", str(DEMO), "--dry-run", "--set", f"runs_dir={tmp_path}", "--set", "elastic.space.hidden=[64, 50]"
    )
    assert bad_set.returncode == 2 and bad_set.stdout == ""
    assert bad_set.stderr.splitlines() == [
        "elastic.space.hidden: 50 gives 50 channels, not a multiple of 16 (nvfp4_aligned needs whole NVFP4 blocks)"
    ]
    broken = tmp_path / "broken.yaml"
    broken.write_text("run_name: demo\nelastic:\n  space: {hidden: [64, 48}\n")
    bad_yaml = _cli("run", str(broken), "--dry-run")
    assert bad_yaml.returncode == 2 and "Traceback" not in bad_yaml.stderr
    (line,) = bad_yaml.stderr.splitlines()
    assert line.startswith(f"{broken}:3:") and "invalid YAML" in line, line
    only = _cli("run", str(DEMO), "--dry-run", "--set", f"runs_dir={tmp_path}", "--only", "nosuchstage")
    assert only.returncode == 2 and only.stderr.splitlines()[0].startswith("--only: unknown stage 'nosuchstage'")


def test_cli_dry_run_of_a_good_config_prints_the_plan(tmp_path: Path) -> None:
    ok = _cli("run", str(DEMO), "--dry-run", "--set", f"runs_dir={tmp_path}")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == (
        "pipeline demo: parent (run), rank (run), distill_phase1 (run), distill_phase2 (run), export (run), "
        "evaluate (run), quantize (run), register (run)"
    )


@pytest.mark.parametrize(
    "override, line",
    [
        ("rank.calibration.num_sampls=3", "rank.calibration.num_sampls: unknown key; did you mean 'num_samples'?"),
        ("serve.max_ongoing_request=3", "serve.max_ongoing_request: unknown key; did you mean 'max_ongoing_requests'?"),
        ("rank.output_dir=x", "rank.output_dir: set by the pipeline (the rank stage's folder under runs_dir/run_name); "
         "remove it"),
        ("distill_phase1.lr=0", "distill_phase1.lr: Input should be greater than 0, got 0"),
    ],
)  # fmt: skip
def test_a_bad_set_names_its_yaml_path_and_the_fix(override: str, line: str, tmp_path: Path) -> None:
    """``--set`` goes through the same config classes as the YAML: the stage sections' own fields and bounds."""
    _, problems = pipeline_problems(DEMO, [f"runs_dir={tmp_path}", override])
    assert problems == [line]
