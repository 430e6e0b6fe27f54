"""Every global-attention ViT class of timm, read through ViTEncoder and the attention capture,
against timm itself.

For each class a tiny model is built with plain timm and random weights (every parameter drawn,
relative position bias tables and layer scales included), saved with safetensors and loaded by
``ViTEncoder(name, weights_file=...)``. Then:

- the encoder's tokens equal timm's ``forward_features`` and its logits timm's own (1e-5);
- every captured attention map equals ``softmax(q kᵀ * scale + bias)`` recomputed here from the
  block's weights and its input (position biases, rotary embeddings and Cait's class attention
  included; 1e-5);
- every method that applies (``applicable_methods``) runs through ``explain_classifier``; the
  raw-attention map equals the recomputed attention's row, AttnLRP's relevance ledger closes;
- models that cannot be explained (windowed, pooling, channel attention, convolutions) are
  refused with one error naming the model, why and the methods that would apply.

``VISION_ATTN_WRITE_RESULTS=1`` writes the family table (``docs/results/timm_families.json``) and
its page (``docs/timm_families.md``); the page must always be what the table renders.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.layers import apply_rot_embed_cat
from torch import Tensor, nn

from vision_attn.errors import EncoderError
from vision_attn.explain.capture import capture_attention
from vision_attn.explain.lrp import relevance_budget
from vision_attn.explain.methods import (
    METHODS,
    applicable_methods,
    explain_classifier,
    skip_inapplicable,
)
from vision_attn.models.classifier import TimmHead
from vision_attn.models.encoder import ViTEncoder, constructor_arguments, model_family

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs" / "results" / "timm_families.json"
PAGE = REPO / "docs" / "timm_families.md"
TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
NUM_CLASSES = 5
ATOL = 1e-5


@dataclass(frozen=True)
class Case:
    """One timm model checked: its class, name, options (timm keyword arguments) and what they show."""

    family: str
    name: str
    options: dict = field(default_factory=dict, hash=False)
    shows: str = ""

    @property
    def classifier(self) -> bool:
        """Whether timm's head gives logits (``global_pool=''`` returns the tokens)."""
        return self.options.get("global_pool") != ""

    @property
    def id(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}[{extra}]" if extra else self.name


CASES = [
    Case("VisionTransformer", "vit_small_patch16_224", shows="class token"),
    Case("VisionTransformer", "deit_tiny_distilled_patch16_224", shows="class and distillation tokens"),
    Case("VisionTransformer", "vit_base_patch16_reg4_gap_256", shows="4 registers, no class token, avg pooling"),
    Case("VisionTransformer", "vit_small_patch16_224", {"qk_norm": True, "init_values": 0.1},
         shows="QK-norm, layer scale"),
    Case("VisionTransformer", "vit_small_patch16_224", {"global_pool": "map"}, shows="attention pooling"),
    Case("VisionTransformer", "vit_small_patch16_224", {"class_token": False, "global_pool": "avg"},
         shows="no class token"),
    Case("VisionTransformer", "vit_small_patch16_224", {"global_pool": ""}, shows="no pooling (features)"),
    Case("VisionTransformer", "flexivit_small", shows="FlexiViT"),
    Case("VisionTransformerRelPos", "vit_relpos_small_patch16_224", shows="relative position MLP"),
    Case("Eva", "eva02_small_patch14_224", shows="RoPE, SwiGLU"),
    Case("Eva", "vit_base_patch16_rope_reg1_gap_256", shows="RoPE, a register, avg pooling"),
    Case("Eva", "vit_pe_core_tiny_patch16_384", shows="Perception Encoder: RoPE, attention pooling"),
    Case("Beit", "beit_base_patch16_224", shows="relative position bias"),
    Case("Cait", "cait_xxs24_224", shows="talking heads, class attention"),
    Case("NaFlexVit", "naflexvit_base_patch16_gap", shows="4 registers, avg pooling"),
]


