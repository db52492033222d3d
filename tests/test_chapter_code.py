"""Code the chapters quote is the code that runs. A Python block in a chapter that opens with the line

    # from minibert/model/bert.py

is a verbatim excerpt of that file: each run of its lines between `...` lines (an elision) must appear in
the file, in the same order, with the same text (indentation compared after removing the excerpt's common
indent). A block that opens with `# simplified from minibert/X.py` is a sketch: only the file must exist.
Blocks without such a line are the chapter's own code (commands, sketches it says are its own)."""
import pathlib
import re
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))
SOURCE = re.compile(r"^# (simplified )?from (\S+\.py)\s*$")


def quoted_blocks(path):
    """[(line of the fence, simplified?, source file, the block's lines after the source line)]."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            body = textwrap.dedent("\n".join(lines[i + 1:end])).split("\n")
            m = SOURCE.match(body[0]) if body else None
            if m:
                blocks.append((i + 1, bool(m[1]), m[2], body[1:]))
            i = end
        i += 1
    return blocks


def runs(lines):
    """The excerpt's runs of lines between `...` elisions, each dedented as a whole."""
    out, current = [], []
    for line in lines + ["..."]:
        if line.strip() == "...":
            if any(x.strip() for x in current):
                out.append(textwrap.dedent("\n".join(current)).strip("\n"))
            current = []
        else:
            current.append(line)
    return out


def found_in_order(source, excerpts):
    """Each excerpt occurs in source (compared line by line, each source window dedented), in order."""
    src = source.split("\n")
    at = 0
    for excerpt in excerpts:
        want = excerpt.split("\n")
        n = len(want)
        hit = next((k for k in range(at, len(src) - n + 1)
                    if textwrap.dedent("\n".join(src[k:k + n])).split("\n") == want), None)
        if hit is None:
            return excerpt
        at = hit + n
    return None


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.name for p in CHAPTERS])
def test_quoted_code_is_the_code(path):
    problems = []
    for line, simplified, source, body in quoted_blocks(path):
        file = ROOT / source
        if not file.is_file():
            problems.append(f"{path.name}:{line}: {source} does not exist")
            continue
        if not simplified:
            missing = found_in_order(file.read_text(encoding="utf-8"), runs(body))
            if missing is not None:
                problems.append(f"{path.name}:{line}: not in {source} (in this order):\n{missing}")
    assert not problems, "\n".join(problems)


def slug(heading):
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_section_lands_on_a_heading():
    """[text](02-single-gpu.md#7-checkpoints) and [text](#3-the-loss) point at a heading that exists, across
    the chapters, the glossary, docs/ and the README (a renamed section breaks no reader's link)."""
    documents = CHAPTERS + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    anchors = {p.resolve(): {slug(line.lstrip("#")) for line in p.read_text(encoding="utf-8").split("\n")
                             if line.startswith("#")} for p in documents}
    broken = []
    for path in documents:
        for m in re.finditer(r"\]\(([^)#\s]*\.md)?#([\w\-]+)\)", path.read_text(encoding="utf-8")):
            target = (path.parent / m[1]).resolve() if m[1] else path.resolve()
            if m[2] not in anchors.get(target, set()):
                broken.append(f"{path.relative_to(ROOT)}: {m[0]}")
    assert not broken, "\n".join(broken)
