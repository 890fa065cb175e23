"""docs/training.md's account of tiny_vl's image sizes is the processor's: every image is resized (min_pixels =
max_pixels = 32*32), so each example the page gives (an image's size -> the size it is read at and its tokens) is
checked against `build_tiny_vl_processor`, including images that are not 32x32."""

from __future__ import annotations

import re
from pathlib import Path

from PIL import Image

from relax.data.images import build_tiny_vl_processor, build_tiny_vl_tokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _row() -> str:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `model=tiny_vl`")]
    assert len(rows) == 1, "docs/training.md: no single model=tiny_vl row"
    return rows[0]


def _examples(row: str) -> list[tuple[tuple[int, int], tuple[int, int], int]]:
    """((width, height) given, (width, height) read at, tokens) of each example in the row."""
    out = []
    for size, w, h, n in re.findall(r"a (\d+x\d+) image is (\d+)x(\d+), (\d+) tokens", row):
        out.append((tuple(map(int, size.split("x"))), (int(w), int(h)), int(n)))
    square = re.search(r"a square image of any size, ([\dx, or]+), is (\d+)x(\d+), (\d+) tokens", row)
    if square:
        for size in re.findall(r"\d+x\d+", square.group(1)):
            out.append((tuple(map(int, size.split("x"))), (int(square.group(2)), int(square.group(3))),
                        int(square.group(4))))
    return out


def test_the_docs_tiny_vl_image_sizes_are_the_processors():
    examples = _examples(_row())
    assert len(examples) >= 4 and any(given != (32, 32) for given, _, _ in examples), examples
    processor = build_tiny_vl_processor(build_tiny_vl_tokenizer()).image_processor
    for given, read_at, tokens in examples:
        grid = processor(images=Image.new("RGB", given), return_tensors="pt")["image_grid_thw"][0].tolist()
        _, rows, cols = grid  # 8-pixel patches; 2x2 of them merged into one token
        assert ((cols * 8, rows * 8), rows * cols // 4) == (read_at, tokens), (given, grid)
