"""The Prefect automation that marks a flow run Crashed once its driver stops sending heartbeats.

A driver killed by SIGKILL (the OOM killer, a preempted machine) cannot report its own end, so its
flow run would stay Running forever, and the UI offers no Retry on a running flow run, while Retry
is how a user resumes a run. Flow runs send a heartbeat every PREFECT_FLOWS_HEARTBEAT_FREQUENCY
seconds (scripts/services.sh sets 30, Prefect's floor); one that sends neither a heartbeat nor a
final state for `within_s` is set to Crashed, and its Retry resumes the run where it stood.

    python -m flows.automations      # scripts/services.sh start runs this; it is idempotent
"""

from __future__ import annotations

from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

NAME = "rstar2: crash flow runs whose driver is gone"
# Three missed heartbeats at 30 s: a driver busy in a long step still sends them from a thread.
WITHIN_S = 90


def zombie_automation(within_s: int = WITHIN_S) -> Automation:
    final = [f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")]
    return Automation(
        name=NAME,
        description="A flow run that sent no heartbeat and no final state for a while lost its driver.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *final},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within_s} s: the process running this flow run is gone",
            )
        ],
    )


def ensure_zombie_automation(within_s: int = WITHIN_S) -> None:
    """Create the automation on the Prefect server PREFECT_API_URL names, unless it exists."""
    try:
        Automation.read(name=NAME)
    except ValueError:  # Prefect's "not found"
        zombie_automation(within_s).create()
        print(f"created automation {NAME!r} ({within_s} s)")


if __name__ == "__main__":
    ensure_zombie_automation()
