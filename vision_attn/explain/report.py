"""A self-contained ``report.html``: metrics, config, overlays and interactive attention views.

Everything is inside the one file — images as ``data:`` URIs, attention maps as quantised
arrays, the script inline — so it opens from disk with no network. Per image:

- the overlay panels ``eval.py`` wrote, side by side;
- an interactive canvas: **classification** — click a patch to see what it attends to (its
  attention row in a chosen layer, head or heads fused); **detection** — click a box to see its
  query's cross-attention; **captioning** — hover a word to see where it looked;
- classification also gets the mean deletion curve of each method (lower = more faithful).

The page keeps a ``data-shown`` attribute on each canvas naming the map on display, so tests
(and users' scripts) can check that a click changed it.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from vision_attn.outputs import write_text

__all__ = ["Report", "png_data_uri", "quantise", "script_json", "write_report"]

# Characters that could end a <script> element or start markup inside one, and the two line
# separators older JavaScript parsers reject in strings: written as JSON's \u escapes, which
# parse back to the same text.
_SCRIPT_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def script_json(obj: Any) -> str:
    """``obj`` as JSON that is safe inside an HTML ``<script>`` element.

    ``<``, ``>``, ``&``, U+2028 and U+2029 are written as ``\\uXXXX`` escapes (JSON allows them
    only inside strings, where the escape means the same character), so no value (a category
    named ``</script><script>alert(1)</script>``, a caption word) can close the element or
    start markup; ``json.loads`` of the result gives ``obj`` back.
    """
    text = json.dumps(obj)
    for char, escaped in _SCRIPT_ESCAPES.items():
        text = text.replace(char, escaped)
    return text


@dataclass
class Report:
    """What the explanation code collects for ``report.html`` (see :func:`write_report`)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    curves: dict[str, list[float]] | None = None

    @staticmethod
    def display_image(rgb: np.ndarray, side: int = 256) -> str:
        """The image as a square ``side`` px data URI (what the interactive canvas draws on)."""
        return png_data_uri(cv2.resize(np.ascontiguousarray(rgb), (side, side), interpolation=cv2.INTER_NEAREST))


def png_data_uri(rgb: np.ndarray) -> str:
    ok, buf = cv2.imencode(".png", cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2BGR))
    if not ok:
        raise OSError("OpenCV could not encode a report image as PNG")
    return "data:image/png;base64," + base64.b64encode(buf.tobytes()).decode("ascii")


def quantise(maps: torch.Tensor | np.ndarray) -> str:
    """Maps ``[..., N]`` -> base64 of uint8, each last-axis row scaled to its maximum (0..255)."""
    a = maps.detach().float().cpu().numpy() if isinstance(maps, torch.Tensor) else np.asarray(maps, np.float32)
    a = np.clip(np.nan_to_num(a), 0, None)
    peak = a.max(axis=-1, keepdims=True)
    a = np.where(peak > 0, a / np.where(peak > 0, peak, 1), 0)
    return base64.b64encode((a * 255).round().astype(np.uint8).tobytes()).decode("ascii")


