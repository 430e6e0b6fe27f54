"""How values become page text: HTML escaping, metric and axis numbers, JSON safe in a ``<script>``.

Every text that comes from data (class names, file names, captions, configuration values, CSV
column names) goes through :func:`esc` where it enters markup, and the data the page's script
reads goes through :func:`script_json`.
"""

from __future__ import annotations

import html
import json
import math
import numbers
from typing import Any

from vision_attn.blocks import finite
from vision_attn.outputs import json_ready

__all__ = ["esc", "finite", "fmt", "script_json", "tick"]

# Characters that could end a <script> element or start markup inside one, and the two line
# separators older JavaScript parsers reject in strings: written as JSON's \u escapes, which
# parse back to the same text.
_SCRIPT_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def script_json(obj: Any) -> str:
    """``obj`` as JSON that is safe inside an HTML ``<script>`` element.

    ``<``, ``>``, ``&``, U+2028 and U+2029 are written as ``\\uXXXX`` escapes (JSON allows them
    only inside strings, where the escape means the same character), so no value (a category
    named ``</script><script>alert(1)</script>``, a caption word) can close the element or
    start markup; ``json.loads`` of the result gives ``obj`` back (non-finite numbers, which
    JSON cannot hold, become ``null``).
    """
    text = json.dumps(json_ready(obj)[0], allow_nan=False)
    for char, escaped in _SCRIPT_ESCAPES.items():
        text = text.replace(char, escaped)
    return text


def esc(value: Any) -> str:
    """``str(value)`` escaped for HTML text and attribute values (quotes included)."""
    return html.escape(str(value), quote=True)


def fmt(value: Any, digits: int = 4) -> str:
    """A metric for display, as escaped text: ``—`` for missing / NaN / COCO's -1 (no ground truth in
    range); an integer (a count) as an integer; a value that is no number is shown as it is."""
    if value is None or isinstance(value, bool):
        return "—"
    if isinstance(value, numbers.Integral):
        return "—" if value == -1 else str(int(value))
    try:
        v = float(value)
    except (TypeError, ValueError):
        return esc(value)
    if not math.isfinite(v) or v == -1.0:
        return "—"
    return f"{v:.{digits}f}" if abs(v) < 1e4 else f"{v:.4g}"


def tick(v: float) -> str:
    """An axis end label: 3 significant digits, short exponents for learning rates (``4.48e-4``)."""
    if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
        mantissa, exponent = f"{v:.2e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{v:.3g}" if v != 0 else "0"
