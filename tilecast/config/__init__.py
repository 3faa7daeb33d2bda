"""Run configurations: what a run is (run), reading and checking a config or problems file
(load), and the schema a file must pass (schema, pydantic: imported when a file is read)."""
from tilecast.config.load import (  # noqa: F401
    CONFIG_SUFFIXES, CONFIGS_DIR, MAX_PROBLEMS, PROBLEM_SETS, ConfigError, FamilyConfig,
    NightSettings, RunConfig, check_config_file, expand_problems, load_config, read_problem_file,
    resolve_path, shipped_configs)
from tilecast.config.run import UNLIMITED_BUDGET  # noqa: F401
