"""What the bench plot scripts share: their command line (a results JSON, -o for the PNG) and
writing the figure beside the JSON. Importing it selects matplotlib's file-only backend (Agg),
so the scripts run without a display."""

import argparse
import json

import matplotlib

matplotlib.use("Agg")


def read_results(doc: str) -> tuple[argparse.Namespace, dict]:
    """Parses `JSON [-o PNG]` (the first line of `doc` is the description) and loads the JSON."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("-o", "--output", help="PNG path (default: the JSON path with .png)")
    a = ap.parse_args()
    with open(a.json) as f:
        return a, json.load(f)


def save(fig, a: argparse.Namespace) -> None:
    """Writes the figure to -o, else to the JSON's path with .png, and says where."""
    fig.tight_layout()
    out = a.output or a.json.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
