"""``python -m vision_attn.data {shapes,glyphs}``: write an embedded synthetic dataset and print its root
(:mod:`vision_attn.commands.data`)."""

if __name__ == "__main__":
    from vision_attn.commands.data import main

    main()
