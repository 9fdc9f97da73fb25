"""Where each shipped recipe's predicted peak is, what is alive there, and what the recipe says it shrinks.

    python examples/peak_phases.py [--gpu h100] [--config configs/bert-large.yaml] > table.md

One `python -m lit_memory estimate --json --no-simulate` per recipe (the analytic model, at the recipe's batch);
prints the Markdown table docs/memory.md shows ("Where each recipe peaks"). A recipe's change lowers the peak
only where it acts on the categories alive at the peak's phase: the fused step frees gradients during backward,
yet the fp32 baseline's peak is at the start of backward, where no gradient is alive yet.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")


def shrinks(recipe: Path) -> str:
    for line in recipe.read_text().splitlines():
        if line.startswith("# shrinks:"):
            return re.sub(r"\s*\([^)]*\)", "", line.split(":", 1)[1]).strip()  # without the explanations
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--config", default=str(REPO / "configs" / "bert-large.yaml"))
    args = parser.parse_args()
    listed = subprocess.run([sys.executable, "-m", "lit_memory", "recipes", "list"], capture_output=True, text=True,
                            cwd=REPO, check=True).stdout.splitlines()[1:]  # the tiers in order, under a header
    recipes = [REPO / "recipes" / f"{line.split()[0]}.yaml" for line in listed if line.strip()]
    recipes = [r for r in recipes if r.is_file()]
    print(f"| recipe | peak ({args.gpu}, tensors) | in | alive at the peak (GiB: " + ", ".join(CATEGORIES)
          + ") | the recipe shrinks |")
    print("|---|---:|---|---|---|")
    for recipe in recipes:
        out = subprocess.run(
            [sys.executable, "-m", "lit_memory", "estimate", "--json", "--no-simulate", "--gpu", args.gpu,
             "--config", str(recipe), "--config", args.config],
            capture_output=True, text=True, cwd=REPO)
        if out.returncode:
            refusal = out.stderr.strip().splitlines()[-1].removeprefix("error: ").split(" (python -m")[0]
            print(f"| `{recipe.stem}` | - | - | not planned on this card: {refusal} | {shrinks(recipe)} |")
            continue
        analytic = json.loads(out.stdout)["predicted"]["analytic"]
        alive = ", ".join(f"{analytic['categories'][c] / 2**30:.2f}" for c in CATEGORIES)
        print(f"| `{recipe.stem}` | {analytic['peak_bytes'] / 2**30:.2f} GiB | {analytic['peak_phase']} | {alive} | "
              f"{shrinks(recipe)} |")


if __name__ == "__main__":
    main()
