"""Every test gets an empty step cache (`moe.engine.ahead`): a package one test builds is never found by
another, whatever order they run in."""

import pytest


@pytest.fixture(autouse=True)
def own_step_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_STEP_CACHE", str(tmp_path / "steps"))
