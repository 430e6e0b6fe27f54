"""``mistakes.html``: every mistake of a detector's evaluation with the map of the query behind it.

One self-contained file: the images once each (JPEG, at most :data:`THUMB` px a side), the maps
as bytes; cards draw themselves on a canvas when they scroll into view, so thousands of cards stay
fast. Filters: class, the class it is confused with (a classifier's: the prediction; with the class,
a cell of the confusion matrix), kind of mistake, object size, whether the map looked at the object;
the page's address can set them (``mistakes.html#class=cat&confused=dog``: what a wrong cell of
``report.html``'s confusion matrix links to). The
cards come from :func:`~vision_attn.explain.detection_mistakes.detection_mistakes`; every text is
escaped where it enters markup and the data enters the script through
:func:`~vision_attn.report.markup.script_json`.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from vision_attn.explain.detection_mistakes import DETECTION_INTRO, MISTAKE_KINDS, MistakesBrowser
from vision_attn.outputs import write_text
from vision_attn.report.markup import esc, script_json

__all__ = ["THUMB", "mistakes_page", "write_mistakes_page"]

THUMB = 256
"""Longest side of an image on the page, in pixels."""


def _thumb_uri(rgb: np.ndarray) -> tuple[str, float]:
    """A JPEG data URI of the picture, its longer side at most :data:`THUMB`; and the scale used."""
    h, w = rgb.shape[:2]
    scale = min(1.0, THUMB / max(h, w))
    if scale < 1.0:
        rgb = cv2.resize(rgb, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2BGR),
                           [cv2.IMWRITE_JPEG_QUALITY, 85])
    if not ok:
        raise OSError("OpenCV could not encode a mistakes-browser image as JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.tobytes()).decode("ascii"), scale


def mistakes_page(title: str, cards: list[dict[str, Any]], pictures: dict[Any, np.ndarray], method: str,
                  intro: str = DETECTION_INTRO) -> str:
    """The browser's HTML (see the module docstring): every text escaped, the data in the script
    through :func:`~vision_attn.report.markup.script_json`."""
    images, scales = {}, {}
    for image_id in dict.fromkeys(c["image_id"] for c in cards):  # each image of a card once
        images[str(image_id)], scales[str(image_id)] = _thumb_uri(pictures[image_id])
    def scaled(c: dict[str, Any], key: str) -> list[float] | None:
        return None if c.get(key) is None else [v * scales[str(c["image_id"])] for v in c[key]]

    data = [{"image": str(c["image_id"]), "kind": c["kind"], "category": c["category"],
             "confused": c.get("confused") or "", "note": c.get("note") or "",
             "score": c.get("score"), "size": c.get("size") or "", "box": scaled(c, "box"),
             "object": scaled(c, "object"),
             "looked": c.get("looked"), "grid": c.get("grid"), "map": c.get("map")} for c in cards]
    sizes = [v for v in ("small", "medium", "large") if any(c.get("size") == v for c in cards)]
    classes = sorted({c["category"] for c in cards})
    others = sorted({c["confused"] for c in cards if c.get("confused")})

    def options(values: list[str], labels: dict[str, str] | None = None) -> str:
        return "".join(f"<option value='{esc(v)}'>{esc((labels or {}).get(v, v))}</option>" for v in values)

    counts = defaultdict(int)
    for c in cards:
        counts[c["kind"]] += 1
    summary = ", ".join(f"{counts[k]} {v}" for k, v in MISTAKE_KINDS.items() if counts[k])
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{_CSS}</style></head>"
        f"<body><h1>{esc(title)}</h1><p>{len(cards)} mistakes ({esc(summary or 'none')}); maps: {esc(method)}. "
        f"{esc(intro)}</p>"
        "<div class='filters'>"
        f"<label>class <select id='f-class'><option value=''>all</option>{options(classes)}</select></label>"
        f"<label>confused with <select id='f-confused'><option value=''>all</option>{options(others)}</select></label>"
        f"<label>mistake <select id='f-kind'><option value=''>all</option>"
        f"{options([k for k in MISTAKE_KINDS if counts[k]], MISTAKE_KINDS)}</select></label>"
        f"<label>size <select id='f-size'><option value=''>all</option>{options(sizes)}"
        "</select></label><label>looked at the object <select id='f-looked'><option value=''>all</option>"
        "<option value='yes'>yes</option><option value='no'>no</option><option value='none'>no object</option>"
        "</select></label> <span id='shown'></span></div><div id='cards'></div>"
        f"<script>const NAMES={script_json(MISTAKE_KINDS)};const IMAGES={script_json(images)};"
        f"const CARDS={script_json(data)};{_JS}</script></body></html>"
    )


def write_mistakes_page(path: str | Path, browser: MistakesBrowser, root: str | Path | None = None) -> Path:
    """Write the browser's page to ``path`` (inside ``root``)."""
    return write_text(path, mistakes_page(browser.title, browser.cards, browser.pictures, browser.method,
                                          browser.intro), root=root)


