"""The chapters' figures: the one command draws every picture a chapter shows (on the CPU, into a scratch
folder), each picture it draws is committed beside the chapters, and nothing stale is left there. Names
are compared, not bytes (a font or library update may move a pixel)."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURES = ROOT / "chapters" / "figures"
SHOWN = re.compile(r"\]\((?:\.\./)?(?:chapters/)?figures/([\w.-]+\.png)\)")


def shown_figures() -> dict:
    """picture name -> the documents that show it (chapters/*.md, README.md)."""
    shown = {}
    for path in sorted((ROOT / "chapters").glob("*.md")) + [ROOT / "README.md"]:
        for name in SHOWN.findall(path.read_text(encoding="utf-8")):
            shown.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    return shown


def test_the_command_draws_every_figure_the_chapters_show(tmp_path):
    result = subprocess.run([sys.executable, "chapters/figures/draw.py", "--out", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env={**os.environ, "MPLBACKEND": "Agg"})
    assert result.returncode == 0, result.stderr[-3000:]
    drawn = {p.name for p in tmp_path.glob("*.png")}
    committed = {p.name for p in FIGURES.glob("*.png")}
    shown = shown_figures()
    assert shown, "no chapter shows a figure"
    assert not set(shown) - committed, f"shown but not committed: {sorted(set(shown) - committed)}"
    assert not set(shown) - drawn, f"shown but no longer drawn: {sorted(set(shown) - drawn)}"
    assert drawn == committed, f"drawn, not committed: {sorted(drawn - committed)}; " \
                               f"committed, not drawn: {sorted(committed - drawn)}"
    assert not drawn - set(shown), f"drawn but shown nowhere: {sorted(drawn - set(shown))}"
