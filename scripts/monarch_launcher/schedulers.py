"""Where the meshes' processes run: this machine, a Slurm allocation or Kubernetes pods, through
Monarch's job kinds (monarch.job.SlurmJob, monarch.job.kubernetes.KubernetesJob). The rest of the
launcher only asks a group's Hosts for a new process mesh, once per attempt: a restart reuses the
allocation, so no job is requeued and no pod rescheduled.

Each replica group gets its own hosts (one Monarch host mesh, named group<id>). Remote workers
import this repository from the same path as the controller (a shared file system, or an image
that holds it there) and start train.py from the controller's working directory.
"""

import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from configs import UserError
from scripts.monarch_launcher.command_line import Launch

REPO = Path(__file__).resolve().parent.parent.parent


class Hosts:
    """One replica group's hosts. On the local machine, --hosts H > 1 is simulated: H x N
    processes here, ranked as H hosts of N would be (for trying a multi-host layout)."""

    def __init__(self, host_mesh, hosts: int, local: bool):
        self.host_mesh, self.hosts, self.local = host_mesh, hosts, local

    def spawn_procs(self, nproc_per_host: int):
        if self.local and self.hosts > 1:
            return self.host_mesh.spawn_procs(per_host={"hosts": self.hosts, "procs": nproc_per_host})
        return self.host_mesh.spawn_procs(per_host={"procs": nproc_per_host})


def allocate(launch: Launch) -> tuple[list[Hosts], Callable[[], None]]:
    """Every group's Hosts, and what gives the allocation back at the end."""
    groups = range(launch.replica_groups)
    if launch.scheduler == "local":
        from monarch.actor import this_host

        return [Hosts(this_host(), launch.hosts, local=True) for _ in groups], lambda: None
    job = slurm_job(launch) if launch.scheduler == "slurm" else kubernetes_job(launch)
    try:
        state = job.state(cached_path=None)  # submits, then waits until the allocation runs
    except BaseException as e:  # Monarch's Rust panics too (pyo3's PanicException is no Exception)
        job.kill()
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise  # a stop signal, Ctrl-C
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"the {launch.scheduler} job did not start: {reason}") from e
    return [Hosts(getattr(state, mesh_name(g)), launch.hosts, local=False) for g in groups], job.kill


def mesh_name(group: int) -> str:
    return f"group{group}"  # Kubernetes: lowercase letters and digits only


def slurm_job(launch: Launch):
    """One sbatch job holding every group's hosts; its output files go to the dump folder."""
    from monarch.job import SlurmJob

    settings = launch.slurm
    # Workers import this repository's actor: the same interpreter and path on every node.
    python = f"env PYTHONPATH={shlex.quote(str(REPO))} {shlex.quote(sys.executable)}"
    return SlurmJob(
        meshes={mesh_name(g): launch.hosts for g in range(launch.replica_groups)},
        python_exe=python, slurm_args=settings["slurm_args"], job_name="launch_monarch",
        time_limit=settings["time_limit"], partition=settings["partition"], log_dir=str(launch.dump_folder),
        gpus_per_node=settings["gpus_per_node"], account=settings["account"], qos=settings["qos"],
        monarch_port=settings["monarch_port"],
    )  # fmt: skip


def kubernetes_job(launch: Launch):
    """A MonarchMesh per group (the operator makes the pods), from --image."""
    try:
        from monarch.job.kubernetes import ImageSpec, KubeConfig, KubernetesJob
    except RuntimeError as e:  # Monarch's message when the kubernetes client is missing
        raise UserError(f"--scheduler kubernetes: {e}") from e
    settings = launch.kubernetes
    kubeconfig = KubeConfig.from_path(settings["kubeconfig"]) if settings["kubeconfig"] else None
    job = KubernetesJob(namespace=settings["namespace"], kubeconfig=kubeconfig)
    resources = {"nvidia.com/gpu": settings["gpus_per_host"]} if settings["gpus_per_host"] else None
    for g in range(launch.replica_groups):
        image = ImageSpec(settings["image"], resources=resources)
        job.add_mesh(mesh_name(g), launch.hosts, image_spec=image, port=settings["port"])
    return job
