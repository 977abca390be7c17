#!/usr/bin/env python
"""Query a dumpstore store with Spark SQL, restricted to the live ingests (docs/scale-out.md's Spark example, timed).

Usage::

    python bench/spark_query.py STORE        # needs pyspark and Java 17 (not a dumpstore dependency)

Prints rows and NaN leaves per run and step over the live ingests, then the row count per run over every file
(files of replaced ingests included, to show what the catalog restriction leaves out), and the seconds taken.
"""

from __future__ import annotations

import sys
import time


def main(store: str) -> None:
    t = time.perf_counter()
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[*]").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    started = time.perf_counter()
    spark.read.parquet(f"{store}/runs.parquet").select("run", "ingest_id").createOrReplaceTempView("live")
    (
        spark.read.option("basePath", f"{store}/tensors")
        .parquet(f"{store}/tensors")  # run, step, rank from the paths
        .join(spark.table("live"), ["run", "ingest_id"], "left_semi")  # only the live ingests
        .createOrReplaceTempView("tensors")
    )
    spark.sql(
        "select run, step, count(*) rows, sum(cast(has_nan as int)) nan_leaves "
        "from tensors group by run, step order by run, step"
    ).show()
    spark.read.option("basePath", f"{store}/tensors").parquet(f"{store}/tensors").groupBy("run").count().show()
    print(f"spark start {started - t:.1f} s, queries {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
