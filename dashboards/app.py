"""Streamlit dashboard over the DuckDB views (dashboards/views.sql).

    .venv/bin/streamlit run dashboards/app.py -- --runs "outputs/runs/*"

Reward and pass@1 by step, the tool-error share of all trajectories against kept positive ones
(GRPO-RoC's signature: with RoC the kept positives' share falls), response length and turns,
tool latency, what faults cost each step (cluster health), staleness and idle time under rl.async,
and a per-problem drill-down with the trajectory text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import streamlit as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboards.views import connect  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--runs", default="outputs/runs/*")
args, _ = parser.parse_known_args()

st.set_page_config(page_title="rstar2-pipeline", layout="wide")
st.title("rstar2-pipeline runs")
runs = st.sidebar.text_input("Run folder or glob", args.runs)
db = connect(runs)
run_ids = [r[0] for r in db.sql("SELECT DISTINCT run_id FROM rollouts ORDER BY 1").fetchall()]
if not run_ids:
    st.warning(f"No rollouts under {runs}")
    st.stop()
run_id = st.sidebar.selectbox("Run", run_ids, index=len(run_ids) - 1)
q = {"run": run_id}

st.header("Reward and pass@1")
left, right = st.columns(2)
reward = db.execute(
    "SELECT stage || ' ' || lpad(step::VARCHAR, 4, '0') AS step, value AS reward FROM steps "
    "WHERE run_id = $run AND metric = 'reward_mean' ORDER BY stage, step",
    q,
).df()
left.subheader("Training reward by RL step")
left.line_chart(reward, x="step", y="reward")
evaluations = db.execute("SELECT checkpoint, benchmark, pass_at_1 FROM evaluations WHERE run_id = $run", q).df()
right.subheader("avg@k pass@1 by checkpoint")
right.bar_chart(evaluations.pivot(index="checkpoint", columns="benchmark", values="pass_at_1"))

st.header("Tool errors: all trajectories vs kept positives")
errors = db.execute(
    """
    SELECT stage || ' ' || lpad(step::VARCHAR, 4, '0') AS step,
           sum(tool_failures)::DOUBLE / greatest(sum(tool_calls), 1) AS "all trajectories",
           sum(tool_failures) FILTER (kept AND reward > 0)::DOUBLE
               / greatest(sum(tool_calls) FILTER (kept AND reward > 0), 1) AS "kept positives"
    FROM rollouts WHERE run_id = $run AND stage NOT LIKE 'eval-%' GROUP BY ALL ORDER BY 1""",
    q,
).df()
st.line_chart(errors, x="step")

st.header("Response length, turns and tool latency")
cols = st.columns(3)
shape = db.execute(
    """
    SELECT stage || ' ' || lpad(step::VARCHAR, 4, '0') AS step, avg(response_tokens) AS "response tokens",
           avg(turns) AS turns
    FROM rollouts WHERE run_id = $run AND stage NOT LIKE 'eval-%' GROUP BY ALL ORDER BY 1""",
    q,
).df()
cols[0].line_chart(shape, x="step", y="response tokens")
cols[1].line_chart(shape, x="step", y="turns")
latency = db.execute(
    """
    SELECT stage || ' ' || lpad(step::VARCHAR, 4, '0') AS step,
           max(value) FILTER (metric = 'time_tool_exec_s') / greatest(max(value) FILTER (metric = 'tool_calls'), 1)
               AS "mean tool latency s"
    FROM steps WHERE run_id = $run GROUP BY ALL ORDER BY 1""",
    q,
).df()
cols[2].line_chart(latency, x="step", y="mean tool latency s")

st.header("Cluster health")
st.caption(
    "Per RL step: engines found dead and the rollouts moved to the others, engines back after a "
    "restart, sandbox calls retried after a replica failed, calls answered `internal` (an outage)."
)
health = db.execute(
    "SELECT stage, step, * EXCLUDE (run_id, stage, step) FROM health WHERE run_id = $run ORDER BY stage, step", q
).df()
st.dataframe(health, use_container_width=True, hide_index=True)

st.header("Overlap: staleness and idle time")
st.caption(
    "Per RL step (rl.async): policy versions the rollouts lag behind the update, and the share of "
    "the step the trainer and the engines sat idle; on-policy, one waits while the other works."
)
overlap = db.execute(
    """
    SELECT stage || ' ' || lpad(step::VARCHAR, 4, '0') AS step, trainer_idle AS "trainer idle",
           engines_idle AS "engines idle", staleness_mean AS "staleness (versions)"
    FROM asynchrony WHERE run_id = $run ORDER BY 1""",
    q,
).df()
cols = st.columns(2)
cols[0].line_chart(overlap, x="step", y=["trainer idle", "engines idle"])
cols[1].line_chart(overlap, x="step", y="staleness (versions)")

st.header("Problem drill-down")
problems = [
    r[0]
    for r in db.execute(
        "SELECT problem_id FROM rollouts WHERE run_id = $run GROUP BY 1 ORDER BY avg(reward) DESC, 1", q
    ).fetchall()
]
problem = st.selectbox("Problem", problems)
rows = db.execute(
    """
    SELECT stage, step, sample, reward, kept, stop_reason, tool_statuses, question, label, predicted, response
    FROM rollouts WHERE run_id = $run AND problem_id = $problem ORDER BY stage, step, sample""",
    {**q, "problem": problem},
).df()
st.markdown(f"**{rows['question'].iloc[0]}**  (label {rows['label'].iloc[0]})")
st.dataframe(rows.drop(columns=["question", "label", "response"]), use_container_width=True)
choice = st.selectbox(
    "Trajectory",
    range(len(rows)),
    format_func=lambda i: f"{rows['stage'][i]} step {rows['step'][i]} sample {rows['sample'][i]}",
)
st.code(rows["response"][choice], language=None)
