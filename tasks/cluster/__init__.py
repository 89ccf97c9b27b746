"""Ray: the one place that imports it. Connect to a cluster or start a local one, place the
run's actors (trainer ranks, vLLM engines, sandbox replicas) and move weights between them.

The same code runs a 2-core laptop (a local Ray the run starts and stops) and a GPU cluster
(`cluster.address`); the placement plan itself is pure (plan.py) and needs no Ray.
"""

import os

# Read by Ray when it is imported: "0" keeps a local Ray (and ray.cluster_utils.Cluster) on
# 127.0.0.1, every service and node address on loopback. A run on a cluster names it in
# $RAY_ADDRESS and runs on one of its nodes, which have addresses of their own.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
