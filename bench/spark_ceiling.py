"""The ceiling of PySpark's Python data source API on the benchmark machine.

A data source whose reader does no work: each partition yields one Arrow
batch of the benchmark's rows (the ``sbp`` source's schema, 100-byte values,
``ROWS_PER_BATCH`` rows, built once) over and over. What Spark does with
those batches (sending them from the Python worker to the JVM, turning them
into rows, aggregating) is all that is measured, so no Python source, the
``sbp`` one included, can be faster on the same machine. Measured here,
2,000-row and 100,000-row batches gave the same rate as 10,000-row ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from spark_jobs.arrow import ARROW_SCHEMA
from spark_jobs.source import SCHEMA

NAME = "sbp-bench-ceiling"
ROWS_PER_BATCH = 10_000
VALUE_SIZE = 100


class _Share(InputPartition):
    def __init__(self, batches: int) -> None:
        self.batches = batches


class _Reader(DataSourceReader):
    def __init__(self, rows: int, partitions: int) -> None:
        self.rows = rows
        self.partitions_wanted = partitions

    def partitions(self) -> list[InputPartition]:
        batches = self.rows // ROWS_PER_BATCH
        share, extra = divmod(batches, self.partitions_wanted)
        return [_Share(share + (i < extra)) for i in range(self.partitions_wanted)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Share)
        n = ROWS_PER_BATCH
        values = np.random.default_rng(7).integers(0, 256, size=n * VALUE_SIZE, dtype=np.uint8)
        positions = np.arange(0, (n + 1) * VALUE_SIZE, VALUE_SIZE, dtype=np.int32)
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array(np.ones(n, dtype=np.int64)),
                pa.array(np.arange(n, dtype=np.int64)),
                pa.array(np.zeros(n, dtype=np.int64), ARROW_SCHEMA.field("timestamp").type),
                pa.nulls(n, pa.binary()),  # no keys, as plain records have none
                pa.Array.from_buffers(
                    pa.binary(), n, [None, pa.py_buffer(positions), pa.py_buffer(values)]
                ),
            ],
            schema=ARROW_SCHEMA,
        )
        for _ in range(partition.batches):
            yield batch


class CeilingSource(DataSource):
    """``spark.read.format("sbp-bench-ceiling").option("rows", N).option("partitions", P)``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        options = self.options
        return _Reader(int(options.get("rows", "0")), int(options.get("partitions", "1")))
