"""Check the built site's internal links: every link to a page of the site must find that page and its anchor.

Sphinx checks cross-references as it resolves them, but not the links that extensions write into the HTML, such
as sphinx.ext.viewcode's "[docs]" links from a highlighted source file back to the object's description. This
script reads every HTML page under the build directory and reports each link whose target page is missing, or
whose ``#anchor`` no element of that page carries (as an ``id``, or as the ``name`` of an ``<a>``)::

    python3 docs/check_links.py docs/_build/html        # exit status 1 if any link is broken

External links (with a scheme such as ``https:``) are not checked: the build is offline.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    """The anchors a page defines and the links it holds (href, link text)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.anchors: set[str] = set()
        self.links: list[list[str]] = []
        self._open: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("id"):
            self.anchors.add(attributes["id"])
        if tag == "a" and attributes.get("name"):
            self.anchors.add(attributes["name"])
        if tag == "a" and attributes.get("href") is not None:
            self._open = [attributes["href"], ""]
            self.links.append(self._open)

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open[1] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "a":
            self._open = None


def broken_links(site: Path) -> list[str]:
    """One line per broken internal link: the page that holds it, the link, and its text."""
    pages = {}
    for path in sorted(site.rglob("*.html")):
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = page
    broken = []
    for path, page in pages.items():
        for href, text in page.links:
            parts = urlsplit(href)
            if parts.scheme or href.startswith("//"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(site.resolve())}: {href} ({text.strip()!r})"
            if target.suffix != ".html":
                if not target.exists():
                    broken.append(f"{where}: no such file")
            elif target not in pages:
                broken.append(f"{where}: no such page")
            elif parts.fragment and unquote(parts.fragment) not in pages[target].anchors:
                broken.append(f"{where}: no anchor #{parts.fragment} on that page")
    return broken


def main(argv: list[str]) -> int:
    site = Path(argv[1] if len(argv) > 1 else "docs/_build/html")
    broken = broken_links(site)
    for line in broken:
        print(line)
    print(f"{len(broken)} broken internal link(s) in {site}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
