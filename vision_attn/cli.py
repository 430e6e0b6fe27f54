"""Deprecated: moved to :mod:`vision_attn.commands` (this path works for one more version, with a warning)."""

from vision_attn._deprecated import moved

__getattr__ = moved(
    "vision_attn.cli",
    {
        "ALLOW_IMPORT_FLAG": "vision_attn.commands.policy",
        "CODE_LOADING_MODULES": "vision_attn.commands.policy",
        "DENIED_IMPORTS": "vision_attn.commands.policy",
        "EvalCLI": "vision_attn.commands.evaluate",
        "RESULT_FILES": "vision_attn.commands.evaluate",
        "RESUME_KEYWORDS": "vision_attn.commands.train",
        "RunCheckpoint": "vision_attn.commands.callbacks",
        "RunConfigCallback": "vision_attn.commands.callbacks",
        "TrainCLI": "vision_attn.commands.train",
        "check_resume_path": "vision_attn.commands.train",
        "eval_main": "vision_attn.commands.evaluate",
        "import_guard": "vision_attn.commands.policy",
        "one_line": "vision_attn.commands.args",
        "result_file_names": "vision_attn.commands.evaluate",
        "run_entry": "vision_attn.commands.run",
        "split_allow_import": "vision_attn.commands.policy",
        "train_main": "vision_attn.commands.train",
    },
)
