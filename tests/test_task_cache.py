"""The Prefect tasks' cache key follows the config file's contents, not only its path."""
from __future__ import annotations

from tilecast.tasks.stages import _config_digest


def test_config_digest_changes_with_the_file_contents(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("name: a\nprotocol: {samples: 3}\n")
    before = _config_digest(None, {"config": str(config)})
    assert before == _config_digest(None, {"config": str(config)})
    config.write_text("name: a\nprotocol: {samples: 5}\n")
    after = _config_digest(None, {"config": str(config)})
    assert before is not None and after is not None and after != before


def test_config_digest_of_a_shipped_name_and_of_a_missing_file(tmp_path):
    assert _config_digest(None, {"config": "quick"}) is not None
    assert _config_digest(None, {"config": str(tmp_path / "missing.yaml")}) is None
    assert _config_digest(None, {"workdir": "w"}) is None
