"""Every command the README and the docs show runs as written: each `python -m rlkit.train ...` line composes
with Hydra and passes the schema's rules (the same first check the real launch makes), each `make TARGET`
names a target of the Makefile, each `python scripts/X.py` names a script that exists, and every option it
passes is one the script's argument parser knows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rlkit.config.rules import parse
from rlkit.train import compose

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# A word the docs use for "your value here": such a command shows a shape, not a runnable line.
PLACEHOLDER = re.compile(
    r"\$\{?\w+|\{\w+\}|[A-Z]{2,}(?:_[A-Z]+)*|<[^>]*>|\.\.\.|\bS\b|/data/|my-org/|my_rewards:|my_confs"
)


def _commands(prefix: str, stop: str = "`#|,") -> list[tuple[str, str]]:
    """(page:line, command) of every `prefix ...` in code: fenced lines and `inline` spans. A command ends at
    a character of `stop` or a `;` (the shell's), but not inside a quoted word ('data.tasks=[a,b]')."""
    stop += ";"
    out = []
    for page in PAGES:
        text = page.read_text()
        text = re.sub(r"\\\n\s*", " ", text)  # shell line continuations
        for n, line in enumerate(text.splitlines(), 1):
            for m in re.finditer(re.escape(prefix) + f"(?:'[^']*'|\"[^\"]*\"|[^{stop}'\"])*", line):
                cmd = m.group(0).strip().rstrip(".,;:)")
                out.append((f"{page.relative_to(REPO)}:{n}", cmd))
    return out


TRAIN = [(where, cmd) for where, cmd in _commands("python -m rlkit.train") if not PLACEHOLDER.search(cmd)]


def test_the_docs_show_launch_lines():
    assert len(TRAIN) >= 15, TRAIN


@pytest.mark.parametrize("where,cmd", TRAIN, ids=[w for w, _ in TRAIN])
def test_every_launch_line_composes_and_passes_the_rules(where, cmd):
    args = shlex.split(cmd)[3:]
    args = [a for a in args if not a.startswith("hydra.searchpath")]  # a user folder of recipes
    if any(a.startswith("+recipe=mine") for a in args):
        pytest.skip("a recipe of the user's own folder")  # tests/packaging/test_wheel.py runs that case
    parse(compose(args), world_size=1)


# Lists such as 'eval.seeds=[0,1,2]' hold commas (quoted for the shell).
EVAL = [(w, cmd) for w, cmd in _commands("python -m rlkit.eval", stop="`#|") if not PLACEHOLDER.search(cmd)]


@pytest.mark.parametrize("where,cmd", EVAL, ids=[w for w, _ in EVAL])
def test_every_eval_line_composes_and_passes_the_rules(where, cmd):
    args = [a for a in shlex.split(cmd)[3:] if a not in ("--cfg", "job")]
    parse(compose(args), world_size=1)


def test_every_make_target_exists():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    used = {m for page in PAGES for m in re.findall(r"`make ([a-z][a-z-]*)", page.read_text())}
    used |= {m for page in PAGES for m in re.findall(r"^make ([a-z][a-z-]*)", page.read_text(), re.M)}
    assert used and used <= targets, used - targets


def test_every_script_and_option_exists():
    for where, cmd in _commands("python scripts/"):
        if not re.match(r"python scripts/\w+\.py", cmd):
            continue  # prose about the folder
        words = shlex.split(cmd.replace("[", " ").replace("]", " ").replace("|", " "))
        script = REPO / words[1]
        assert script.is_file(), (where, cmd)
        source = script.read_text()
        for option in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
            assert f'"{option}"' in source, (where, option)
