"""The process sandbox that reward functions and environments share (rlkit/rewards/scorer.py and
rlkit/envs/workers.py start their workers through it):

- containment.py: what a worker may take and leave (memory and process limits, its own session and
  process group, a pids cgroup, the sweep of what it leaves behind);
- reaper.py: the process that outlives a SIGKILLed trainer and kills what its workers left;
- protocol.py: the worker protocol (die with the parent, serve requests on a pipe, read replies, exit
  reasons in words).

A bottom-layer package: it imports nothing of rlkit outside itself.
"""
