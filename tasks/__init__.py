"""The work of the pipeline, in two kinds of module; tests/test_layout.py holds the rule.

- A file directly in tasks/ (curate.py, sft.py, policy.py, grpo.py, report.py, resume.py,
  ablation.py) holds Prefect `@task` functions only, a few lines each over the library below:
  what the flows in flows/ call.
- A folder is library code, plain Python without Prefect, usable from a test, a benchmark or a
  notebook: config, data, sandbox, rollout, reward, rl, train, store, summary, tracking, runtime,
  cluster (the one place that imports Ray: actors, placement, weight sync).
  Pure algorithms (RoC, advantages, loss, scheduler policy, answer extraction, curation filters)
  do no I/O. The record types every area shares (problem, tool-call outcome, trajectory, sample,
  rollout spec, run context) are at the bottom, in tasks/records, which imports nothing of the
  project; the areas sit in layers above it and import only downwards.
"""
