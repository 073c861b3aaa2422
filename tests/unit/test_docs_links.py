"""Every relative link in README.md, docs/ and bench/ (its README and result files) points at a file
that exists, and at a heading that exists when it names one (#anchor, GitHub's slugs); every result
file in bench/results/ is indexed by bench/README.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "bench" / "results").glob("*.md"))]
# Pages that other branches of the same change add (issue 35: docs/rewards.md, docs/agents.md). Once
# one exists here, remove it from this set: its links are then checked like any other.
PENDING: set[str] = set()
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    found = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):      # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if rel in PENDING:
            continue
        if not dest.exists():
            found.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {rel})")
    return found


def test_slugs_follow_github():
    assert slug("## `learner` (LearnerConfig)".lstrip("# ")) == "learner-learnerconfig"
    assert slug("A real model, offline: SmolLM2-135M-Instruct on 2-digit arithmetic") == \
        "a-real-model-offline-smollm2-135m-instruct-on-2-digit-arithmetic"


def test_every_relative_link_resolves():
    problems = [line for page in PAGES for line in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_pending_pages_are_still_pending():
    arrived = sorted(p for p in PENDING if (ROOT / p).exists())
    assert not arrived, f"{arrived} exist now: remove them from PENDING in {Path(__file__).name}"


def test_bench_readme_indexes_every_result_file():
    index = (ROOT / "bench" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "bench" / "results").glob("*.md")) if f"results/{p.name}" not in index]
    assert not missing, f"bench/README.md does not link {missing}"


def test_result_files_named_in_code_exist():
    """Comments and docstrings point at results by file (bench/results/<name>.md), never by number."""
    named = re.compile(r"bench/results/([\w.-]+\.md)")
    missing = [f"{path.relative_to(ROOT)}: {name}"
               for folder in ("dataflow", "nodes", "rl", "graphs", "tools", "tests", "bench")
               for path in sorted((ROOT / folder).rglob("*.py"))
               for name in named.findall(path.read_text())
               if not (ROOT / "bench" / "results" / name).exists()]
    assert not missing, "result files that do not exist:\n" + "\n".join(missing)
