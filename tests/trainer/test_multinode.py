"""The README's multi-node launch line, with two local "nodes": two `torchrun --nnodes 2 --nproc-per-node 1`
commands meeting at one c10d rendezvous, the learner on FSDP2 over gloo. Same metrics as one process."""

import subprocess
import sys

import pytest
import torch
from run_helpers import FIXTURES, launch_env, overrides, read_jsonl, tiny, train  # noqa: F401 (tiny: a fixture)

from rlkit.checkpoints import latest_checkpoint
from rlkit.collectives import free_port

pytestmark = pytest.mark.slow  # a torchrun launch of two nodes: `make test-fast` leaves it out


def test_two_nodes_under_torchrun_equal_one_process(tiny, tmp_path):  # noqa: F811
    one, two = tmp_path / "one", tmp_path / "two"
    env = launch_env(tmp_path)  # torchrun's own log folder (torchelastic_*, never removed) lands in tmp_path
    args = overrides(tiny, two, "rollout.seed_per_prompt=true", "trainer.strategy=fsdp2")
    port = free_port()
    # The README's line (`torchrun` is `python -m torch.distributed.run`); the rendezvous ranks the nodes.
    line = (
        f"--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} -m rlkit.train"
    )
    command = [sys.executable, "-m", "torch.distributed.run", *line.split(), *args]
    nodes = [
        subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    # The 1-process reference runs here meanwhile.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each node: sampling a random model is sensitive to the summation order
    try:
        train(tiny, one, "rollout.seed_per_prompt=true")
    finally:
        torch.set_num_threads(threads)
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-5000:]

    m1, m2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert len(m1) == len(m2) == 3  # the step-0 baseline eval, then 2 steps
    assert m1[0]["eval/pass@1"] == pytest.approx(m2[0]["eval/pass@1"])
    keys = ["reward/mean", "reward/std", "response_length/mean", "loss/total", "grad_norm", "mismatch/kl"]
    for a, b in zip(m1[1:], m2[1:]):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert latest_checkpoint(two).name == "step_2"
    assert (latest_checkpoint(two) / "state" / "pytorch_model_fsdp_0").is_dir()  # FSDP2's sharded state
