"""Chapter 00's reading map names real things: every megatron-core name in its table imports from the
installed megatron-core 0.16.1, every minibert module of the package has a row, and what the table calls
Megatron-LM-only really is not part of the megatron-core package."""
import glob
import importlib
import importlib.util
import os
import re
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAPTER = os.path.join(ROOT, "chapters", "00-setup.md")
HEADER = "| minibert | job | megatron-core 0.16.1 (importable) | Megatron-LM only (not importable) | names that differ |"
COMING = ["state", "mappings", "layers", "data_parallel", "pipeline", "schedules"]  # minibert/parallel/*.py

pytest.importorskip("megatron.core")


def map_rows():
    """{minibert path: (megatron-core cell, Megatron-LM cell)} from the table under HEADER."""
    with open(CHAPTER, encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = lines.index(HEADER) + 2  # skip the |---| line
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 5, line
        module = re.match(r"`(minibert/[\w/]+\.py)`", cells[0])
        assert module, f"first cell must name a minibert file: {line}"
        rows[module[1]] = (cells[2], cells[3], cells[0])
    return rows


def resolve(dotted):
    """Import the longest importable module prefix of `dotted`, then walk the attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(dotted)


def core_names():
    names = []
    for module, (core, _, _) in map_rows().items():
        names += [(module, name) for name in re.findall(r"`([\w.]+)`", core)]
    return names


@pytest.mark.parametrize("module, name", core_names(), ids=[n for _, n in core_names()])
def test_megatron_core_name_imports(module, name):
    assert name.startswith("megatron.core."), f"{module}: {name} is not a megatron-core name"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns about missing Apex / Transformer Engine
        assert resolve(name) is not None


def test_every_minibert_module_has_a_row():
    rows = map_rows()
    on_disk = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "minibert", "**", "*.py"),
                                                                  recursive=True)
                     if not p.endswith("__init__.py"))
    missing = [p for p in on_disk if p not in rows]
    assert not missing, f"add rows for {missing} to the reading map of chapters/00-setup.md"
    for name in COMING:
        path = f"minibert/parallel/{name}.py"
        assert path in rows, f"the reading map lacks {path}"
        if not os.path.exists(os.path.join(ROOT, path)):
            assert "*(coming)*" in rows[path][2], f"{path} does not exist yet: mark its row *(coming)*"
    stale = [p for p, (_, _, first) in rows.items()
             if not os.path.exists(os.path.join(ROOT, p)) and "*(coming)*" not in first]
    assert not stale, f"rows for files that do not exist: {stale}"


def test_megatron_lm_only_names_are_not_in_megatron_core():
    """The fourth column names Megatron-LM files (megatron/training/, tools/, pretrain_bert.py), which the
    megatron-core package does not install; none of them is a megatron.core name."""
    assert importlib.util.find_spec("megatron.training") is None
    for module, (_, lm, _) in map_rows().items():
        for path in re.findall(r"`([\w/]+\.py)`", lm):
            assert path.startswith(("megatron/training/", "tools/", "pretrain_bert.py")), (module, path)
        assert "megatron.core" not in lm, f"{module}: importable names belong in the megatron-core column"
