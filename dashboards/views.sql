-- DuckDB views over the Parquet tables of one run folder or many: `{runs}` stands for the folder
-- or glob (e.g. outputs/runs/* for every run); dashboards/views.py and `rstar2 query` fill it in.
-- Tables are hive-partitioned inside a run folder (rollouts/stage=<s>/step=<n>/part-0.parquet,
-- evaluations/checkpoint=<c>/benchmark=<b>/part-0.parquet): a filter on those columns reads only
-- the matching folders.
-- One row per rollout (RL steps, difficulty filter, evaluations: stage "eval-<checkpoint>[-<benchmark>]").
CREATE OR REPLACE VIEW rollouts AS
    SELECT * FROM read_parquet('{runs}/rollouts/*/*/*.parquet', union_by_name = true, hive_partitioning = true,
                               hive_types = {'stage': VARCHAR, 'step': INTEGER});
-- One row per tool call, unnested from the rollouts (call index, structured sandbox status).
CREATE OR REPLACE VIEW tool_calls AS
    SELECT run_id, stage, step, problem_id, sample, unnest(tool_statuses) AS status,
           generate_subscripts(tool_statuses, 1) AS call
    FROM rollouts;
-- One row per (run, stage, step, metric): everything an RL step logged to MLflow.
CREATE OR REPLACE VIEW steps AS
    SELECT * FROM read_parquet('{runs}/steps/*/*/*.parquet', union_by_name = true, hive_partitioning = true,
                               hive_types = {'stage': VARCHAR, 'step': INTEGER});
-- One row per (run, checkpoint, benchmark): avg@k pass@1 and tool use.
CREATE OR REPLACE VIEW evaluations AS
    SELECT * FROM read_parquet('{runs}/evaluations/*/*/*.parquet', union_by_name = true, hive_partitioning = true,
                               hive_types = {'checkpoint': VARCHAR, 'benchmark': VARCHAR});
