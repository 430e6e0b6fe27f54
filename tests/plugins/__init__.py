"""Tasks defined outside vision_attn, loaded with ``--allow_import tests.plugins``."""
