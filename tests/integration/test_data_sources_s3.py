"""A files source on a real S3-compatible server started on loopback: globs and prefixes in s3:// URIs,
downloaded once into the local cache, then read with ``datasets`` like local files."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.data import DataConfig, TextTokenizer, build_demo_tokenizer, describe_data, make_data_batch, mixture

pytestmark = pytest.mark.integration


def test_files_source_from_s3(s3_server, tmp_path, monkeypatch) -> None:
    import boto3

    monkeypatch.setenv("STAR_ELASTIC_CACHE", str(tmp_path / "cache"))
    mixture._READERS.clear()
    mixture._PLANS.clear()
    client = boto3.client("s3", endpoint_url=s3_server)
    chat = {
        "messages": [
            {"role": "user", "content": "Q:1+2\n"},
            {"role": "assistant", "content": "<think>1+2=3\n</think>A:3"},
        ]
    }
    client.put_object(Bucket="test-bucket", Key="data/chat/a.jsonl", Body=(json.dumps(chat) + "\n").encode())
    client.put_object(Bucket="test-bucket", Key="data/chat/notes.txt", Body=b"not data")
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"text": "ab c"}]), buf)
    client.put_object(Bucket="test-bucket", Key="data/web/part-0.parquet", Body=buf.getvalue())

    data = DataConfig(
        sources=[
            {"type": "files", "paths": ["s3://test-bucket/data/chat/*.jsonl"], "name": "traces", "weight": 0.5},
            {"type": "files", "paths": ["s3://test-bucket/data/web"], "name": "web", "weight": 0.5},
        ]
    )
    tok = TextTokenizer(build_demo_tokenizer())
    info = describe_data(data, tok, n_rows=1)
    assert [f["layout"] for s in info for f in s["files"]] == ["chat", "text"]
    cached = tmp_path / "cache" / "data" / "test-bucket" / "data" / "chat" / "a.jsonl"
    assert cached.is_file() and cached.with_name("a.jsonl.etag").is_file()
    batch = make_data_batch(data, tok, batch_size=8, seq_len=19, seed=0, phase="p", step=0)
    # <bos> Q : 1 + 2 \n <think> 1 + 2 = 3 \n </think> A : 3 <eos>  and  <bos> a b " " c <eos> + padding
    assert {tuple(r) for r in batch.input_ids.tolist()} == {
        (1, 57, 34, 25, 19, 26, 7, 4, 25, 19, 26, 37, 27, 7, 5, 41, 34, 27, 2),
        (1, 73, 74, 8, 75, 2) + (0,) * 13,
    }
    missing = DataConfig(sources=[{"type": "files", "paths": ["s3://test-bucket/nothing/*.jsonl"], "name": "x"}])
    with pytest.raises(FileNotFoundError, match=r"source 'x': path 's3://test-bucket/nothing/\*\.jsonl' matches no"):
        describe_data(missing)