_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}
.item{border-top:1px solid #ddd;padding:12px 0}.panels img{max-height:200px;margin:2px;border:1px solid #eee}
canvas{border:1px solid #999;cursor:crosshair;image-rendering:pixelated}.word{padding:1px 3px;cursor:pointer}
.word:hover,.word.on{background:#fd0}.controls{margin:4px 0;font-size:13px}pre{font-size:12px;background:#f6f6f6;padding:8px}
"""

_SCRIPT = r"""
function decode(b64){const s=atob(b64);const a=new Uint8Array(s.length);for(let i=0;i<s.length;i++)a[i]=s.charCodeAt(i);return a;}
function jet(v){const f=x=>Math.min(1,Math.max(0,1.5-Math.abs(4*v-x)))*255;return `rgb(${f(3)|0},${f(2)|0},${f(1)|0})`;}
function View(item){
  const cv=document.getElementById('cv'+item.id),ctx=cv.getContext('2d'),img=new Image(),S=cv.width;
  const [gh,gw]=item.grid,N=gh*gw,data=item.maps?decode(item.maps):null,cw=S/gw,ch=S/gh;
  let mark=null;
  function paint(arr,off,label,extra){
    ctx.globalAlpha=1;ctx.drawImage(img,0,0,S,S);
    if(arr){let m=0;for(let i=0;i<N;i++)m=Math.max(m,arr[off+i]);ctx.globalAlpha=0.55;
      for(let i=0;i<N;i++){ctx.fillStyle=jet(m?arr[off+i]/m:0);ctx.fillRect((i%gw)*cw,Math.floor(i/gw)*ch,cw+0.5,ch+0.5);}}
    ctx.globalAlpha=1;if(extra)extra();cv.dataset.shown=label;}
  function drawBoxes(){ctx.lineWidth=2;item.boxes.forEach((b,k)=>{ctx.strokeStyle=k===mark?'#ff0':'#0f0';
    ctx.strokeRect(b[0]*S,b[1]*S,(b[2]-b[0])*S,(b[3]-b[1])*S);});}
  img.onload=()=>paint(null,0,'image',item.kind==='boxes'?drawBoxes:null);img.src=item.image;
  if(item.kind==='patches'){
    const H=item.heads,ls=document.getElementById('layer'+item.id),hs=document.getElementById('head'+item.id);
    const row=(l,h,p)=>((l*H+h)*N+p)*N;
    function show(p){const l=+ls.value,h=hs.value;mark=p;
      const outline=()=>{ctx.strokeStyle='#fff';ctx.lineWidth=2;ctx.strokeRect((p%gw)*cw,Math.floor(p/gw)*ch,cw,ch);};
      if(h==='fused'){const t=new Float32Array(N);for(let k=0;k<H;k++)for(let i=0;i<N;i++)t[i]+=data[row(l,k,p)+i]/H;
        paint(t,0,`layer${l}-fused-patch${p}`,outline);}
      else paint(data,row(l,+h,p),`layer${l}-head${h}-patch${p}`,outline);}
    cv.addEventListener('click',e=>{const r=cv.getBoundingClientRect();const x=Math.floor((e.clientX-r.left)/r.width*gw),
      y=Math.floor((e.clientY-r.top)/r.height*gh);show(Math.min(N-1,Math.max(0,y*gw+x)));});
    ls.onchange=hs.onchange=()=>{if(mark!==null)show(mark);};
  } else if(item.kind==='boxes'){
    cv.addEventListener('click',e=>{const r=cv.getBoundingClientRect();const fx=(e.clientX-r.left)/r.width,fy=(e.clientY-r.top)/r.height;
      let best=-1,area=1e9;item.boxes.forEach((b,k)=>{const a=(b[2]-b[0])*(b[3]-b[1]);
        if(fx>=b[0]&&fx<=b[2]&&fy>=b[1]&&fy<=b[3]&&a<area){best=k;area=a;}});
      if(best<0)return;mark=best;paint(data,best*N,`box${best}`,drawBoxes);
      document.getElementById('sel'+item.id).textContent=item.labels[best];});
  } else if(item.kind==='words'){
    const spans=document.querySelectorAll('#words'+item.id+' .word');
    spans.forEach(el=>{const k=+el.dataset.k;const on=()=>{spans.forEach(w=>w.classList.remove('on'));el.classList.add('on');
      paint(data,k*N,`word${k}`);};el.addEventListener('mouseenter',on);el.addEventListener('click',on);});
  }
}
window.addEventListener('load',()=>{for(const item of ITEMS)View(item);});
"""


def _curve_svg(curves: dict[str, list[float]]) -> str:
    """Inline SVG of deletion curves (x: fraction deleted, y: probability)."""
    w, h, pad = 360, 200, 30
    colours = ["#d62728", "#1f77b4", "#2ca02c", "#7f7f7f", "#9467bd"]
    parts = [f'<svg id="deletion" width="{w}" height="{h}">',
             f'<rect x="{pad}" y="5" width="{w - pad - 5}" height="{h - pad - 5}" fill="none" stroke="#999"/>']
    for i, (name, ys) in enumerate(curves.items()):
        pts = " ".join(f"{pad + (w - pad - 5) * k / max(1, len(ys) - 1):.1f},{5 + (h - pad - 5) * (1 - y):.1f}" for k, y in enumerate(ys))
        c = colours[i % len(colours)]
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{w - 150}" y="{20 + 14 * i}" fill="{c}" font-size="12">{html.escape(name)}</text>')
    parts.append(f'<text x="{pad}" y="{h - 8}" font-size="11">fraction of patches deleted (0 → 1)</text></svg>')
    return "".join(parts)


def write_report(path: Path, title: str, metrics: dict[str, float], config: dict[str, Any], items: list[dict[str, Any]],
                 curves: dict[str, list[float]] | None = None, canvas: int = 256,
                 root: str | Path | None = None) -> Path:
    """Write ``report.html``.

    Args:
        path: the file (written through a fresh temporary file and a rename, see
            :mod:`vision_attn.outputs`).
        title: page title.
        metrics: the run's metrics.
        config: a summary shown as JSON (model, data, checkpoint).
        items: per image ``{"name", "text", "image" (data URI), "panels" [data URIs], "kind"
            ("patches" | "boxes" | "words" | None), "grid" [h, w], "maps" (quantised), ...}``:
            ``patches`` add ``layers``, ``heads``; ``boxes`` add ``boxes`` (xyxy fractions) and
            ``labels``; ``words`` add ``words``.
        curves: deletion curves per method (classification).
        canvas: side of the interactive canvas in pixels.
        root: the output folder the page must stay in (default: its own folder).

    Every text is HTML-escaped where it enters markup, and the data the script reads is
    embedded with :func:`script_json`, so no name, label or word can run script in the page.
    """
    body = [f"<h1>{html.escape(title)}</h1>", "<h2>Metrics</h2><table>"]
    body += [f"<tr><th>{html.escape(k)}</th><td>{v:.4f}</td></tr>" for k, v in metrics.items()]
    body.append(f"</table><h2>Config</h2><pre>{html.escape(json.dumps(config, indent=2, default=str))}</pre>")
    if curves:
        body.append("<h2>Deletion curves</h2><p>Probability of the predicted class as the most salient patches are "
                    "deleted first, mean over the images below (lower = more faithful).</p>" + _curve_svg(curves))
    body.append("<h2>Images</h2>")
    js_items = []
    for i, it in enumerate(items):
        body.append(f'<div class="item" id="item{i}"><h3>{html.escape(it["name"])}</h3><p>{html.escape(it.get("text", ""))}</p>')
        body.append('<div class="panels">' + "".join(f'<img src="{html.escape(p)}" alt="overlay">' for p in it.get("panels", [])) + "</div>")
        kind = it.get("kind")
        if kind:
            controls = ""
            if kind == "patches":
                layers = "".join(f'<option value="{k}"{" selected" if k == it["layers"] - 1 else ""}>{k}</option>' for k in range(it["layers"]))
                heads = '<option value="fused">fused (mean)</option>' + "".join(f'<option value="{k}">{k}</option>' for k in range(it["heads"]))
                controls = (f'<div class="controls">Click a patch to see what it attends to. Layer <select id="layer{i}">'
                            f'{layers}</select> head <select id="head{i}">{heads}</select></div>')
            elif kind == "boxes":
                controls = f'<div class="controls">Click a box to see its query\'s cross-attention: <b id="sel{i}"></b></div>'
            elif kind == "words":
                words = " ".join(f'<span class="word" data-k="{k}">{html.escape(w)}</span>' for k, w in enumerate(it["words"]))
                controls = f'<div class="controls" id="words{i}">Hover a word: {words}</div>'
            body.append(controls + f'<canvas id="cv{i}" width="{canvas}" height="{canvas}" data-shown="image"></canvas>')
            js_items.append({"id": i, **{k: v for k, v in it.items() if k not in ("panels", "name", "text")}})
        body.append("</div>")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{_STYLE}</style>"
            f"</head><body>{''.join(body)}<script>const ITEMS={script_json(js_items)};{_SCRIPT}</script></body></html>")
    return write_text(path, page, root=root)
