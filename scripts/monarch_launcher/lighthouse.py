"""torchft's lighthouse for --replica-groups, started by the controller as
scripts/fault_tolerance_local.sh starts it (its log: <dump_folder>/lighthouse.log). It dies with the
controller (die_with_parent.py): a killed controller leaves no lighthouse behind."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from configs import UserError
from scripts.monarch_launcher.trainer_actor import DIE_WITH_PARENT, free_port

HEARTBEAT_TIMEOUT_MS = 5000  # a group silent this long is left out of the next quorum


def start_lighthouse(min_replicas: int, dump_folder: Path, local: bool) -> tuple[subprocess.Popen, str]:
    """The running lighthouse and its address for TORCHFT_LIGHTHOUSE (this host's name when the
    groups run elsewhere)."""
    binary = shutil.which("torchft_lighthouse")
    if binary is None:
        raise UserError("--replica-groups needs torchft's torchft_lighthouse on PATH (pip install torchft)")
    port = free_port()
    dump_folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-S", DIE_WITH_PARENT, str(os.getpid()), binary,
               "--min_replicas", str(min_replicas), "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
               "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS), "--bind", f"[::]:{port}"]  # fmt: skip
    with open(dump_folder / "lighthouse.log", "ab") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://{'localhost' if local else socket.getfqdn()}:{port}"
