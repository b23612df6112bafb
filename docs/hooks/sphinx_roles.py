"""MkDocs hook: the docstrings' Sphinx roles (``:func:`x```, ``:class:`x```) show as plain code, not as
a role's name before it (mkdocstrings' Google-style parser keeps the role as text)."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):(<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(r"\1", html)
