"""``python -m vision_attn.demo --output_dir runs/demo`` (``make demo``): train each task briefly on
the embedded synthetic data, evaluate and report (:mod:`vision_attn.commands.demo`)."""

if __name__ == "__main__":
    from vision_attn.commands.demo import main

    main()
