"""The run's configuration: what a key may hold, what it must satisfy, and what follows from it.

- schema.py: the typed schema (`RLConfig`, one dataclass per config group, a docstring per field); a leaf that
  imports no other rlkit module. Hydra composes configs/ + recipes/ + overrides on top of it.
- rules.py: the start-up checks that need only the schema and the math's registries (`parse`: unknown keys,
  types, ranges, names asked of rlkit/algos, the rules that tie keys together). Each component checks its own
  keys with a `check_config` beside its code; `rlkit.train.preflight` calls them all before any model loads.
- derived.py: the values a run derives from its config once (`derive(cfg)`).
- reference.py: every key with its default and its docstring, for docs/reference/config.md
  (scripts/config_reference.py writes the page).

Import the module you need (`from rlkit.config.schema import RLConfig`); this package re-exports nothing.
"""
