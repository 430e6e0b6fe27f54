"""``vision-attn data {shapes,glyphs,strokes}`` (``python -m vision_attn.data``): write an embedded
synthetic dataset and print its root."""

from __future__ import annotations

import argparse

from vision_attn.data.strokes import StrokeSceneConfig, ensure_stroke_scenes
from vision_attn.data.synthetic import (
    ShapesConfig,
    ensure_glyphs_classification,
    ensure_shapes_classification,
)


def main(argv: list[str] | None = None, prog: str = "python -m vision_attn.data") -> None:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a generated dataset and print its root: shapes and glyphs in the ImageFolder "
                    "layout (classification), strokes in the COCO layout (hand-drawn digit scenes with boxes, "
                    "masks and captions: detection and captioning).",
    )
    parser.add_argument("kind", choices=["shapes", "glyphs", "strokes"],
                        help="shapes: five shapes, 32 px; glyphs: font digits and letters; strokes: scenes of one "
                             "to three hand-drawn digits, 64 px")
    parser.add_argument("--cache_dir", default=None,
                        help="parent folder (default $VISION_ATTN_DATA or ~/.cache/vision_attn)")
    parser.add_argument("--image_size", type=int, default=None, help="image side in pixels (default 32; strokes 64)")
    parser.add_argument("--num_train", type=int, default=None,
                        help="training images (default 4000 shapes, 10000 glyphs, 1000 strokes)")
    parser.add_argument("--num_val", type=int, default=None,
                        help="validation images (default 500 shapes, 2000 glyphs, 200 strokes)")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed (another seed, other images)")
    args = parser.parse_args(argv)
    if args.kind == "strokes":
        strokes = StrokeSceneConfig()
        print(ensure_stroke_scenes(StrokeSceneConfig(image_size=args.image_size or strokes.image_size,
                                                     num_train=args.num_train or strokes.num_train,
                                                     num_val=args.num_val or strokes.num_val, seed=args.seed),
                                   args.cache_dir))
        return
    glyphs = args.kind == "glyphs"
    cfg = ShapesConfig(
        image_size=args.image_size or 32,
        num_train=args.num_train or (10000 if glyphs else 4000),
        num_val=args.num_val or (2000 if glyphs else 500),
        seed=args.seed,
    )
    fn = ensure_glyphs_classification if glyphs else ensure_shapes_classification
    print(fn(cfg, args.cache_dir))
