"""Relevance through the decoder (Chefer, Gur & Wolf 2021b, "Generic Attention-model
Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers").

Maps over the image *patches* for one detection of the DETR head (its query's class score) or
one generated word of the caption decoder (its log-probability), batched over images and over
several explained items per image. Raw decoder cross-attention (method ``attention``) looks at
encoder *tokens*, which are already mixtures of patches; this method (``relevance``) follows
the gradient-weighted attention through the decoder's self- and cross-attention *and* the
encoder's self-attention.

Notation (``i``: image tokens, ``T = P + h * w`` with ``P`` prefix tokens; ``q``: the queries
of DETR or the words of the caption; ``N = h * w`` memory tokens, the encoder's patch tokens):

- every attention map ``A [heads, Tq, Tk]`` with the gradient of the explained score ``y``,
  ``Ā = mean_heads((∂y/∂A ⊙ A)⁺)`` (eq. 5);
- start ``R^ii = I_T``, ``R^qq = I_Q``, ``R^qi = 0 [Q, T]``;
- encoder self-attention, every block: ``R^ii += Ā^ii R^ii`` (eq. 6);
- decoder layer, self-attention: ``R^qq += Ā^qq R^qq`` and ``R^qi += Ā^qq R^qi`` (eqs. 6, 7);
- decoder layer, cross-attention: ``R^qi += (R̄^qq)ᵀ Ā^qi R̄^ii[patch rows]`` (eq. 10) with
  ``R̄^xx = rownorm(R^xx - I) + I`` (eqs. 8, 9). Eq. 11 (``R^qq += Ā^qi R^iq``) adds nothing:
  the encoder never sees the queries, so ``R^iq = 0``.
- the map of item ``(q, y)`` is row ``q`` of ``R^qi`` over the patch columns (prefix columns
  such as the class token are not drawn), scaled to maximum 1.

The memory the decoder reads is the encoder's patch tokens ``P .. T-1`` after per-token maps
(linear projection, LayerNorm), so memory token ``n`` is encoder token ``P + n`` and
``Ā^qi [Q, N]`` meets the rows ``P ..`` of ``R̄^ii``. A caption decoder with
``embedding_memory`` adds, per memory token, the same patch's token from before the encoder's
first block: a skip around the encoder whose relevance is the patch itself, which is the
identity part of ``R̄^ii = rownorm(R^ii - I) + I``; the rule is kept as it is (it does not weigh
the two paths by how much each contributes). ``pixel_memory`` (the patch's own pixels added to
its memory token) is the same kind of skip and is treated the same way. With the DETR head's simple feature
pyramid (``pyramid=True``) the memory is the pyramid levels' tokens, each made from a known
patch or block of patches; ``Ā^qi [Q, M]`` is first carried to the patches by the pyramid's
linear, mass-preserving map (:meth:`~vision_attn.models.detr.SimpleFeaturePyramid.to_patches`:
a finer token's weight goes to its patch, a pooled token's is spread evenly over its window),
i.e. a pyramid token's relevance row is taken as the mean of its patches' rows. This treats the
transposed convolution and the max pooling as mixing only within their window, which they do,
but not by how much each patch counts in a max: an approximation the plain head does not need.

Where a row of ``R^xx - I`` sums to zero (a token no relevance reached: a caption position
after the explained word, or in a one-layer decoder a query the explained one never reads),
that row stays zero instead of ``0 / 0``; the authors' code would turn the whole update into
NaN and then zero it. The implementation keeps ``R̂ = R - I`` rather than ``R`` (the same
equations: ``R̂ += Ā + Ā R̂``), because forming ``R - I`` in float32 cancels catastrophically
when the relevance is small.

Batching: every (image, item) pair becomes one row of a batch (the image repeated), all rows
run in one forward pass, and one backward pass of the *sum* of the rows' scores gives each
row the gradient of its own score (rows never mix in evaluation mode). ``max_rows`` bounds
the rows of one pass.

The model is left as it was: evaluation mode inside (restored afterwards, module by module),
no parameter gradient is accumulated (``torch.autograd.grad`` on the attention only), every
hook is removed and every ``fused_attn`` flag restored, even after an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.attention import explicit_attention
from vision_attn.errors import ConfigError
from vision_attn.explain.capture import AttentionCaptureError, attention_modules
from vision_attn.explain.rollout import normalize_maps, square_rows

__all__ = [
    "RELEVANCE_RULES",
    "RelevanceRule",
    "caption_relevance",
    "cross_attention_rule",
    "detection_relevance",
    "fuse_gradient_attention",
    "normalize_residual",
]

log = logging.getLogger(__name__)

DetectionScore = Literal["logit", "probability"]


RelevanceRule = Literal["full", "decoder", "decoder_last"]
RELEVANCE_RULES: tuple[str, ...] = ("full", "decoder", "decoder_last")
"""How far the relevance of a detection or word is carried: ``full`` (the rules above, through the
decoder and the encoder's self-attention, ``R̄^ii`` of eq. 10), ``decoder`` (the gradient-weighted
cross-attention of every decoder layer carried through the decoder's self-attention; each memory
token stands for its own patch, ``R̄^ii = I``: the encoder's mixing, which spreads the map over
the tokens the patch talked to, is left out) or ``decoder_last`` (that, of the last decoder
layer's cross-attention only). Measured in ``docs/results/explanations.md``."""


# ---------------------------------------------------------------------------- the rules, batched
def fuse_gradient_attention(attn: Tensor, grad: Tensor) -> Tensor:
    """``Ā = mean_heads((∇A ⊙ A)⁺)``: ``[B, heads, Tq, Tk]`` twice -> ``[B, Tq, Tk]`` (eq. 5)."""
    return (grad.float() * attn.float()).clamp(min=0).mean(dim=1)


def normalize_residual(hat: Tensor) -> Tensor:
    """``R̄ = rownorm(R̂) + I`` from ``R̂ = R - I`` (``[B, T, T]``; eqs. 8, 9); rows of ``R̂``
    that sum to zero stay zero (see the module docstring).

    Takes ``R̂`` itself, not ``R``: the relevance is kept as ``R = I + R̂`` throughout, because
    ``R - I`` cancels catastrophically in float32 when ``R̂`` is small (an untrained or
    low-gradient model) and the row normalisation would amplify that error.
    """
    eye = torch.eye(hat.shape[-1], device=hat.device, dtype=hat.dtype)
    sums = hat.sum(dim=-1, keepdim=True)  # (B, T, 1), >= 0: R̂ >= 0 entrywise
    hat = torch.where(sums > 0, hat / sums.clamp(min=torch.finfo(hat.dtype).tiny), torch.zeros_like(hat))
    return hat + eye


def cross_attention_rule(hat_qq: Tensor, cam_qi: Tensor, bar_ii_rows: Tensor) -> Tensor:
    """Eq. 10's addition ``(R̄^qq)ᵀ Ā^qi R̄^ii``: ``R̂^qq [B, Q, Q]``, ``Ā^qi [B, Q, N]`` and the
    memory's rows of ``R̄^ii`` (``[B, N, T]``, already normalised) -> ``[B, Q, T]``."""
    return normalize_residual(hat_qq).transpose(1, 2) @ (cam_qi @ bar_ii_rows)


# ---------------------------------------------------------------------------- capture
@contextmanager
def _record(groups: dict[str, list[nn.Module]]) -> Iterator[dict[str, list[Tensor]]]:
    """Record the softmax output of each listed attention module, kept in the autograd graph.

    ``groups`` maps a name to attention modules (anything with ``fused_attn`` and ``attn_drop``,
    see :func:`~vision_attn.explain.capture.attention_modules`); the result maps the same names
    to the recorded ``[B, heads, Tq, Tk]`` tensors in execution order. A probability tensor that
    does not require gradients (nothing before it is trained: frozen weights) is replaced by an
    equal leaf that does — the value is the same and nothing upstream could carry a gradient.
    """
    records: dict[str, list[Tensor]] = {name: [] for name in groups}
    handles = []

    def make_hook(name: str) -> Callable:
        def hook(_module: nn.Module, inputs: tuple) -> tuple | None:
            probs = inputs[0]
            if not probs.requires_grad:
                probs = probs.detach().requires_grad_(True)
                records[name].append(probs)
                return (probs, *inputs[1:])
            records[name].append(probs)
            return None

        return hook

    with explicit_attention(m for modules in groups.values() for m in modules):
        try:
            for name, modules in groups.items():
                for m in modules:
                    handles.append(m.attn_drop.register_forward_pre_hook(make_hook(name)))
            yield records
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def _explaining(task: nn.Module) -> Iterator[None]:
    """Evaluation mode and gradients on inside (also under a caller's ``no_grad`` or
    ``inference_mode``: Lightning's predict loop); every module's mode restored after."""
    modes = [(m, m.training) for m in task.modules()]
    try:
        task.eval()
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _encode(encoder: nn.Module, images: Tensor):
    """The encoder's output; a ``torch.compile``-d encoder runs eagerly (hooks must fire)."""
    if getattr(encoder, "_compiled_call_impl", None) is not None:
        return encoder.forward(images)
    return encoder(images)


def _expect(records: dict[str, list[Tensor]], counts: dict[str, int]) -> None:
    for name, n in counts.items():
        if len(records[name]) != n:
            raise AttentionCaptureError(
                f"decoder relevance expected {n} {name} attention maps, recorded {len(records[name])}; "
                "the model's attention modules must each run once per forward pass (no key/value cache)"
            )


def _relevance_rows(records: dict[str, list[Tensor]], grads: dict[str, list[Tensor]], num_prefix_tokens: int,
                    items: Tensor, memory_to_patches: Callable[[Tensor], Tensor] | None = None,
                    rule: RelevanceRule = "full") -> Tensor:
    """Rows of ``R^qi`` (``[B, T]``, row ``items[b]`` of row ``b``) after the encoder and decoder.

    ``memory_to_patches`` maps a cross-attention ``[B, Q, M]`` over memory tokens that are not
    the patch tokens themselves (the DETR pyramid's) to ``[B, Q, N]`` over the patches; ``rule``:
    see :data:`RELEVANCE_RULES`."""
    if rule not in RELEVANCE_RULES:
        raise ConfigError(f"decoder relevance rule {rule!r} invalid; choose one of {', '.join(RELEVANCE_RULES)}")
    enc_a, enc_g = records["encoder"], grads["encoder"]
    b, t = enc_a[0].shape[0], enc_a[0].shape[-1]
    device = enc_a[0].device
    if rule == "full":
        # R = I + R̂ kept as R̂ (see normalize_residual): R += Ā R  <=>  R̂ += Ā + Ā R̂
        hat_ii = torch.zeros(b, t, t, device=device)
        for a, g in zip(enc_a, enc_g, strict=True):
            cam = square_rows(fuse_gradient_attention(a, g))  # (B, T, T): class attention's other rows zero
            hat_ii = hat_ii + cam + cam @ hat_ii  # eq. 6
        bar_ii_rows = normalize_residual(hat_ii)[:, num_prefix_tokens:]  # (B, N, T): the memory's rows
    else:  # each memory token stands for its own patch
        bar_ii_rows = torch.eye(t, device=device)[num_prefix_tokens:].expand(b, -1, -1)
    q = records["self"][0].shape[-1]
    hat_qq = torch.zeros(b, q, q, device=device)
    r_qi = torch.zeros(b, q, t, device=device)
    last = len(records["cross"]) - 1
    for k, (a_s, g_s, a_c, g_c) in enumerate(zip(records["self"], grads["self"], records["cross"], grads["cross"],
                                                  strict=True)):
        cam = fuse_gradient_attention(a_s, g_s)  # (B, Q, Q)
        hat_qq, r_qi = hat_qq + cam + cam @ hat_qq, r_qi + cam @ r_qi  # eqs. 6, 7
        if rule == "decoder_last" and k < last:
            continue
        cam_qi = fuse_gradient_attention(a_c, g_c)
        if memory_to_patches is not None:
            cam_qi = memory_to_patches(cam_qi)
        r_qi = r_qi + cross_attention_rule(hat_qq, cam_qi, bar_ii_rows)  # eq. 10
    return r_qi[torch.arange(b, device=device), items]  # (B, T)


def _to_maps(rows: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> Tensor:
    h, w = grid
    return normalize_maps(rows[:, num_prefix_tokens:].reshape(-1, h, w)).cpu()  # (B, h, w)


def _split(maps: Tensor, counts: list[int], grid: tuple[int, int]) -> list[Tensor]:
    if not counts:
        return []
    if maps.numel() == 0:
        return [maps.new_zeros(c, *grid) for c in counts]
    return list(maps.split(counts))


def _decoder_groups(task: nn.Module) -> dict[str, list[nn.Module]]:
    encoder_attn = [m for _, m in attention_modules(task.encoder)]
    if not encoder_attn:
        raise AttentionCaptureError(f"{type(task.encoder).__name__} has no capturable attention module")
    layers = list(task.head.layers)
    return {"encoder": encoder_attn, "self": [layer.self_attn for layer in layers],
            "cross": [layer.cross_attn for layer in layers]}


def _gradients(score: Tensor, records: dict[str, list[Tensor]]) -> dict[str, list[Tensor]]:
    names = list(records)
    flat = [a for n in names for a in records[n]]
    grads = torch.autograd.grad(score, flat, allow_unused=True)
    out, i = {}, 0
    for n in names:
        k = len(records[n])
        out[n] = [torch.zeros_like(a) if g is None else g for a, g in zip(flat[i : i + k], grads[i : i + k],
                                                                          strict=True)]
        i += k
    return {n: [g.detach() for g in gs] for n, gs in out.items()}


def _check_head(task: nn.Module, what: str) -> None:
    if getattr(task, "head", None) is None:
        raise ConfigError(f"{what}: the task has no head yet (build it from the data or load a checkpoint first)")


# ---------------------------------------------------------------------------- detection
def detection_rows(task: nn.Module, images: Tensor, queries: Sequence[Tensor], labels: Sequence[Tensor] | None,
                   what: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """The explained (image, query, class) rows of a batch of detections, checked: ``(image
    indices, query indices, classes (-1: the query's best), detections per image)``. ``what``
    names the caller in the errors."""
    if len(queries) != images.shape[0] or (labels is not None and len(labels) != images.shape[0]):
        raise ValueError(f"{what}: {images.shape[0]} images but {len(queries)} query lists"
                         + ("" if labels is None else f" and {len(labels)} label lists"))
    num_queries = task.head.num_queries
    image_idx, query_idx, label_idx = [], [], []
    for b, q in enumerate(queries):
        q = torch.as_tensor(q).long().flatten().cpu()
        if q.numel() and (int(q.min()) < 0 or int(q.max()) >= num_queries):
            raise ValueError(f"{what}: query index out of range 0..{num_queries - 1} for image {b}")
        lab = None if labels is None else torch.as_tensor(labels[b]).long().flatten().cpu()
        if lab is not None and lab.numel() != q.numel():
            raise ValueError(f"{what}: image {b} has {q.numel()} queries but {lab.numel()} labels")
        image_idx += [b] * q.numel()
        query_idx += q.tolist()
        label_idx += [-1] * q.numel() if lab is None else lab.tolist()
    return image_idx, query_idx, label_idx, [int(torch.as_tensor(q).numel()) for q in queries]


def detection_logits(logits: Tensor, queries: Tensor, classes: Tensor, focal: bool) -> tuple[Tensor, Tensor]:
    """``(per row the explained query's logits [R, C (+ 1)], the explained classes [R])`` from
    ``pred_logits [R, Q, C (+ 1)]``: a class ``-1`` becomes the query's most probable real class."""
    per_query = logits[torch.arange(len(queries), device=logits.device), queries].float()  # (R, C [+ 1])
    real = per_query if focal else per_query[:, :-1]
    return per_query, torch.where(classes < 0, real.detach().argmax(-1), classes)


def caption_rows(task: nn.Module, images: Tensor, tokens: Sequence[Tensor] | Tensor,
                 what: str) -> tuple[Tensor, list[int], list[int], list[int]]:
    """The explained (image, word) rows of a batch of captions, checked: ``(teacher-forced ids
    [B, 1 + T]: <bos> w_0 .. w_{T-1}, padded; image indices; word positions; words per image)``."""
    if len(tokens) != images.shape[0]:
        raise ValueError(f"{what}: {images.shape[0]} images but {len(tokens)} token sequences")
    seqs = [torch.as_tensor(t).long().flatten().cpu() for t in tokens]
    longest = max((len(s) for s in seqs), default=0)
    if longest > task.head.max_length:
        raise ValueError(f"{what}: a caption of {longest} words does not fit the decoder's "
                         f"max_length {task.head.max_length} (with <bos>)")
    full = torch.full((len(seqs), longest + 1), task.head.pad_id, dtype=torch.long)
    full[:, 0] = task.tokenizer.bos_id
    image_idx, word_idx = [], []
    for b, s in enumerate(seqs):
        full[b, 1 : len(s) + 1] = s
        image_idx += [b] * len(s)
        word_idx += list(range(len(s)))
    return full, image_idx, word_idx, [len(s) for s in seqs]


def _item_maps(target: Tensor, records: dict, num_prefix_tokens: int, rows: Tensor,
               grid: tuple[int, int], memory_to_patches: Callable[[Tensor], Tensor] | None = None,
               rule: RelevanceRule = "full") -> Tensor:
    """The explained rows' patch maps: gradients of the summed ``target`` scores w.r.t. the
    recorded attentions, propagated by the rules (:func:`_relevance_rows`)."""
    grads = _gradients(target, records)
    relevance = _relevance_rows({k: [a.detach() for a in v] for k, v in records.items()}, grads,
                                num_prefix_tokens, rows, memory_to_patches, rule)
    return _to_maps(relevance, grid, num_prefix_tokens)


def detection_relevance(
    task: nn.Module,
    images: Tensor,
    queries: Sequence[Tensor],
    labels: Sequence[Tensor] | None = None,
    score: DetectionScore = "logit",
    max_rows: int = 64,
    rule: RelevanceRule = "full",
) -> list[Tensor]:
    """Relevance maps of detections over the patch grid, one ``[K_b, h, w]`` tensor per image.

    Args:
        task: a :class:`~vision_attn.tasks.DetectionTask` (``encoder`` and a DETR ``head``).
        images: ``[B, 3, H, W]`` normalised model inputs.
        queries: per image ``[K_b]`` query indices (``post_process(...)["queries"]``, e.g. of
            the kept detections); ``K_b = 0`` gives an empty ``[0, h, w]``.
        labels: per image ``[K_b]`` class indices ``0 .. C-1`` (``post_process(...)["labels"]``;
            a focal head's query may carry several classes). Default: each query's most
            probable real class.
        score: what is explained: ``logit`` (the class logit, as the authors' DETR code) or
            ``probability`` (softmax without renormalisation over real classes — the
            detection's score — or the focal head's sigmoid).
        max_rows: most (image, detection) rows per forward/backward pass.
        rule: which relevance (:data:`RELEVANCE_RULES`).

    Returns:
        Per image ``[K_b, h, w]`` float32 maps on the CPU, each scaled to maximum 1.
    """
    _check_head(task, "detection_relevance")
    if score not in ("logit", "probability"):
        raise ConfigError(f"detection_relevance: score must be 'logit' or 'probability', got {score!r}")
    image_idx, query_idx, label_idx, counts = detection_rows(task, images, queries, labels, "detection_relevance")
    grid = task.encoder.grid_for(*images.shape[-2:])
    focal = bool(getattr(task.head, "focal", False))
    # cross-attention over the pyramid's tokens: carried to the patches (see the module docstring)
    to_patches = partial(task.head.cross_attn_to_patches, grid=grid) if getattr(task.head, "pyramid", False) else None
    groups = _decoder_groups(task)
    maps = []
    with _explaining(task):
        for start in range(0, len(image_idx), max_rows):
            rows = slice(start, start + max_rows)
            b_idx = torch.tensor(image_idx[rows], device=images.device)
            q_idx = torch.tensor(query_idx[rows], device=images.device)
            c_idx = torch.tensor(label_idx[rows], device=images.device)
            x = images.detach().clone()[b_idx]  # (R, 3, H, W): one row per explained detection
            with _record(groups) as records:
                enc = _encode(task.encoder, x)
                logits = task.head(enc)["pred_logits"]  # (R, Q, C [+ 1])
            _expect(records, {"encoder": len(groups["encoder"]), "self": len(groups["self"]),
                              "cross": len(groups["cross"])})
            per_query, c_idx = detection_logits(logits, q_idx, c_idx, focal)
            if score == "probability":
                per_query = per_query.sigmoid() if focal else per_query.softmax(-1)
            target = per_query.gather(1, c_idx[:, None]).sum()
            maps.append(_item_maps(target, records, enc.num_prefix_tokens, q_idx, grid, to_patches, rule))
    flat = torch.cat(maps) if maps else torch.zeros(0, *grid)
    return _split(flat, counts, grid)


# ---------------------------------------------------------------------------- captioning
def caption_relevance(
    task: nn.Module,
    images: Tensor,
    tokens: Sequence[Tensor] | Tensor,
    max_rows: int = 64,
    rule: RelevanceRule = "full",
) -> list[Tensor]:
    """Relevance maps of generated words over the patch grid, one ``[T_b, h, w]`` per image.

    The caption is teacher-forced: word ``t`` of image ``b`` is explained by its
    log-probability ``log softmax(logits)[tokens[b][t]]`` given ``<bos>`` and the words before it
    (what the search scored when it chose the word).

    Args:
        task: a :class:`~vision_attn.tasks.CaptioningTask` (``encoder``, ``head``, ``tokenizer``).
        images: ``[B, 3, H, W]`` normalised model inputs.
        tokens: per image ``[T_b]`` generated ids without ``<bos>`` — every id is explained, so
            pass the words only (``Generation.tokens[b][:len(words)]``; add the ``<eos>`` to
            explain it too). A ``[B, T]`` tensor is read as ``B`` rows of ``T`` words.
        max_rows: most (image, word) rows per forward/backward pass.
        rule: which relevance (:data:`RELEVANCE_RULES`).

    Returns:
        Per image ``[T_b, h, w]`` float32 maps on the CPU, each scaled to maximum 1.
    """
    _check_head(task, "caption_relevance")
    full, image_idx, word_idx, counts = caption_rows(task, images, tokens, "caption_relevance")
    grid = task.encoder.grid_for(*images.shape[-2:])
    groups = _decoder_groups(task)
    maps = []
    with _explaining(task):
        for start in range(0, len(image_idx), max_rows):
            rows = slice(start, start + max_rows)
            b_idx = torch.tensor(image_idx[rows])
            t_idx = torch.tensor(word_idx[rows], device=images.device)
            inp = full[b_idx, :-1].to(images.device)  # (R, longest): later positions cannot matter (causal)
            tgt = full[b_idx, 1:].to(images.device)
            x = images.detach().clone()[b_idx.to(images.device)]  # (R, 3, H, W)
            with _record(groups) as records:
                enc = _encode(task.encoder, x)
                logits, _ = task.head(enc, inp)  # (R, longest, V)
            _expect(records, {"encoder": len(groups["encoder"]), "self": len(groups["self"]),
                              "cross": len(groups["cross"])})
            r = torch.arange(len(t_idx), device=logits.device)
            logp = F.log_softmax(logits[r, t_idx].float(), dim=-1)  # (R, V)
            target = logp.gather(1, tgt[r, t_idx][:, None]).sum()
            maps.append(_item_maps(target, records, enc.num_prefix_tokens, t_idx, grid, rule=rule))
    flat = torch.cat(maps) if maps else torch.zeros(0, *grid)
    return _split(flat, counts, grid)
