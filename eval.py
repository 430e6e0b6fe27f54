#!/usr/bin/env python
"""Evaluate a checkpoint: ``python eval.py --config CFG --ckpt_path CKPT --output_dir OUT``.

Writes ``OUT/metrics.json`` and ``OUT/predictions.json``. The checkpoint is read without executing
pickled code and the model is rebuilt only from vision_attn classes (never ``--allow_import``).
"""

from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.run import run_entry

if __name__ == "__main__":
    run_entry(eval_main)
