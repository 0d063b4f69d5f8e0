"""Every link between the repository's documents resolves: the file exists and, for a
link to a heading (`page.md#heading`), the page has that heading (GitHub's anchors)."""
import pathlib
import re
import subprocess

import pytest

from conftest import ROOT

TRACKED = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True).stdout.split()
DOCUMENTS = sorted({ROOT / name for name in TRACKED} | {ROOT / name for name in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md")})
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page):
    found = set()
    for line in page.read_text().splitlines():
        heading = re.match(r"^#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
        found.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return found


def links():
    found = []
    for page in DOCUMENTS:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue
            found.append(pytest.param(page, target, id=f"{page.relative_to(ROOT)}:{target}"))
    return found


def test_the_documents_link_to_one_another():
    assert len(links()) > 20


@pytest.mark.parametrize("page,target", links())
def test_a_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
    if anchor and linked.suffix == ".md":
        assert anchor in anchors(linked), f"{page.relative_to(ROOT)} links to #{anchor}, not a heading of {linked.name}"
