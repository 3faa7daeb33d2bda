"""A night across many machines (tilecast.workflows.fleet) as Prefect flows.

`fleet_night` (deployment `fleet-night`) is the parent: it cuts tonight's problems into
shards and runs each as a flow run of the `shard` deployment (`shard_night`) on the work pool
its deployment names, one pool per hardware class; it waits for them, gives a failed or
silent shard to another worker, and trains, evaluates, reports and publishes once. A run of
`shard_night` measures one shard on whichever worker of the pool took it.
"""
from __future__ import annotations

from uuid import UUID

from prefect import flow

from tilecast.workflows import fleet

# Prefect state types as a fleet reads them
_PENDING = {"SCHEDULED", "PENDING", "PAUSED"}
_RUNNING = {"RUNNING"}
_FAILED = {"FAILED", "CRASHED", "CANCELLED", "CANCELLING"}


class PrefectSubmitter:
    """Shards as flow runs of a deployment (default tilecast-shard/shard) on its work pool."""

    def __init__(self, deployment: str = fleet.SHARD_DEPLOYMENT):
        self.deployment = deployment

    def check(self) -> None:
        """The deployment is on the server, or one line saying how to make it."""
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound
        from prefect.settings import PREFECT_API_URL

        try:
            with get_client(sync_client=True) as client:
                deployment = client.read_deployment_by_name(self.deployment)
                pool = deployment.work_pool_name
                if pool:
                    try:
                        client.read_work_pool(pool)
                    except ObjectNotFound:
                        raise fleet.FleetError(
                            f"work pool {pool} of deployment {self.deployment} does not exist: "
                            f"`prefect work-pool create {pool} --type process`, then a worker "
                            "on each machine") from None
                    online = [w for w in client.read_workers_for_work_pool(pool)
                              if str(getattr(w.status, "value", w.status)).upper() == "ONLINE"]
                    if not online:
                        print(f"WARNING: no worker of pool {pool} is online now; the shards "
                              "wait for one until the night's deadline")
        except fleet.FleetError:
            raise
        except ObjectNotFound:
            raise fleet.FleetError(
                f"deployment {self.deployment} is not on the Prefect server at "
                f"{PREFECT_API_URL.value()}: create it with `prefect --no-prompt deploy --name "
                f"{self.deployment.split('/')[-1]}` from the repository root (prefect.yaml), "
                "and start a worker on its pool") from None
        except Exception as err:   # no server: the same one line
            raise fleet.FleetError(f"the Prefect server at {PREFECT_API_URL.value()} cannot be "
                                   f"reached: {type(err).__name__}: {err}") from None

    def submit(self, name: str, key: str, parameters: dict) -> str:
        from prefect.deployments import run_deployment

        run = run_deployment(self.deployment, parameters=parameters, timeout=0,
                             idempotency_key=key, flow_run_name=f"shard {name}",
                             as_subflow=False)
        return str(run.id)

    def state(self, handle: str) -> tuple[str, str]:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(handle))
        state = run.state
        kind = state.type.value if state else "PENDING"
        message = (state.message or "") if state else ""
        if kind in _RUNNING:
            return "running", message
        if kind == "COMPLETED":
            return "completed", message
        if kind in _FAILED:
            return "failed", f"{state.name}: {message}".strip(": ")
        return "pending", message

    def cancel(self, handle: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(handle))
            if run.state is None or not run.state.is_final():
                client.set_flow_run_state(UUID(handle), Cancelling(
                    message="the fleet night gave this shard to another attempt"), force=True)


@flow(name="tilecast-shard", log_prints=True)
def shard_night(config: str, store: str, registry: str, workdir: str, night: str, shard: dict,
                hardware_class: str, attempt: int = 1, deadline: str | None = None,
                device: str | None = None, code: dict | None = None) -> dict:
    """Measure one shard of a fleet night on this worker's machine and append it to the
    store (tilecast.workflows.fleet.run_shard)."""
    return fleet.run_shard(config, store, registry, workdir, night, shard, hardware_class,
                           attempt, deadline, device, code)


@flow(name="tilecast-fleet-night", log_prints=True)
def fleet_night(config: str = "nightly", workdir: str = "work/fleet-{date}",
                registry: str = "registry", store: str = "store", shards: int = 2,
                budget_minutes: float | None = None, hardware_class: str | None = None,
                run_id: str | None = None, deployment: str = fleet.SHARD_DEPLOYMENT,
                pools: list[dict] | None = None, shard_workdir: str = "work/shards",
                lease_s: float = fleet.LEASE_S, retries: int = fleet.RETRIES,
                grace_s: float = fleet.GRACE_S, poll_s: float = fleet.POLL_S) -> dict:
    """One night of `config` over a fleet (see the module docstring): `shards` machines of one
    class on `deployment`'s pool, or `pools`, one per class ({"hardware_class", "deployment",
    "shards"}), for a mixed fleet. `run_id` resumes a night; a class that is not this
    machine's needs its profile in the store on a budgeted night (one night of it first)."""
    chosen = ([fleet.Pool(**p) for p in pools] if pools else
              [fleet.Pool(hardware_class, deployment, shards)])
    submitters = {p.deployment: PrefectSubmitter(p.deployment) for p in chosen}
    for submitter in submitters.values():   # every pool checked before anything is submitted
        submitter.check()
    settings = fleet.FleetSettings(shard_workdir=shard_workdir, lease_s=lease_s,
                                   grace_s=grace_s, poll_s=poll_s, retries=retries)
    return fleet.night(config, workdir, registry, store, chosen, submitters.__getitem__,
                       settings, budget_minutes=budget_minutes, run_id=run_id, progress=print)