_CSS = """body{font:14px system-ui,sans-serif;margin:16px;color:#222}
.filters{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #ddd;z-index:1}
.filters label{margin-right:14px}#cards{display:flex;flex-wrap:wrap;gap:10px;margin-top:10px}
.card{width:260px;border:1px solid #ccc;border-radius:4px;padding:4px}.card canvas{width:256px;display:block}
.card .t{font-size:12px;line-height:1.35}.yes{color:#070}.no{color:#b00}.hidden{display:none}"""

_JS = """const root=document.getElementById('cards');const loaded={};
function pic(id){if(!loaded[id]){const im=new Image();im.src=IMAGES[id];loaded[id]=im;}return loaded[id];}
function heat(c){const [h,w]=c.grid,raw=atob(c.map),cv=document.createElement('canvas');cv.width=w;cv.height=h;
const ctx=cv.getContext('2d'),img=ctx.createImageData(w,h);
for(let i=0;i<h*w;i++){const v=raw.charCodeAt(i)/255;img.data[4*i]=255;img.data[4*i+1]=Math.round(255*(1-v));
img.data[4*i+2]=0;img.data[4*i+3]=Math.round(170*v);}ctx.putImageData(img,0,0);return cv;}
function draw(card,c){const im=pic(c.image),cv=card.querySelector('canvas');const go=()=>{cv.width=im.width;
cv.height=im.height;const ctx=cv.getContext('2d');ctx.drawImage(im,0,0);if(c.map){ctx.imageSmoothingEnabled=true;
ctx.drawImage(heat(c),0,0,im.width,im.height);}ctx.lineWidth=2;
if(c.object){ctx.strokeStyle='#0a0';ctx.strokeRect(c.object[0],c.object[1],c.object[2]-c.object[0],
c.object[3]-c.object[1]);}ctx.strokeStyle='#e00';ctx.setLineDash(c.kind==='miss'?[4,3]:[]);
if(c.box)ctx.strokeRect(c.box[0],c.box[1],c.box[2]-c.box[0],c.box[3]-c.box[1]);};
if(im.complete&&im.width)go();else im.addEventListener('load',go,{once:true});}
const seen=new IntersectionObserver(es=>{for(const e of es){if(e.isIntersecting&&!e.target.dataset.drawn){
e.target.dataset.drawn='1';draw(e.target,CARDS[+e.target.dataset.i]);}}},{rootMargin:'300px'});
CARDS.forEach((c,i)=>{const d=document.createElement('div');d.className='card';d.dataset.i=i;
d.dataset.category=c.category;d.dataset.confused=c.confused;d.dataset.kind=c.kind;d.dataset.size=c.size;
d.dataset.looked=c.looked===null?'none':(c.looked?'yes':'no');const cv=document.createElement('canvas');
const t=document.createElement('div');t.className='t';
const score=c.score===null?'':' '+c.score.toFixed(2);
t.textContent=NAMES[c.kind]+': '+c.category+(c.note?' ('+c.note+')':'')+score+(c.size?', '+c.size:'')+
', image '+c.image;const f=document.createElement('div');f.className='t '+d.dataset.looked;
f.textContent=c.looked===null?'no object to look at':(c.looked?'looked at the object':'did not look at the object');
d.append(cv,t,f);root.append(d);seen.observe(d);});
function apply(){const v=k=>document.getElementById('f-'+k).value;let n=0;
for(const d of root.children){const ok=['category','confused','kind','size','looked'].every(k=>{
const want=v(k==='category'?'class':k);return !want||d.dataset[k]===want;});d.classList.toggle('hidden',!ok);n+=ok;}
document.getElementById('shown').textContent=n+' of '+root.children.length+' shown';}
for(const k of ['class','confused','kind','size','looked'])document.getElementById('f-'+k).addEventListener('change',
apply);
// mistakes.html#class=a&confused=b (report.html's confusion-matrix cells link here): those filters set
function fromHash(){for(const [k,v] of new URLSearchParams(location.hash.slice(1))){
const el=document.getElementById('f-'+k);if(el&&[...el.options].some(o=>o.value===v))el.value=v;}apply();}
window.addEventListener('hashchange',fromHash);fromHash();"""