# ---------------------------------------------------------------------------- building
def _randomise(model: nn.Module, seed: int) -> None:
    """Draw every parameter (timm zero-initialises biases, position bias tables and some layer
    scales: a test with those left at zero would not see them)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            is_norm_scale = p.dim() == 1 and "norm" in name and name.endswith("weight")
            scale = 1.0 if "relative_position_bias" in name else 0.2  # position biases that change the maps
            p.copy_(1.0 + 0.1 * noise if is_norm_scale else scale * noise)


class Classifier(nn.Module):
    """The encoder and timm's own pooling and classifier: what ``explain_classifier`` explains."""

    def __init__(self, encoder: ViTEncoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = TimmHead(encoder)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x))


@dataclass
class Built:
    case: Case
    reference: nn.Module  # plain timm
    encoder: ViTEncoder  # the same weights, through a safetensors file
    images: Tensor


@functools.cache
def _built(case: Case, folder: str) -> Built:
    torch.manual_seed(0)
    kwargs = {**TINY, **case.options}
    reference = timm.create_model(case.name, pretrained=False, num_classes=NUM_CLASSES, **kwargs).eval()
    _randomise(reference, seed=1)
    path = Path(folder) / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', case.id)}.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in reference.state_dict().items()}, str(path))
    sizes = {k: v for k, v in kwargs.items() if k in TINY}
    options = {k: v for k, v in kwargs.items() if k not in TINY}
    encoder = ViTEncoder(case.name, weights_file=str(path), num_classes=NUM_CLASSES, timm_kwargs=options,
                         **sizes).eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    return Built(case, reference, encoder, images)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("timm_families"))


# ---------------------------------------------------------------------------- the reference attention
def _rope(q: Tensor, k: Tensor, attn: nn.Module, rope: Tensor | None) -> tuple[Tensor, Tensor]:
    """timm's rotary embedding on the patch tokens (the prefix tokens keep their q and k)."""
    if rope is None:
        return q, k
    p, half = attn.num_prefix_tokens, getattr(attn, "rotate_half", False)
    q = torch.cat([q[:, :, :p], apply_rot_embed_cat(q[:, :, p:], rope, half=half)], dim=2)
    k = torch.cat([k[:, :, :p], apply_rot_embed_cat(k[:, :, p:], rope, half=half)], dim=2)
    return q, k


def _split(x: Tensor, heads: int) -> Tensor:
    b, t, _ = x.shape
    return x.reshape(b, t, heads, -1).transpose(1, 2)  # (B, heads, T, d)


