"""``vision-attn data {shapes,glyphs}`` (``python -m vision_attn.data``): write an embedded synthetic dataset and print its root."""

from __future__ import annotations

import argparse

from vision_attn.data.synthetic import (
    ShapesConfig,
    ensure_glyphs_classification,
    ensure_shapes_classification,
)


def main(argv: list[str] | None = None, prog: str = "python -m vision_attn.data") -> None:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write an embedded synthetic dataset (ImageFolder layout) and print its root.",
    )
    parser.add_argument("kind", choices=["shapes", "glyphs"])
    parser.add_argument("--cache_dir", default=None, help="parent folder (default $VISION_ATTN_DATA or ~/.cache/vision_attn)")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--num_train", type=int, default=None, help="default 4000 (shapes) / 10000 (glyphs)")
    parser.add_argument("--num_val", type=int, default=None, help="default 500 (shapes) / 2000 (glyphs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    glyphs = args.kind == "glyphs"
    cfg = ShapesConfig(
        image_size=args.image_size,
        num_train=args.num_train or (10000 if glyphs else 4000),
        num_val=args.num_val or (2000 if glyphs else 500),
        seed=args.seed,
    )
    fn = ensure_glyphs_classification if glyphs else ensure_shapes_classification
    print(fn(cfg, args.cache_dir))
