"""Every launch line of the README, the docs and the recipes that states a GPU count (torchrun's
--nproc-per-node / --nnodes, `trainer.num_processes=`, a `# N GPUs` comment or an "on N GPUs:" line before
its code block, "k GPUs" for any count) is composed with the world sizes it implies and checked: the learner
world `python -m rlkit.train` chooses on that many GPUs, or the launcher's, passes the rules, async's worker
layout fits, and a stated split ("6 train, 2 generate") is the one the run takes (a reading once found the
async line on 8 GPUs was refused, 256 being divisible by neither 8 x 6 nor 8 x 7)."""

from __future__ import annotations

import copy
import functools
import re
import shlex
from pathlib import Path

import pytest
import torch

from rlkit.config.rules import parse
from rlkit.rollout.remote import client
from rlkit.train import compose, default_num_processes

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
    *sorted((REPO / "recipes").glob("*.yaml")),
]
STATED = re.compile(r"(?:#|\bon)\s+(\d+|k) GPUs?\b")
LAUNCH = re.compile(r"((?:torchrun|accelerate launch|python -m)\b[^`#]*rlkit\.train[^`#|]*)(.*)")


def launch_lines() -> list[tuple[str, str, str | None, str]]:
    """(page:line, command, the GPU count it states or None, the rest of its line) of every launch line that
    states a count; a command continued over lines (`\\`) is joined and named by its first line."""
    out = []
    for page in PAGES:
        before, pending, start = "", "", 0
        for n, raw in enumerate(page.read_text().splitlines(), 1):
            if raw.rstrip().endswith("\\"):
                pending, start = pending + raw.rstrip()[:-1] + " ", start or n
                continue
            line, first = pending + raw, start or n
            pending, start = "", 0
            m = LAUNCH.search(line)
            if m:
                cmd, rest = m.group(1).strip(), m.group(2)
                stated = STATED.search(rest) or STATED.search(before)
                if stated or re.search(
                    r"--nproc[-_]per[-_]node|--num[-_]processes|trainer\.num_processes=", cmd
                ):
                    where = f"{page.relative_to(REPO)}:{first}"
                    out.append((where, cmd, stated.group(1) if stated else None, rest))
            elif line.strip() and not line.startswith("```"):
                before = line
    return out


LINES = launch_lines()


@functools.cache
def _composed(args: tuple[str, ...]):
    return compose(list(args))


def _option(args: list[str], *names: str) -> int | None:
    for i, a in enumerate(args):
        for name in names:
            if a == name:
                return int(args[i + 1])
            if a.startswith(name + "="):
                return int(a.split("=", 1)[1])
    return None


def fake_gpus(monkeypatch, count: int, **launcher) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in launcher.items():
        monkeypatch.setenv(key, str(value))


def check_line(monkeypatch, cmd: str, gpus: int) -> int:
    """Compose `cmd` on a machine with `gpus` GPUs, check it as its launch would; returns its learner world."""
    args = shlex.split(cmd)
    hydra_args = [a for a in args[args.index("rlkit.train") + 1 :] if "=" in a and not a.startswith("hydra.")]
    nproc = _option(args, "--nproc-per-node", "--nproc_per_node", "--num_processes", "--num-processes")
    launcher = {}
    if nproc is not None:  # torchrun / accelerate launch: the processes it is given
        world = nproc * (_option(args, "--nnodes") or 1)
        launcher = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": nproc}
    fake_gpus(monkeypatch, gpus, **launcher)
    composed = copy.deepcopy(_composed(tuple(hydra_args)))
    if nproc is None:
        world = default_num_processes(composed)
    cfg = parse(composed, world_size=world)
    if cfg.trainer.device == "cpu" or gpus == 0:
        return world
    client.check_config(cfg)  # async: the workers' share of the batch, and their GPUs
    return world


def test_the_docs_state_gpu_counts():
    assert len(LINES) >= 5, LINES


@pytest.mark.parametrize(("where", "cmd", "stated", "rest"), LINES, ids=[w for w, *_ in LINES])
def test_every_launch_line_with_a_gpu_count_works_on_that_many_gpus(monkeypatch, where, cmd, stated, rest):
    if "HOST:PORT" in cmd:
        cmd = cmd.replace("HOST:PORT", "127.0.0.1:29500")
    counts = range(1, 9) if stated == "k" else [int(stated)] if stated else [None]
    for gpus in counts:
        nproc = _option(shlex.split(cmd), "--nproc-per-node", "--nproc_per_node")
        gpus = gpus if gpus is not None else (nproc or 0)
        world = check_line(monkeypatch, cmd, gpus)
        if split := re.search(r"(\d+) train, (\d+) generate", rest):
            rollout_gpus = _composed(tuple(shlex.split(cmd)[3:])).trainer.rollout_gpus
            assert (world, rollout_gpus) == tuple(map(int, split.groups())), where


def test_async_on_8_gpus_chooses_a_learner_world_that_divides_the_batch(monkeypatch):
    """The old async line (rollout_gpus=2 on 8 GPUs) and the default (1): 6 and 7 learner ranks do not divide
    256 samples in groups of 8; the largest count that does (4) is chosen, the idle GPUs logged."""
    for rollout_gpus in (1, 2):
        cmd = (
            f"python -m rlkit.train +recipe=grpo_gsm8k trainer.mode=async trainer.rollout_gpus={rollout_gpus}"
        )
        assert check_line(monkeypatch, cmd, 8) == 4


def test_a_launcher_world_that_does_not_divide_the_batch_names_the_nearest_working_values(monkeypatch):
    from rlkit.config.schema import ConfigError

    with pytest.raises(ConfigError) as e:
        check_line(monkeypatch, "torchrun --nproc-per-node 6 -m rlkit.train +recipe=grpo_gsm8k", 6)
    text = str(e.value)
    assert (
        "8 x 6" in text and "trainer.train_batch_size=240 or 288" in text and "use 4 or 2 or 1 ranks" in text
    ), text
