"""Sphinx configuration of qkvjax's documentation site: MyST Markdown pages, the API reference from the package's
docstrings (autodoc; napoleon reads their Google-style "Attributes:" sections), the furo theme.

    .venv/bin/python -m sphinx -W --keep-going -b html docs site

(``-W``: a warning fails the build.)
tests/test_docs_site.py runs that build in CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the experiments' pages include files from experiments/ and benchmarks/

project = "qkvjax"
author = "the qkvjax developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "qkvjax"
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures' jaxtyping annotations read worse than the docstrings' shapes
autodoc_default_options = {"members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
# A page link or an image that resolves nowhere, an API name autodoc cannot import and a heading skipped are
# warnings, and -W fails on them. Python roles inside docstrings (:func:`run`, written for readers of the source,
# often relative to their module) are not held to resolving: that would be nitpicky mode.
suppress_warnings: list[str] = []
