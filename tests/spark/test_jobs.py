"""The Spark jobs, each run once on small data (in this process, so they
share the test run's SparkSession)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from spark_jobs import export_parquet, load_files, stream_stats

from .streams import StreamOps, make_values

JOBS = ["stream_stats", "export_parquet", "load_files"]


@pytest.mark.parametrize("job", JOBS)
def test_help(job: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", f"spark_jobs.{job}", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--pm" in result.stdout and "spark-submit" in result.stdout


def test_stream_stats_under_spark_submit(ops: StreamOps) -> None:
    stream = ops.create_stream()
    ops.append(stream, [b"abc", b"de"], timestamp_ms=1_700_000_000_000)
    spark_submit = Path(sys.executable).parent / "spark-submit"
    result = subprocess.run(
        [
            str(spark_submit),
            "--master",
            "local[1]",
            stream_stats.__file__,
            "--pm",
            ops.pm_address,
            "--streams",
            str(stream),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # spark-submit passes the driver's stderr (the progress lines) to its stdout
    lines = [line.split() for line in result.stdout.strip().splitlines()]
    header = next(i for i, line in enumerate(lines) if line[:2] == ["stream", "records"])
    assert [row[:5] for row in lines[header + 1 :]] == [[str(stream), "2", "5", "0", "1"]]


def test_stream_stats(
    spark: SparkSession, ops: StreamOps, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = ops.create_stream(), ops.create_stream()
    early, late = make_values("e", 10), make_values("l", 5)
    ops.append(first, early, timestamp_ms=1_700_000_000_000)
    ops.seal(first)
    ops.append(first, late, timestamp_ms=1_700_000_002_500)
    ops.append(second, [b"abc"], timestamp_ms=1_700_000_000_000)

    assert stream_stats.main(["--pm", ops.pm_address, "--streams", f"{first},{second}"]) == 0

    out = capsys.readouterr()
    table = [line.split() for line in out.out.strip().splitlines()[1:]]
    # stream, records, bytes, first, last, first time (date and time), span
    assert [(row[:5], row[-1]) for row in table] == [
        ([str(first), "15", str(sum(map(len, early + late))), "0", "14"], "2.500"),
        ([str(second), "1", "3", "0", "0"], "0.000"),
    ]
    assert "read 16 records of 2 streams" in out.err


def test_export_parquet_streams_and_ranges(
    spark: SparkSession, ops: StreamOps, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = ops.create_stream(), ops.create_stream()
    head, tail = make_values("h", 20), make_values("t", 12)
    ops.append(first, head)
    ops.seal(first)
    ops.append(first, tail)
    ops.append(second, [b"only"])

    out = tmp_path / "streams"
    argv = ["--pm", ops.pm_address, "--streams", f"{first},{second}", "--output", str(out)]
    assert export_parquet.main(argv) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(
        [f"stream_id={first}", f"stream_id={second}"]
    )
    exported = pq.read_table(out / f"stream_id={first}").sort_by("offset")
    assert exported.column("offset").to_pylist() == list(range(32))
    assert exported.column("value").to_pylist() == head + tail
    assert pq.read_table(out / f"stream_id={second}").column("value").to_pylist() == [b"only"]
    assert f"stream {first}: 32 records" in capsys.readouterr().out

    # only the open range (index 1) of the first stream
    ranges_out = tmp_path / "ranges"
    argv = ["--pm", ops.pm_address, "--ranges", f"{first}:1", "--output", str(ranges_out)]
    assert export_parquet.main(argv) == 0
    exported = pq.read_table(ranges_out / f"stream_id={first}").sort_by("offset")
    assert exported.column("offset").to_pylist() == list(range(20, 32))
    assert exported.column("value").to_pylist() == tail


def test_load_files_text_in_argument_order(
    spark: SparkSession, ops: StreamOps, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small, big = tmp_path / "b-small.txt", tmp_path / "a-big.txt"
    small.write_text("one\ntwo\n\nfour\n")
    big.write_text("".join(f"big line {i}\n" for i in range(300)))

    argv = ["--pm", ops.pm_address, "--create-stream", str(small), str(big)]
    assert load_files.main(argv) == 0

    out = capsys.readouterr()
    match = re.search(r"stream (\d+): appended offsets \[0, (\d+)\)", out.out)
    assert match is not None, out.out
    stream, count = int(match[1]), int(match[2])
    expected = [b"one", b"two", b"", b"four"] + [f"big line {i}".encode() for i in range(300)]
    assert count == len(expected)
    assert ops.read_all(stream) == expected


def test_load_files_json_lines(spark: SparkSession, ops: StreamOps, tmp_path: Path) -> None:
    stream = ops.create_stream()
    objects = [{"n": i, "tags": ["a", "b"][: i % 3]} for i in range(50)]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in objects) + "\n\n")
    argv = ["--pm", ops.pm_address, "--stream", str(stream), "--format", "jsonl", str(path)]
    assert load_files.main(argv) == 0
    assert [json.loads(v) for v in ops.read_all(stream)] == objects

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ok": 1}\nnot json\n')
    argv = ["--pm", ops.pm_address, "--stream", str(stream), "--format", "jsonl", str(bad)]
    with pytest.raises(PySparkException, match="a line is not JSON: not json"):
        load_files.main(argv)
