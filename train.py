#!/usr/bin/env python
"""Train a vision_attn task: ``python train.py --config configs/classification/shapes.yaml``.

See ``python train.py --help`` and the README's configuration table. A config may name only
vision_attn, torch and Lightning classes and callables; allow a module of your own (e.g. your
callbacks) with ``--allow_import PREFIX`` on the command line.
"""

from vision_attn.commands.run import run_entry
from vision_attn.commands.train import train_main

if __name__ == "__main__":
    run_entry(train_main)
