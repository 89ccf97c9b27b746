"""DuckDB views over a run's Parquet tables: `rollouts` and `steps` (one file per stage/step).

    from dashboards.views import connect
    db = connect("outputs/runs/<run_id>")          # or "outputs/runs/*" for all runs
    db.sql("SELECT stage, step, avg(reward) FROM rollouts GROUP BY ALL ORDER BY ALL").show()
"""

from __future__ import annotations

from pathlib import Path

import duckdb

TABLES = ("rollouts", "steps")


def connect(run_dir: str | Path) -> duckdb.DuckDBPyConnection:
    db = duckdb.connect()
    for table in TABLES:
        pattern = f"{run_dir}/{table}/*/*.parquet"
        db.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{pattern}', union_by_name = true)")
    return db
