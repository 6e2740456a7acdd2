"""Command-line plumbing shared by every subcommand."""

import jax

from tests.helpers import run_in_process


def test_the_persistent_compilation_cache_is_on_by_default_and_can_be_moved_or_turned_off(tmp_path, monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    try:
        assert run_in_process(["--compilation-cache", str(tmp_path / "c"), "schemes"]) == 0
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
        assert run_in_process(["--compilation-cache", "off", "schemes"]) == 0
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.setenv("HOME", str(tmp_path))
        assert run_in_process(["schemes"]) == 0  # nothing set: the default under ~/.cache
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / ".cache" / "qkvjax" / "jax")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
