"""The launcher's command line: its own options before `--`, train.py's arguments after it, both
checked before any process starts (a mistake ends in one `error:` line, exit code 2)."""

import argparse
import dataclasses
import os
from pathlib import Path

from configs import UserError, load_config
from configs.schema import JobConfig

USAGE = (
    "python scripts/launch_monarch.py --nproc-per-host N [--hosts H] [--replica-groups G] "
    "[--max-restarts K] [--hang-timeout S] [--scheduler local|slurm|kubernetes] -- <train.py arguments>"
)


@dataclasses.dataclass
class Launch:
    """What to start and how to supervise it, from the command line."""

    nproc_per_host: int
    hosts: int
    replica_groups: int  # 1: no fault tolerance; >= 2: torchft groups, each its own mesh
    max_restarts: int  # per replica group (the whole job without fault tolerance)
    hang_timeout_s: float | None  # None: no hang detection
    min_replicas: int  # torchft: groups needed for a quorum
    scheduler: str  # "local", "slurm" or "kubernetes"
    slurm: dict  # SlurmJob's arguments (scheduler "slurm")
    kubernetes: dict  # the cluster and image (scheduler "kubernetes")
    train_args: list[str]  # as given after `--`
    config: JobConfig  # train.py's config from train_args (group 0's with fault tolerance)
    dump_folder: Path  # absolute: the controller reads progress and checkpoints there

    @property
    def fault_tolerance(self) -> bool:
        return self.replica_groups > 1

    def group_args(self, group: int) -> list[str]:
        """train.py's arguments for one replica group."""
        if not self.fault_tolerance:
            return list(self.train_args)
        return [*self.train_args, "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(group),
                "--fault_tolerance.group_size", str(self.replica_groups)]  # fmt: skip

    def metrics_file(self, group: int) -> Path:
        """Where rank 0 of a group logs its steps (fault tolerance: each group in replica_<id>/)."""
        folder = self.dump_folder / f"replica_{group}" if self.fault_tolerance else self.dump_folder
        return folder / "metrics.jsonl"

    @property
    def checkpoint_folder(self) -> Path:
        return self.dump_folder / self.config.checkpoint.folder


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage and exits; here: one line, exit 2
        raise UserError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="launch_monarch.py", usage=USAGE)
    option = parser.add_argument
    option("--nproc-per-host", type=int, metavar="N", required=True, help="train.py processes per host")
    option("--hosts", type=int, metavar="H", default=1, help="hosts per replica group (local: simulated)")
    option("--replica-groups", type=int, metavar="G", default=1, help="torchft groups; >= 2 turns it on")
    option("--max-restarts", type=int, metavar="K", default=0, help="restarts allowed per replica group")
    option("--hang-timeout", type=float, metavar="S", help="seconds with no new logged step: a hang")
    option("--min-replicas", type=int, metavar="M", default=1, help="torchft: groups needed for a quorum")
    option("--scheduler", choices=["local", "slurm", "kubernetes"], default="local")
    option = parser.add_argument_group("slurm (monarch.job.SlurmJob)").add_argument
    option("--partition")
    option("--time-limit", help="HH:MM:SS")
    option("--account")
    option("--qos")
    option("--gpus-per-host", type=int, metavar="N", help="slurm and kubernetes")
    option("--sbatch-arg", action="append", metavar="ARG", default=[], help="e.g. --sbatch-arg=--mem=0")
    option("--worker-port", type=int, metavar="PORT", help="Monarch workers' port (slurm, kubernetes)")
    option = parser.add_argument_group("kubernetes (monarch.job.kubernetes.KubernetesJob)").add_argument
    option("--namespace", default="default")
    option("--image", help="worker image that holds this repository")
    option("--kubeconfig", help="from outside the cluster")
    return parser


def parse(argv: list[str]) -> Launch:
    """The launcher's options and train.py's arguments, checked; UserError names the mistake."""
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            _parser().parse_args(["--help"])  # prints the options and exits
        raise UserError(f"put train.py's arguments after --: {USAGE}")
    split = argv.index("--")
    options, train_args = _parser().parse_args(argv[:split]), argv[split + 1 :]
    for flag, value, least in (("--nproc-per-host", options.nproc_per_host, 1), ("--hosts", options.hosts, 1),
                               ("--replica-groups", options.replica_groups, 1),
                               ("--max-restarts", options.max_restarts, 0),
                               ("--min-replicas", options.min_replicas, 1)):  # fmt: skip
        if value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    if options.hang_timeout is not None and options.hang_timeout <= 0:
        raise UserError(f"--hang-timeout must be > 0 seconds, got {options.hang_timeout:g}")
    if options.min_replicas > options.replica_groups:
        raise UserError(
            f"--min-replicas {options.min_replicas} is more than --replica-groups {options.replica_groups}"
        )
    if options.scheduler == "kubernetes" and options.image is None:
        raise UserError("--scheduler kubernetes needs --image: a worker image that holds this repository")
    config = _train_config(train_args, options.replica_groups)
    if options.max_restarts > 0 and options.replica_groups == 1 and not config.checkpoint.enable:
        raise UserError(
            f"--max-restarts {options.max_restarts} without --checkpoint.enable: each restart would "
            "train from step 0 again (turn them on: --checkpoint.enable --checkpoint.interval N)"
        )
    slurm = {"partition": options.partition, "time_limit": options.time_limit, "account": options.account,
             "qos": options.qos, "gpus_per_node": options.gpus_per_host, "slurm_args": options.sbatch_arg,
             "monarch_port": options.worker_port or 22222}  # fmt: skip
    kubernetes = {"namespace": options.namespace, "image": options.image, "kubeconfig": options.kubeconfig,
                  "gpus_per_host": options.gpus_per_host, "port": options.worker_port or 26600}  # fmt: skip
    return Launch(
        options.nproc_per_host, options.hosts, options.replica_groups, options.max_restarts,
        options.hang_timeout, options.min_replicas, options.scheduler, slurm, kubernetes, train_args,
        config, Path(os.path.abspath(config.job.dump_folder)),
    )  # fmt: skip


def _train_config(train_args: list[str], replica_groups: int) -> JobConfig:
    """train.py's config, loaded as train.py will load it (group 0's with fault tolerance)."""
    if not train_args:
        raise UserError(f"no train.py arguments after --: {USAGE}")
    config = load_config(train_args)
    if config.fault_tolerance.enable and replica_groups == 1:
        raise UserError(
            "fault_tolerance.enable: give the launcher --replica-groups G instead (it starts the lighthouse "
            "and sets each group's fault_tolerance.replica_id and group_size)"
        )
    if replica_groups == 1:
        return config
    overrides = ["--fault_tolerance.enable", "--fault_tolerance.replica_id", "0",
                 "--fault_tolerance.group_size", str(replica_groups)]  # fmt: skip
    return load_config([*train_args, *overrides])
