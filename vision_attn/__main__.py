"""``python -m vision_attn SUBCOMMAND ...``: the ``vision-attn`` command (:mod:`vision_attn.commands`)."""

from vision_attn.commands import main

if __name__ == "__main__":
    main()
