"""The look every figure shares: sizes, colours, and how a figure is written."""
import matplotlib.pyplot as plt

COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "communication": "#55A868", "idle": "#C44E52",
          "memory": "#8172B3", "data": "#937860", "neutral": "#8C8C8C", "highlight": "#DA8BC3"}
WIDTH = 8.0   # inches: the chapters' text width at 100 dpi
DPI = 100


def figure(height=3.5, width=WIDTH, **kwargs):
    """A new figure and its axes (plt.subplots' arguments pass through)."""
    plt.rcParams.update({"font.size": 10, "axes.spines.top": False, "axes.spines.right": False})
    return plt.subplots(figsize=(width, height), **kwargs)


def save(fig, path):
    """Write the figure as a PNG (no timestamp in the file) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
