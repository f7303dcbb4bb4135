"""A SparkSession set up for the ``sbp`` data source.

PySpark has a few traps for a Python data source, all handled here before
the session (and its JVM) starts:

- Python workers must run the driver's interpreter, or they cannot import
  this package: ``PYSPARK_PYTHON`` is set to ``sys.executable`` (the
  ``spark.pyspark.python`` setting is not enough for local mode).
- Spark's INFO logging buries a job's own output: a quiet ``log4j2``
  configuration is used unless ``SPARK_CONF_DIR`` is already set.
- The local driver binds to loopback, so no network lookup delays start-up.

Under ``spark-submit`` the master and the JVM come from the command line and
``PYSPARK_PYTHON`` from its environment; the helper then leaves the master
alone and only registers the source.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: the master used when neither the caller nor spark-submit chose one
DEFAULT_MASTER = "local[2]"

#: settings a small local session wants; the caller's ``conf`` wins
DEFAULT_CONF: Mapping[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # 200 shuffle partitions cost seconds of task overhead on a small machine
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
}

_QUIET_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.nativeloader.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativeloader.level = error
"""


def _quiet_conf_dir() -> Path:
    """A directory holding the quiet ``log4j2.properties`` (written once per user)."""
    conf_dir = Path(tempfile.gettempdir()) / f"sbp-spark-conf-{os.getuid()}"
    conf_dir.mkdir(exist_ok=True)
    properties = conf_dir / "log4j2.properties"
    if not properties.exists() or properties.read_text() != _QUIET_LOG4J2:
        properties.write_text(_QUIET_LOG4J2)
    return conf_dir


def _under_spark_submit() -> bool:
    # spark-submit starts the JVM first and hands the Python driver its gateway
    return "PYSPARK_GATEWAY_PORT" in os.environ


def prepare_environment() -> None:
    """Set the environment Spark's launcher and workers read (idempotent)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("SPARK_CONF_DIR", str(_quiet_conf_dir()))


def spark_session(
    app_name: str = "sbp",
    *,
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """The session (created, or the running one) with the ``sbp`` source registered.

    ``master`` defaults to ``local[2]``, except under spark-submit, whose
    ``--master`` is kept.
    """
    prepare_environment()
    from pyspark.sql import SparkSession

    from .source import SBPDataSource

    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    elif not _under_spark_submit():
        builder = builder.master(DEFAULT_MASTER)
    for key, value in {**DEFAULT_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.dataSource.register(SBPDataSource)
    return spark
