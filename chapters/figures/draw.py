"""Draws every figure of the chapters, from minibert's own code (its simulators, planners and samplers) and
from measurements committed in the repository (training logs, bench results); nothing here trains a
model or needs a GPU.

    python chapters/figures/draw.py                  # every figure, into chapters/figures/
    python chapters/figures/draw.py --out DIR        # somewhere else (the tests draw into a scratch folder)
    python chapters/figures/draw.py --only NAME ...  # some of them (NAME without .png)

Each chNN_*.py module beside this file holds one chapter's figures as FIGURES = {name: draw}, where
draw(path) writes the picture `name.png` to path. A chapter shows one as ![what it shows](figures/name.png)."""
import argparse
import importlib.util
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # minibert, from a checkout
sys.path.insert(0, str(HERE))  # style.py, for the chapters' modules

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no window


def chapter_modules():
    for path in sorted(HERE.glob("ch[0-9]*.py")):
        spec = importlib.util.spec_from_file_location(f"figures_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


def all_figures() -> dict:
    """name -> draw(path), over every chapter's module."""
    figures = {}
    for module in chapter_modules():
        for name, draw in module.FIGURES.items():
            if name in figures:
                raise SystemExit(f"figure {name!r} is drawn twice (the second time by {module.__name__})")
            figures[name] = draw
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE), help="folder for the .png files (default: chapters/figures)")
    parser.add_argument("--only", nargs="+", default=None, help="figure names to draw (default: all)")
    args = parser.parse_args(argv)
    figures = all_figures()
    unknown = sorted(set(args.only or ()) - set(figures))
    if unknown:
        parser.error(f"no figure named {', '.join(unknown)}; the figures are: {', '.join(sorted(figures))}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or sorted(figures):
        figures[name](out / f"{name}.png")
        print(out / f"{name}.png")


if __name__ == "__main__":
    main()
