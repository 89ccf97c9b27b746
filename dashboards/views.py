"""DuckDB views over a run's Parquet tables (dashboards/views.sql): rollouts, tool_calls, steps,
evaluations, health.

    from dashboards.views import connect
    db = connect("outputs/runs/<run_id>")          # or "outputs/runs/*" for all runs
    db.sql("SELECT stage, step, avg(reward) FROM rollouts GROUP BY ALL ORDER BY ALL").show()

A view whose files do not exist yet (a run still in its first stage) is left out, so queries on
the others work during a run.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from tasks.store.tables import PARTITIONS, read_parquet_sql

VIEWS_SQL = Path(__file__).with_name("views.sql")


def connect(runs: str | Path) -> duckdb.DuckDBPyConnection:
    db = duckdb.connect()
    script = VIEWS_SQL.read_text()
    quoted = str(runs).replace("'", "''")
    for table in PARTITIONS:
        script = script.replace("{" + table + "}", read_parquet_sql(quoted, table))
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("--"))
    for statement in (s.strip() for s in code.split(";")):
        if not statement:
            continue
        try:
            db.execute(statement)
        except (duckdb.IOException, duckdb.CatalogException):
            pass  # no files for this table yet, or for a table this view reads
    return db
