"""Sphinx configuration of pfljax's documentation (`make docs`; HTML in docs/_build/html).

The algorithm pages (docs/algorithms/) are written at build time from
`pfljax.algorithms.available()` by the extension docs/_ext/algorithm_pages.py.
Nothing is fetched from the network at build time (no intersphinx).
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
sys.path.insert(0, os.path.abspath("_ext"))

project = "pfljax"
author = "pfljax authors"
copyright = "pfljax authors"
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "plain_docstrings",
    "algorithm_pages",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
templates_path = []

# The docstrings write code as `name` (Markdown style): render it as inline code.
default_role = "code"
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Google-style docstrings ("Args:", "Returns:", "Raises:", "Attributes:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
# The Attributes sections give each field's shape and dtype in words.
napoleon_attr_annotations = False
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False
nitpicky = False
# Docstrings quote code and values ("samples", --config...): keep their characters as written.
smartquotes = False

html_theme = "furo"
html_title = "pfljax"
html_static_path = []