def _qk(attn: nn.Module, y: Tensor) -> tuple[Tensor, Tensor]:
    """Queries and keys ``[B, heads, T, d]`` of an attention module's input ``y`` from its weights."""
    h = attn.num_heads
    if getattr(attn, "qkv", None) is not None:
        bias = attn.qkv.bias
        if getattr(attn, "q_bias", None) is not None:  # Eva / Beit: q and v biases, no k bias
            bias = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias])
        qkv = F.linear(y, attn.qkv.weight, bias)  # (B, T, 3 D)
        q, k, _ = qkv.chunk(3, dim=-1)
        return _split(q, h), _split(k, h)
    q_proj = getattr(attn, "q_proj", None) or attn.q
    k_proj = getattr(attn, "k_proj", None) or attn.k
    q, k = _split(q_proj(y), h), _split(k_proj(y), getattr(attn, "num_kv_heads", h))
    return q, k.repeat_interleave(h // k.shape[1], dim=1)


def _reference_attention(family: str, block: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """``softmax(q kᵀ * scale + bias)`` ``[B, heads, Tq, Tk]`` of one block, from its weights and its
    input (what the block received in the forward pass)."""
    attn = block.attn
    if family == "Cait":  # class attention: the class token queries [class token, patches]
        x, x_cls = args
        y = block.norm1(torch.cat([x_cls, x], dim=1))
        q, k = _split(attn.q(y[:, :1]), attn.num_heads), _split(attn.k(y), attn.num_heads)
    else:
        y = block.norm1(args[0])
        q, k = _qk(attn, y)
    q, k = getattr(attn, "q_norm", nn.Identity())(q), getattr(attn, "k_norm", nn.Identity())(k)
    q, k = _rope(q, k, attn, kwargs.get("rope"))
    scores = (q * attn.scale) @ k.transpose(-2, -1)  # (B, heads, Tq, Tk)
    if family == "Beit" and attn.relative_position_bias_table is not None:
        t = scores.shape[-1]
        table = attn.relative_position_bias_table[attn.relative_position_index.reshape(-1)]
        scores = scores + table.reshape(t, t, -1).permute(2, 0, 1)  # (heads, T, T)
    if family == "VisionTransformerRelPos":
        scores = scores + attn.rel_pos.get_bias()
    assert all(kwargs.get(k) is None for k in ("attn_mask", "shared_rel_pos_bias", "shared_rel_pos"))
    return scores.softmax(dim=-1)


def _read_blocks(family: str, model: nn.Module) -> list[nn.Module]:
    return list(model.blocks_token_only) if family == "Cait" else list(model.blocks)


# ---------------------------------------------------------------------------- measurements
@functools.cache
def _measured(case: Case, folder: str) -> dict:
    """The differences to timm, the attention check and which methods apply, for one case."""
    built = _built(case, folder)
    enc, ref, x = built.encoder, built.reference, built.images
    inputs: list[tuple[tuple, dict]] = []
    hooks = [b.register_forward_pre_hook(lambda _m, a, kw: inputs.append((a, kw)), with_kwargs=True)
             for b in _read_blocks(case.family, enc.model)]
    try:
        with torch.no_grad(), capture_attention(enc) as captured:
            out = enc(x)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        expected = [_reference_attention(case.family, b, a, kw)
                    for b, (a, kw) in zip(_read_blocks(case.family, enc.model), inputs, strict=True)]
        tokens_diff = (out.tokens - ref.forward_features(x)).abs().max().item()
        logits = Classifier(enc)(x) if case.classifier else None
        logits_diff = (logits - ref(x)).abs().max().item() if logits is not None else None
    assert len(captured) == len(expected) > 0
    attention_diff = max((c - e).abs().max().item() for c, e in zip(captured, expected, strict=True))
    shapes = [tuple(c.shape) for c in captured] == [tuple(e.shape) for e in expected]
    model = Classifier(enc) if logits is not None else enc
    return {
        "tokens": tokens_diff, "logits": logits_diff, "attention": attention_diff, "shapes": shapes,
        "grid": out.grid, "prefix": out.num_prefix_tokens, "captured": captured, "expected": expected,
        "inputs": inputs,
        "applicable": applicable_methods(model),
    }


# ---------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_encoder_and_capture_equal_timm_and_the_recomputed_attention(case: Case, folder: str):
    m = _measured(case, folder)
    built = _built(case, folder)
    assert built.encoder.family == case.family == model_family(built.reference)
    assert m["grid"] == (4, 4) and m["prefix"] == built.reference.num_prefix_tokens
    assert m["tokens"] <= ATOL
    assert m["logits"] is None or m["logits"] <= ATOL
    assert m["shapes"], "captured attention maps of other shapes than the blocks compute"
    assert m["attention"] <= ATOL
    queries = 1 if case.family == "Cait" else m["prefix"] + 16
    assert all(c.shape[-2:] == (queries, m["prefix"] + 16) for c in m["captured"])
    assert all(torch.allclose(c.sum(-1), torch.ones(())) for c in m["captured"])


@pytest.mark.parametrize("name, left_out", [("beit_base_patch16_224", "position bias"),
                                             ("eva02_small_patch14_224", "rope")])
def test_the_attention_check_sees_a_missing_position_bias_or_rotation(name: str, left_out: str, folder: str):
    # The check has teeth: the same recomputation without Beit's relative position bias or without
    # Eva's rotary embedding differs clearly from what the blocks computed and the capture recorded.
    case = next(c for c in CASES if c.name == name and not c.options)
    m = _measured(case, folder)
    block = _read_blocks(case.family, _built(case, folder).encoder.model)[0]
    args, kwargs = m["inputs"][0]
    with torch.no_grad():
        if left_out == "rope":
            wrong = _reference_attention(case.family, block, args, {**kwargs, "rope": None})
        else:
            q, k = _qk(block.attn, block.norm1(args[0]))
            wrong = ((q * block.attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
    assert (m["captured"][0] - m["expected"][0]).abs().max() <= ATOL
    assert (m["captured"][0] - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("case", [c for c in CASES if c.classifier], ids=lambda c: c.id)
def test_every_applicable_method_runs_and_the_attention_map_is_the_recomputed_row(case: Case, folder: str):
    m = _measured(case, folder)
    built = _built(case, folder)
    task = Classifier(built.encoder).eval()
    methods = [name for name, reason in m["applicable"].items() if reason is None]
    assert "random" in methods and "gradcam" in methods and "tokens" in methods
    assert "rollout" in methods and "attention" in methods  # attention pooling: its weights are the row
    expl = explain_classifier(task, built.images, methods)
    for name in methods:
        maps = expl.maps[name]
        assert maps.shape == (2, 4, 4) and torch.isfinite(maps).all() and maps.min() >= 0
        assert torch.allclose(maps.flatten(1).amax(1), torch.ones(2)), name
    torch.testing.assert_close(expl.logits, built.reference(built.images), atol=ATOL, rtol=0)
    if "attention" in methods:  # the last block's head-mean row of what the head reads, over the patches
        last, p = m["expected"][-1].mean(dim=1), m["prefix"]  # (B, Tq, T)
        if isinstance(expl.token_index, torch.Tensor):  # a pooling's weights per image: the rows' mixture
            ref = torch.einsum("bt,btk->bk", expl.token_index.to(last), last)[:, p:].reshape(2, 4, 4)
        else:
            rows = slice(p, None) if expl.token_index == "patches" else list(_rows(expl.token_index))
            ref = last[:, rows].mean(dim=1)[:, p:].reshape(2, 4, 4)
        torch.testing.assert_close(expl.maps["attention"], ref / ref.flatten(1).amax(1).view(2, 1, 1), atol=ATOL,
                                   rtol=0)
    if "lrp" in methods:  # AttnLRP conserves: the input's relevance plus what was kept is the logit
        budget = relevance_budget(task, built.images)
        assert abs(budget["total"] - budget["score"]) <= 1e-5 * max(1.0, abs(budget["score"]))


def _rows(token_index) -> tuple[int, ...]:
    return token_index if isinstance(token_index, tuple) else (token_index,)


def test_methods_that_do_not_apply_are_named_with_the_reason_and_skipped(folder: str, caplog):
    pooled = _built(next(c for c in CASES if c.options == {"global_pool": "map"}), folder)
    task = Classifier(pooled.encoder)
    reasons = applicable_methods(task)
    assert list(reasons) == list(METHODS)
    assert {m for m, r in reasons.items() if r} == {"lrp", "lrp_attention"}  # no AttnLRP rule for the attention pooling
    assert "AttentionPoolLatent" in reasons["lrp"]
    with caplog.at_level("WARNING", logger="vision_attn.explain.methods"):
        kept = skip_inapplicable(task, ["rollout", "gradcam", "lrp", "tokens"], what="timm:vit_small_patch16_224")
    assert kept == ["rollout", "gradcam", "tokens"]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "'lrp' does not apply to timm:vit_small_patch16_224" in warned[0]
    # the encoder alone: nothing is read by a head, the attention methods apply
    assert applicable_methods(pooled.encoder, ["rollout", "attention"]) == {"rollout": None, "attention": None}


@pytest.mark.parametrize("name, why", [
    ("swin_tiny_patch4_window7_224", "windowed attention"),
    ("pit_ti_224", "pooling attention"),
    ("mvitv2_tiny", "pooling attention"),
    ("xcit_tiny_12_p16_224", "channel attention"),
    ("resnet18", "convolutional network"),
])
def test_models_that_cannot_be_explained_are_refused_with_one_clear_error(name: str, why: str):
    with pytest.raises(EncoderError) as info:
        ViTEncoder(name)
    message = str(info.value)
    assert "\n" not in message
    assert f"timm model {name!r} is not a Vision Transformer with global attention" in message
    assert why in message and "gradcam, lrp" in message and "eva02_small_patch14_224" in message


def test_the_encoder_is_built_from_what_the_class_takes():
    assert {"dynamic_img_size", "reg_tokens", "qk_norm"} <= constructor_arguments(timm.models.VisionTransformer)
    beit = constructor_arguments(timm.models.beit.Beit)
    assert "dynamic_img_size" not in beit and "use_rel_pos_bias" in beit
    naflex = constructor_arguments(timm.models.naflexvit.NaFlexVit)
    assert {"reg_tokens", "embed_dim", "global_pool"} <= naflex  # NaFlexVitCfg's fields
    deit = constructor_arguments(timm.models.deit.VisionTransformerDistilled)  # **kwargs to its base
    assert "dynamic_img_size" in deit
    with pytest.raises(EncoderError, match=r"\(Beit\) does not take the arguments \['qk_norm'\].*use_rel_pos_bias"):
        ViTEncoder("beit_base_patch16_224", timm_kwargs={"qk_norm": True}, **TINY)
    beit_encoder = ViTEncoder("beit_base_patch16_224", **TINY)
    assert beit_encoder.fixed_input_size == (32, 32)
    with pytest.raises(EncoderError, match=r"takes images of 32x32 pixels only, got 48x48"):
        beit_encoder(torch.randn(1, 3, 48, 48))


# ---------------------------------------------------------------------------- the family table
def family_table(folder: str) -> dict:
    """The table the documentation shows: per model checked, its class, what it shows, the methods
    that apply (with the reasons of the others) and the measured largest differences."""
    rows = []
    for case in CASES:
        m = _measured(case, folder)
        rows.append({
            "class": case.family, "model": case.name, "options": case.options, "shows": case.shows,
            "methods": [k for k, r in m["applicable"].items() if r is None],
            "not_applicable": {k: r for k, r in m["applicable"].items() if r is not None},
            "max_abs_diff": {"tokens": m["tokens"], "logits": m["logits"], "attention": m["attention"]},
        })
    return {"timm": timm.__version__, "tolerance": ATOL, "models": rows}


def _model_name(row: dict) -> str:
    options = ", ".join(f"{k}={v!r}" for k, v in row["options"].items())
    return f"`{row['model']}`" + (f" ({options})" if options else "")


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.1e}"


HEADLESS_SECTION = """
## Models without a head

A timm model without a classifier loads with `timm:NAME` (and `vision_attn.load_model("timm:NAME",
weights_file=...)`) as an embedding model: DINOv2 (with or without registers), the SigLIP and CLIP
image towers, EVA-02 MIM, any model with `num_classes=0`, a weights file without the classifier's
weights, and a head that is a projection rather than classes (the size timm's pretrained config
gives the model, not an ImageNet head, no `--class_names`: Perception Encoder, a CLIP tower's
projection). Its embedding is timm's own `forward_head` on the tokens (the model's pooling,
`fc_norm` and projection). `predictions.json` records per image `embedding_norm`, `embedding`
(the vector, rounded to 5 decimals) and, with a target, `similarity`.

What is drawn:

- `rollout` and `attention`: the row of what the pooling reads, the class token's (or the mean of
  the patch tokens' rows for average pooling); register and other prefix tokens are left out of
  the patch map, and `tokens` shows the norm of every patch token (the high-norm artifact tokens
  that registers remove). An attention-pooling head (`map`: SigLIP, Perception Encoder) has no
  such row, so these methods are skipped with a warning naming them.
- `relevance`, `gradcam` and `lrp` explain a score of the embedding `e`, the target:
  - by default its norm `‖e‖`;
  - `--target_image REF`: the cosine between `e` and the embedding of the image `REF` (which parts
    make this image similar to `REF`);
  - `--target_embedding FILE`: the cosine between `e` and a vector saved by the user, a `.npy` or
    `.txt` file of the embedding's size (a CLIP or SigLIP text embedding, ...). A file that cannot
    be read, or holds a vector of another size, is one error line naming it (exit status 2).

A method that does not apply to the model is skipped with a warning naming it and why. In Python,
`model.set_inference_options(EmbeddingOptions(target_image=...))` (or `target_embedding=...`) sets
the target of `vision_attn.explain_images(model, images, method=...)`.
"""


def render_family_table(table: dict) -> str:
    """``docs/timm_families.md`` from the family table."""
    lines = [
        "# timm model classes",
        "",
        "Every global-attention Vision Transformer class of timm reads through `ViTEncoder` and the",
        "attention capture. Each row is a tiny model with random weights, built with plain timm, saved",
        "with safetensors and loaded with `ViTEncoder(name, weights_file=...)`: the largest absolute",
        "difference of the encoder's tokens and logits to timm's own, and of every captured attention",
        "map to `softmax(q kᵀ * scale + bias)` recomputed from the block's weights (position biases,",
        "rotary embeddings, Cait's class attention). Generated by `tests/test_timm_families.py`",
        f"(timm {table['timm']}; tolerance {table['tolerance']:.0e}); regenerate with",
        "`VISION_ATTN_WRITE_RESULTS=1 pytest tests/test_timm_families.py`.",
        "",
        "| class | model | shows | methods that apply | tokens | logits | attention |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in table["models"]:
        diff = row["max_abs_diff"]
        model = _model_name(row)
        lines.append(f"| {row['class']} | {model} | {row['shows']} | {', '.join(row['methods'])} | "
                     f"{_number(diff['tokens'])} | {_number(diff['logits'])} | {_number(diff['attention'])} |")
    lines += ["", "Methods that do not apply, and why:", ""]
    for row in table["models"]:
        lines += [f"- {_model_name(row)}, {method}: {reason}" for method, reason in row["not_applicable"].items()]
    lines += [
        "",
        "Refused with one error naming the model, why, and the methods that would apply: windowed attention",
        "(Swin), pooling attention (PiT, MViT), channel attention (XCiT) and convolutional networks.",
        "",
    ]
    return "\n".join(lines) + HEADLESS_SECTION


def test_family_table_is_current_and_the_page_renders_it(folder: str):
    table = family_table(folder)
    if os.environ.get("VISION_ATTN_WRITE_RESULTS") == "1":
        TABLE.parent.mkdir(parents=True, exist_ok=True)
        TABLE.write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
        PAGE.write_text(render_family_table(table), encoding="utf-8")
    committed = json.loads(TABLE.read_text(encoding="utf-8"))
    stable = ("class", "model", "options", "shows", "methods", "not_applicable")
    assert [{k: r[k] for k in stable} for r in committed["models"]] == [
        {k: r[k] for k in stable} for r in json.loads(json.dumps(table["models"]))], (
        f"{TABLE} is out of date: regenerate it with VISION_ATTN_WRITE_RESULTS=1 pytest tests/test_timm_families.py")
    for row in committed["models"]:
        assert all(v is None or v <= committed["tolerance"] for v in row["max_abs_diff"].values()), row
    assert PAGE.read_text(encoding="utf-8") == render_family_table(committed), f"{PAGE} is not what {TABLE} renders"


@pytest.mark.parametrize("case", [c for c in CASES if c.options == {"global_pool": "map"}
                                  or c.name == "vit_pe_core_tiny_patch16_384"], ids=lambda c: c.id)
def test_the_attention_pooling_weights_are_the_pools_own_attention(case: Case, folder: str):
    """The weights explanations follow for an attention-pooling model are its pool's attention:
    with them (and the pool's own values, projection and MLP) the pooled feature is timm's."""
    from vision_attn.models.classifier import attention_pool_attention, attention_pool_weights

    model = _built(case, folder).encoder.model.eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = model.forward_features(images)
        attn, offset = attention_pool_attention(model, tokens)
        pool = model.attn_pool
        x = tokens[:, offset:]
        if pool.pos_embed is not None:
            x = x + pool.pos_embed.unsqueeze(0)
        b, n, c = x.shape
        v = pool.kv(x).reshape(b, n, 2, pool.num_heads, pool.head_dim).permute(2, 0, 3, 1, 4)[1]
        out = pool.proj((attn @ v).transpose(1, 2).reshape(b, pool.latent_len, c))
        out = out + pool.mlp(pool.norm(out)) if pool.mlp is not None else out
        out = out[:, 0] if pool.pool == "token" else out.mean(1) if pool.pool == "avg" else out
        torch.testing.assert_close(out, model.pool(tokens), atol=ATOL, rtol=0)
        weights = attention_pool_weights(model, tokens)
    assert weights.shape == tokens.shape[:2] and torch.allclose(weights.sum(1), torch.ones(2), atol=1e-6)
    assert (weights[:, :offset] == 0).all() and (weights >= 0).all()
