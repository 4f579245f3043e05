"""An evaluation set read from a real S3-compatible server started on loopback."""

from __future__ import annotations

import json

import pytest

from components.evaluate import EvalConfig, problem_sets

pytestmark = pytest.mark.integration


def test_eval_set_from_s3(s3_server, tmp_path, monkeypatch):
    import boto3

    monkeypatch.setenv("STAR_ELASTIC_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": "1+1?", "answer": 2, "level": 1}, {"prompt": "2+2?", "answer": "4", "level": 2}]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    boto3.client("s3", endpoint_url=s3_server).put_object(Bucket="test-bucket", Key="eval/set.jsonl", Body=body)
    sets = problem_sets(
        EvalConfig(checkpoint_uri="x", eval_sets=[{"path": "s3://test-bucket/eval/set.jsonl", "group_by": "level"}])
    )
    assert {k: [it.answer for it in v] for k, v in sets.items()} == {"1": ["2"], "2": ["4"]}
    with pytest.raises(ValueError, match=r"eval_sets\[0\]\.path: s3://test-bucket/eval/missing.jsonl: cannot download"):
        problem_sets(EvalConfig(checkpoint_uri="x", eval_sets=["s3://test-bucket/eval/missing.jsonl"]))
