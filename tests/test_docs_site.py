"""The documentation site builds with warnings as errors, documents every public name and config field, and its
pages' (and README.md's) code blocks run: Python blocks are executed and must print, the launching block runs,
and a block that several pages show is the same on each."""

import contextlib
import dataclasses
import inspect
import io
import os
import re
import shutil
import subprocess
import sys

import jax
import pytest

from tests.helpers import REPO, doc_pages

BUILD = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html"]
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
MARKED_BLOCK = re.compile(r"<!-- ([a-z0-9-]+):.*?-->\s*```(\w*)\n(.*?)```", re.S)


def _build(source, out):
    return subprocess.run([*BUILD, str(source), str(out)], capture_output=True, text=True, cwd=REPO, timeout=600)


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """The README's build command (with -E -q: a fresh environment, quiet) exits 0: no broken page link or image,
    no API name autodoc cannot import, no docstring docutils cannot parse."""
    readme = (REPO / "README.md").read_text()
    assert "python -m sphinx -W --keep-going -b html docs site" in readme
    proc = _build(REPO / "docs", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "api.html").is_file() and (tmp_path / "site" / "experiments" / "trends.html").is_file()
    api = (tmp_path / "site" / "api.html").read_text()
    assert 'id="qkvjax.config.DataConfig"' in api and 'id="qkvjax.nnx.DecoderLM"' in api


def test_a_broken_link_fails_the_build(tmp_path):
    """The check above could fail: the same pages with one link to a page that does not exist."""
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    index = docs / "index.md"
    index.write_text(index.read_text() + "\nSee [the missing page](guides/no-such-page.md).\n")
    proc = _build(docs, tmp_path / "site")
    assert proc.returncode != 0 and "no-such-page" in proc.stderr, proc.stderr[-2000:]


def _public():
    import qkvjax
    import qkvjax.nnx

    return [(m, name, getattr(m, name)) for m in (qkvjax, qkvjax.nnx) for name in m.__all__]


def test_every_public_name_has_a_docstring_and_an_entry_in_the_api_reference():
    from sphinx.pycode import ModuleAnalyzer

    api = (REPO / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto\w+:: (\S+)$", api, re.M))
    for module, name, obj in _public():
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert f"{module.__name__}.{name}" in documented, f"docs/api.md has no entry for {module.__name__}.{name}"
            assert obj.__doc__ and obj.__doc__.strip(), f"{module.__name__}.{name} has no docstring"
        else:  # data: documented by a #: comment where it is defined
            where = next(d for d in documented if d.rsplit(".", 1)[-1] == name)
            owner = where.rsplit(".", 1)[0]
            assert ("", name) in ModuleAnalyzer.for_module(owner).find_attr_docs(), f"{where} has no #: comment"


def test_every_config_field_is_documented():
    """The configs' pages list every field: each dataclass field is in its class docstring's Attributes section."""
    from qkvjax.attention import AttentionConfig
    from qkvjax.config import Config, DataConfig, MeshConfig, TrainConfig
    from qkvjax.models.encoder import EncoderConfig
    from qkvjax.models.lm import ModelConfig

    for cls in (Config, DataConfig, TrainConfig, MeshConfig, ModelConfig, AttentionConfig, EncoderConfig):
        doc = inspect.getdoc(cls)
        assert "Attributes:" in doc, cls.__name__
        section = doc.split("Attributes:", 1)[1]
        missing = [f.name for f in dataclasses.fields(cls) if not re.search(rf"^\s+{f.name}:", section, re.M)]
        assert not missing, f"{cls.__name__}: fields {missing} are not in its docstring's Attributes section"


def _python_blocks():
    for page in doc_pages():
        for i, block in enumerate(PYTHON_BLOCK.findall(page.read_text())):
            yield pytest.param(page, block, id=f"{page.relative_to(REPO)}#{i}")


@pytest.mark.parametrize(("page", "block"), list(_python_blocks()))
def test_every_python_block_runs_and_prints(page, block):
    """Each ```python block of README.md and the docs pages runs as written, in a fresh namespace, and prints
    something, so that a reader pasting it sees that it worked."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
        exec(compile(block, str(page), "exec"), {"__name__": "__main__"})  # noqa: S102
    assert out.getvalue().strip(), f"{page}: the block printed nothing"


def test_the_readmes_launching_block_runs():
    """The three launchers' --dry-run lines of README.md print their plans and exit 0 (no cluster needed)."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Launching.*?```bash\n(.*?)```", readme, re.S).group(1)
    lines = [line.split("  #")[0] for line in block.splitlines() if line.strip()]
    assert len(lines) == 3 and all("--dry-run" in line for line in lines)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for line in lines:
        proc = subprocess.run(line, shell=True, cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip(), f"{line}\n{proc.stderr}"


def test_a_block_shown_on_several_pages_is_the_same_on_each():
    """README.md shows blocks a docs page shows too (the run and test commands, the first hour, Hugging Face in and
    out): the tests run one copy, so every copy of a marked block, and the two commands, must be that copy."""
    copies = {}
    for page in doc_pages():
        text = page.read_text()
        for marker, _, body in MARKED_BLOCK.findall(text):
            copies.setdefault(marker, set()).add(body)
        for command in re.findall(r"```bash\n(python3 -m venv .venv && [^\n]*)\n```", text):
            copies.setdefault("the two commands", set()).add(command)
    assert len(copies["the two commands"]) == 2, copies["the two commands"]  # the run command and the test command
    for marker, bodies in copies.items():
        if marker != "the two commands":
            assert len(bodies) == 1, f"the block marked {marker!r} differs between pages"


def test_the_readme_is_a_front_page():
    """Under 250 lines, and no commit hashes or dates on it (they belong to the docs' dated pages)."""
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") < 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), re.search(r"\b20\d\d-\d\d-\d\d\b", readme)
    assert not re.search(r"\b(at|in|commit) [0-9a-f]{7,40}\b", readme)


def test_the_tests_write_nothing_into_the_users_home():
    """conftest.py points HOME at a folder of the session: ~/tensorflow_datasets and ~/.cache land there."""
    if os.environ.get("QKVJAX_TESTS_KEEP_HOME") == "1":
        pytest.skip("QKVJAX_TESTS_KEEP_HOME=1 asked for the real home")
    home = os.path.expanduser("~")
    assert home == os.environ["QKVJAX_TESTS_HOME"] and os.path.basename(home).startswith("qkvjax-tests-home-")
    probe = subprocess.run([sys.executable, "-c", "import os; print(os.path.expanduser('~'))"], capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert probe.stdout.strip() == home  # the CLI subprocesses the tests start inherit it
