"""python -m perf.token_budget: visual tokens per image for LLaVA-NeXT-style serving (CLIP ViT-L/14-336 tiles).

(a) one squashed tile; (b) native-resolution tiling (every 336 px tile of the image at full size, a newline per tile
row, like AnyRes without the downscale); (c) AnyRes with LLaVA-1.6's pinpoints (thumbnail + best-fit grid, padding
removed); (d) AnyRes with the anyres_max_9 grid list. Pruning (a further column) is not built yet.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from backends.anyres import LLAVA_1_6_PINPOINTS, AnyResTiler, grid_pinpoints
from perf.report import write_table

SIZES = [(336, 336), (1024, 1024), (1920, 1080), (3840, 2160), (4000, 500), (500, 4000), (2048, 300)]  # (w, h)


def native_tiles_tokens(width: int, height: int, tile: int = 336, patch: int = 14) -> int:
    side = tile // patch
    rows, cols = math.ceil(height / tile), math.ceil(width / tile)
    return rows * cols * side * side + rows * side


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.token_budget", description=__doc__)
    parser.add_argument("--results", type=Path, default=Path("perf/results/any"))
    args = parser.parse_args(argv)
    llava, max9 = AnyResTiler(LLAVA_1_6_PINPOINTS), AnyResTiler(grid_pinpoints(9, 336))
    one_tile = 24 * 24
    rows = []
    for width, height in SIZES:
        a, b = llava.plan(height, width), max9.plan(height, width)
        rows.append([f"{width}x{height}", one_tile, native_tiles_tokens(width, height),
                     f"{a.num_image_tokens} ({a.grid[0]}x{a.grid[1]})", f"{b.num_image_tokens} ({b.grid[0]}x{b.grid[1]})"])
    path = write_table(args.results, "token-budget", ["image (w x h)", "(a) one tile", "(b) native tiling",
                                                      "(c) AnyRes, LLaVA-1.6 grid", "(d) AnyRes, max 9 tiles"], rows,
                       "n/a (arithmetic only)", [__doc__.split("\n\n")[0].split(": ", 1)[1].strip(),
                                                 "Grid = rows x cols of tiles chosen (plus the thumbnail)."])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
