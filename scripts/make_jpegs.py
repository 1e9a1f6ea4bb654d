"""An ImageFolder of full-size JPEGs for measuring input speed (experiment=speed_jpeg).

ImageNet's average image is about 400x350 pixels and 110 KB. Each image here is smooth random colour
fields upscaled, with fine noise on top, so that it compresses to about that size (about 100 KiB at
500x375, quality 90) rather than as flat colour or pure noise would. Not a dataset to learn from.

    python scripts/make_jpegs.py --out /tmp/jpegs --images 2560 --classes 10
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def make(args: tuple[Path, int, int, int, int]) -> int:
    path, seed, width, height, quality = args
    rng = np.random.default_rng(seed)
    fields = Image.fromarray(rng.integers(0, 256, (height // 24, width // 24, 3), dtype=np.uint8)).resize(
        (width, height), Image.BICUBIC
    )
    pixels = np.asarray(fields, dtype=np.int16) + rng.integers(-36, 37, (height, width, 3), dtype=np.int16)
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=quality)
    return path.stat().st_size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--images", type=int, default=2560, help="training images; a tenth as many for val/")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--size", default="500x375", help="WIDTHxHEIGHT")
    p.add_argument("--quality", type=int, default=90)
    a = p.parse_args(argv)
    width, height = map(int, a.size.split("x"))
    jobs = []
    for split, n in (("train", a.images), ("val", max(a.images // 10, a.classes))):
        for i in range(n):
            folder = a.out / split / f"class{i % a.classes:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs.append((folder / f"{i:06d}.jpg", (split == "val") * 10**7 + i, width, height, a.quality))
    with ProcessPoolExecutor() as pool:
        sizes = list(pool.map(make, jobs, chunksize=64))
    (a.out / "COMPLETE").write_text(f"{len(jobs)}\n")  # the tree is whole: a reader may trust it
    mean_kib = sum(sizes) / len(sizes) / 1024
    print(f"make_jpegs: {len(jobs)} JPEGs of {width}x{height} under {a.out}, {mean_kib:.0f} KiB on average")


if __name__ == "__main__":
    main()
