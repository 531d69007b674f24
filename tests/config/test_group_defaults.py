"""One home for each default: a config group file (configs/<group>/*.yaml) holds only values that differ from the
schema's (rlkit/config/schema.py), so a default is edited in one place and nothing silently overrides it."""

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlkit.config.schema import CONFIG_DIR, RLConfig
from rlkit.train import compose, load_config

SCHEMA = OmegaConf.to_container(OmegaConf.structured(RLConfig()), resolve=False)
GROUP_FILES = sorted(p for p in Path(CONFIG_DIR).glob("*/*.yaml"))


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_group_file_restates_no_schema_default(path):
    values = yaml.safe_load(path.read_text()) or {}
    defaults = SCHEMA[path.parent.name]
    same = [k for k, v in values.items() if k in defaults and defaults[k] == v]
    assert not same, f"{path.name} restates the schema's default of {same}: delete them from the file"


def test_the_rule_would_catch_a_restated_default(tmp_path):
    """The check above reads the file's own keys: a file that restated one would be named."""
    restated = {"group_size": SCHEMA["rollout"]["group_size"], "engine": "hf"}
    defaults = SCHEMA["rollout"]
    assert [k for k, v in restated.items() if defaults[k] == v] == ["group_size"]


def test_the_default_groups_compose_to_the_schema_defaults():
    """With the group files pruned, the root config's groups give exactly the schema's values for the keys they
    do not set (trainer and rollout set none)."""
    cfg = load_config(compose(["model.path=smollm2-135m", "data=arithmetic", "logger=none"]))
    schema = RLConfig()
    assert cfg.trainer == schema.trainer.__class__(**{**vars(schema.trainer), "run_dir": cfg.trainer.run_dir})
    assert cfg.rollout == schema.rollout
