"""A verifiable visual task for vision-language models: name the colour of a shape.

Each example is an image (a filled square or disc of one of `COLOURS`, at a random place
and size on a light background) with ``{"prompt": "colour?", "response": "red"}``; the
reward is the exact-answer one of the text tasks. Built-in as ``builtin:colours`` (images
made in memory) and ``builtin:colours_mixed`` (SFT demonstrations from two writers:
`LAZY_SHARE` of them answer `LAZY_ANSWER` without looking, so a model trained on them
greedily says "red" while sampling often finds the right colour: the gap RL closes, as
builtin:reverse_mixed does for text). `write_dataset`
writes the same examples as PNG files and a JSONL file that names them, the form a user's
own image data takes (``data.source: FILE.jsonl``, ``data.image_key``).

    python -m shardwise.data.visual OUT_DIR [N] [SEED]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

# PIL is imported where an image is drawn, not here: shardwise.data.tasks imports this module
# for its table of built-in tasks, and the text tasks' users (benchmarks/_trl_grpo_worker.py in
# TRL's own venv, which has no pillow) must not need it.

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 30),
}
PROMPT = "colour?"
IMAGE_PIXELS = 56
LAZY_SHARE = 0.6
"""Share of `colours_mixed` demonstrations written without looking at the image."""
LAZY_ANSWER = "red"
"""What the writer who does not look answers."""


def _image(rng: random.Random, colour: str) -> Image.Image:
    from PIL import Image, ImageDraw

    bg = tuple(rng.randint(200, 255) for _ in range(3))
    img = Image.new("RGB", (IMAGE_PIXELS, IMAGE_PIXELS), bg)
    size = rng.randint(20, 40)
    x, y = rng.randint(0, IMAGE_PIXELS - size), rng.randint(0, IMAGE_PIXELS - size)
    draw = ImageDraw.Draw(img)
    box = (x, y, x + size - 1, y + size - 1)
    (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=COLOURS[colour])
    return img


def colour_examples(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` examples ``{"prompt", "response", "image"}`` (a PIL image), the same for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        colour = rng.choice(sorted(COLOURS))
        out.append({"prompt": PROMPT, "response": colour, "image": _image(rng, colour)})
    return out


def colour_mixed_demonstrations(n: int, seed: int) -> list[dict[str, Any]]:
    """`colour_examples` whose response is, for `LAZY_SHARE` of them, `LAZY_ANSWER` (the
    writer did not look at the image)."""
    rng = random.Random(seed + 1)
    rows = colour_examples(n, seed)
    for r in rows:
        if rng.random() < LAZY_SHARE:
            r["response"] = LAZY_ANSWER
    return rows


def write_dataset(folder: str | Path, n: int, seed: int, mixed: bool = False) -> Path:
    """`n` examples as ``folder/images/NNNNN.png`` and ``folder/data.jsonl`` (records with a
    relative ``image`` path); returns the JSONL path."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = (colour_mixed_demonstrations if mixed else colour_examples)(n, seed)
    lines = []
    for i, r in enumerate(rows):
        name = f"images/{i:05d}.png"
        r["image"].save(folder / name)
        lines.append(json.dumps({"prompt": r["prompt"], "response": r["response"], "image": name}))
    out = folder / "data.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":  # pragma: no cover - a convenience for users
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    print(write_dataset(args[0], int(args[1]) if len(args) > 1 else 512, int(args[2]) if len(args) > 2 else 0))
