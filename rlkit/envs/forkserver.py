"""The preload of the fork server that environment workers fork from (rlkit/envs/workers.py): imported there,
never by the trainer.

It makes the fork server ignore SIGTERM, as the workers do: a SIGTERM to the whole process group (`timeout`,
`docker stop`, Slurm, systemd) is the trainer's to handle, and the fork server dying of it would take the
workers of the current step with it (they die with their parent, PR_SET_PDEATHSIG), failing episodes of the
step the trainer is finishing. The fork server still exits when the trainer does (its alive pipe closes).
The check on the parent's pid keeps any other process that imports this module from ignoring SIGTERM.

It also marks the fork server's `__main__` as the trainer's main module (name or path, from the trainer's
multiprocessing preparation data), so that multiprocessing does not run that module again in each worker
it forks: the trainer's main is `rlkit.train` or a user's script, which imports torch, and the 8 workers of a
batch each importing torch took over a minute to start on a loaded machine ("did not start within 60s"). Workers never
need it: environments are imported by path (`__main__:Class` is refused at start-up).
"""

from __future__ import annotations

import importlib.machinery
import os
import signal
import sys

import rlkit.envs.workers  # noqa: F401  (preloaded: workers fork with it imported)

PARENT = "RLKIT_ENV_FORKSERVER_PARENT"
"""Environment variable: the pid of the trainer that starts the fork server."""

if os.environ.get(PARENT) == str(os.getppid()):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    main = sys.modules["__main__"]
    if os.environ.get("RLKIT_ENV_MAIN_NAME"):
        main.__spec__ = importlib.machinery.ModuleSpec(os.environ["RLKIT_ENV_MAIN_NAME"], None)
    if os.environ.get("RLKIT_ENV_MAIN_PATH"):
        main.__file__ = os.environ["RLKIT_ENV_MAIN_PATH"]
