"""The documentation holds together: the README is a front page that leads to every page
under docs/, every relative link in them reaches a file (and a heading, where it names
one), and docs/config.md is what ``python -m asyncrl.config_doc`` writes from the schema
now, so a key added, removed or re-documented in asyncrl/config/ shows up there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.config import Config, all_keys, load_config
from asyncrl.config_doc import config_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
FRONT_PAGE_MAX_LINES = 150
REGENERATE = "python -m asyncrl.config_doc > docs/config.md"

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def unfenced(text: str) -> str:
    """The text without fenced code blocks (where a `#` line is a comment, not a heading)."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.DOTALL | re.MULTILINE)


def prose(text: str) -> str:
    """The text without code, fenced or inline, where brackets are not links."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", unfenced(text))


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline markup and punctuation dropped,
    spaces to hyphens (letters of any script kept)."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", unfenced(text), flags=re.MULTILINE):
        base, n = slug(heading), 0
        while (name := base if n == 0 else f"{base}-{n}") in found:  # GitHub numbers repeats
            n += 1
        found.add(name)
    return found


def test_the_link_checker_sees_links_and_anchors():
    text = "# A `b` c, d!\n\nsee [x](docs/x.md#a-b-c-d) and ![i](p.png \"t\")\n```\n[no](link.md)\n```\n`[no](y)`\n"
    assert links(text) == ["docs/x.md#a-b-c-d", "p.png"]
    assert anchors(text) == {"a-b-c-d"}
    assert slug("η × objective: what's `left`") == "η--objective-whats-left"
    assert slug("weight_sync") == "weight_sync"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in links(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not resolved.exists():
                broken.append(f"{where} -> no {resolved}")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text()):
                broken.append(f"{where} -> no heading #{fragment} in {resolved.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_front_page_leads_to_every_page():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(readme)}
    unlinked = [page.name for page in DOCS.glob("*.md") if page.resolve() not in linked]
    assert not unlinked, f"README.md does not link docs/{unlinked}"


def test_the_front_page_stays_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= FRONT_PAGE_MAX_LINES, (
        f"README.md has {lines} lines; it is the front page (at most {FRONT_PAGE_MAX_LINES}): "
        "move details into a page under docs/ and link it")


COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_the_front_page_names_no_issue_and_no_commit_but_its_figures():
    """A newcomer can follow neither an internal issue number nor a commit; the one commit
    the front page names is its figure's (docs/figures.yaml dates it; history is in docs/)."""
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"\bissues? \d+", readme, re.IGNORECASE)
    figures = {entry["commit"] for entry in yaml.safe_load((DOCS / "figures.yaml").read_text())
               if entry["doc"] == "README.md"}
    assert set(COMMIT.findall(readme)) - figures == set()
    assert COMMIT.findall("on commit cc436b0, 0.208 and 1234567, deadbeef") == ["cc436b0"]


def test_the_config_reference_is_current():
    page = (DOCS / "config.md").read_text()
    assert page == config_reference(), f"docs/config.md is out of date with asyncrl/config/: run {REGENERATE}"


def test_the_config_reference_documents_every_key_once():
    page = config_reference()
    rows = re.findall(r"^\| `([a-z_.]+)` \|", page, flags=re.MULTILINE)
    assert len(rows) == len(set(rows)) and set(rows) == set(all_keys(Config, within_optional=True))
    assert "| `optim.lr` | `float`, > 0 | `0.001` |" in page
    assert "| `mode` | `\"sync\" \\| \"one_step_off\" \\| \"async\"` | `async` |" in page
    row = next(line for line in page.splitlines() if line.startswith("| `watchdog.stall_s`"))
    assert "The learner waited this long for data with no group accepted" in row  # the field's docstring


def test_the_module_writes_the_page():
    out = subprocess.run([sys.executable, "-m", "asyncrl.config_doc"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out == config_reference()


@pytest.mark.filterwarnings("error::FutureWarning")  # the SDK's deprecations: the snippet uses today's API
def test_the_tinker_quick_start_runs_from_any_directory(tmp_path, monkeypatch, capsys):
    """docs/tinker.md's quick start as written: the server started from the repository's root
    with the shipped config its bash block names, the client's Python run from another
    directory. The tokenizer the server names (``get_tokenizer()``) must load from there too,
    and every call the snippet makes must come back."""
    pytest.importorskip("tinker")
    pytest.importorskip("peft")
    from tinker_server import ServerThread

    serve, client = re.findall(r"```(?:bash|python)\n(.*?)\n```", (DOCS / "tinker.md").read_text(), re.DOTALL)[:2]
    assert "asyncrl serve-tinker examples/tinker/serve.yaml" in serve and "http://127.0.0.1:8200" in client
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "examples" / "tinker" / "serve.yaml", ["tinker.port=0", f"output_dir={tmp_path / 'run'}"])
    with ServerThread(cfg) as server:
        monkeypatch.chdir(tmp_path)
        snippet: dict = {}
        exec(compile(client.replace("http://127.0.0.1:8200", server.url), "docs/tinker.md", "exec"), snippet)
    assert snippet["tokens"] == [6, 7, 16, 8, 9, 22, 9, 11]  # "12+34=46" in the tiny policy's own characters
    assert "sequences=[" in capsys.readouterr().out  # the sample printed
