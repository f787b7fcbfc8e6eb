"""Run a command that the kernel kills (SIGKILL) when the process that started it dies.

    python -S die_with_parent.py PARENT_PID COMMAND [ARGUMENTS...]

The trainer actor starts each train.py through this file: it asks the kernel for a parent-death
signal (prctl PR_SET_PDEATHSIG), then replaces itself with the command, which keeps the request.
So when the actor's process dies, however it dies (the controller killed with SIGKILL, Monarch
tearing a mesh down, the process crashing), its train.py goes with it instead of training on as an
orphan. SIGKILL and not SIGTERM: a rank whose supervisor is gone must not start a checkpoint save
that its peers may not join; the last complete checkpoint stays as it is (saves are atomic).

The kernel sends the signal when the *thread* that started this process ends, so the actor starts
it from a thread that lives until the child has exited. Linux only (prctl).
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1

if __name__ == "__main__":
    parent, command = int(sys.argv[1]), sys.argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit(f"error: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # the parent died before the request: nobody would stop the command
        sys.exit(128 + signal.SIGKILL)
    os.execvp(command[0], command)
