"""The preload of the fork server that environment workers fork from (rlkit/envs/workers.py): imported there,
never by the trainer.

It makes the fork server ignore SIGTERM, as the workers do: a SIGTERM to the whole process group (`timeout`,
`docker stop`, Slurm, systemd) is the trainer's to handle, and the fork server dying of it would take the
workers of the current step with it (they die with their parent, PR_SET_PDEATHSIG), failing episodes of the
step the trainer is finishing. The fork server still exits when the trainer does (its alive pipe closes).
The check on the parent's pid keeps any other process that imports this module from ignoring SIGTERM.
"""

from __future__ import annotations

import os
import signal

import rlkit.envs.workers  # noqa: F401  (preloaded: workers fork with it imported)

PARENT = "RLKIT_ENV_FORKSERVER_PARENT"
"""Environment variable: the pid of the trainer that starts the fork server."""

if os.environ.get(PARENT) == str(os.getppid()):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
