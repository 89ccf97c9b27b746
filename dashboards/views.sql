-- DuckDB views over the Parquet tables of one run folder or many. `{rollouts}`, `{steps}` and
-- `{evaluations}` stand for the read of that table in every run matched by the folder or glob
-- given to dashboards/views.py or `rstar2 query` (e.g. outputs/runs/* for every run); the
-- partition layout they read comes from tasks/store/tables.py (PARTITIONS). A filter on a
-- partition column (stage, step; checkpoint, benchmark) reads only the matching folders.
-- One row per rollout (RL steps, difficulty filter, evaluations: stage "eval-<checkpoint>[-<benchmark>]").
CREATE OR REPLACE VIEW rollouts AS SELECT * FROM {rollouts};
-- One row per tool call, unnested from the rollouts (call index, structured sandbox status).
CREATE OR REPLACE VIEW tool_calls AS
    SELECT run_id, stage, step, problem_id, sample, unnest(tool_statuses) AS status,
           generate_subscripts(tool_statuses, 1) AS call
    FROM rollouts;
-- One row per assistant turn, unnested from the rollouts: the engine that served it, the request's
-- context and what was new in it, the tokens generated, when it was sent and came back (epoch
-- seconds), and its tool call's latency and response tokens (null latency: no call answered).
CREATE OR REPLACE VIEW turns AS
    SELECT run_id, stage, step, problem_id, sample, turn, t.engine, t.context_tokens, t.added_tokens,
           t.generated_tokens, t.started_at, t.ended_at, t.ended_at - t.started_at AS generation_s,
           t.tool_latency_s, t.tool_response_tokens
    FROM (SELECT *, unnest(turn_trace) AS t, generate_subscripts(turn_trace, 1) AS turn FROM rollouts);
-- One row per (run, stage, step, metric): everything an RL step logged to MLflow.
CREATE OR REPLACE VIEW steps AS SELECT * FROM {steps};
-- One row per (run, checkpoint, benchmark): avg@k pass@1 and tool use.
CREATE OR REPLACE VIEW evaluations AS SELECT * FROM {evaluations};
-- One row per (run, stage, step): what faults cost the step. Engines found dead and the rollouts
-- moved off them, engines back in the pool after a restart, sandbox calls sent again after a
-- replica failed to answer, and calls answered `internal` (an outage, never counted against
-- the model).
CREATE OR REPLACE VIEW health AS
    SELECT run_id, stage, step,
           max(value) FILTER (metric = 'engine_deaths') AS engine_deaths,
           max(value) FILTER (metric = 'requeued_rollouts') AS requeued_rollouts,
           max(value) FILTER (metric = 'engine_restarts') AS engine_restarts,
           max(value) FILTER (metric = 'sandbox_retries') AS sandbox_retries,
           max(value) FILTER (metric = 'tool_internal') AS tool_internal
    FROM steps GROUP BY ALL;
-- One row per (run, stage, step): rl.async at work. Staleness is how many policy versions the
-- step's rollouts lag behind its update (0 on-policy); dropped: rollouts too stale to train on,
-- drawn again; reused: rollouts finished before the step began (drawn ahead, or before an
-- interruption); idle: the share of the step's wall time the trainer and the engines sat idle.
CREATE OR REPLACE VIEW asynchrony AS
    SELECT run_id, stage, step,
           max(value) FILTER (metric = 'staleness/mean') AS staleness_mean,
           max(value) FILTER (metric = 'staleness/max') AS staleness_max,
           coalesce(max(value) FILTER (metric = 'staleness/dropped'), 0)
               + coalesce(max(value) FILTER (metric = 'staleness/dropped_ahead'), 0) AS stale_dropped,
           max(value) FILTER (metric = 'rollouts_reused') AS rollouts_reused,
           coalesce(max(value) FILTER (metric = 'rollouts_ahead'), 0) AS rollouts_ahead,
           max(value) FILTER (metric = 'idle/trainer') AS trainer_idle,
           max(value) FILTER (metric = 'idle/engines') AS engines_idle,
           max(value) FILTER (metric = 'time_step_s') AS step_s
    FROM steps GROUP BY ALL;
