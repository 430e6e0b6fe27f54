"""Small-data techniques (vision_attn.models.smalldata): shifted patch tokenization against a
hand-computed case and a slow reference, locality self-attention against timm's Attention and a
reference written from the paper's equation, sequence pooling against a manual computation,
and the suite's machinery around them (attention capture, explanations, AttnLRP, weights files,
checkpoints)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.layers import Attention

from vision_attn import create_encoder, load_task
from vision_attn.data.loading import Batching
from vision_attn.errors import EncoderError
from vision_attn.explain.capture import capture_attention
from vision_attn.explain.lrp import relevance_budget
from vision_attn.explain.methods import explain_classifier, explained_token
from vision_attn.explain.rollout import attention_rollout, last_layer_attention, normalize_maps
from vision_attn.models import ClassificationHead, EncoderOutput
from vision_attn.models.classifier import ClassifierConfig
from vision_attn.models.smalldata import (
    LSA_TEMPERATURE_KEY,
    LocalitySelfAttention,
    LocalMlp,
    SequencePooling,
    ShiftedPatchTokenizer,
    apply_locality_self_attention,
    shift_image,
)
from vision_attn.tasks import ClassificationTask
from vision_attn.tasks.optim import no_weight_decay_names

from .conftest import TINY_VIT


def _encoder(seed: int = 0, **kw):
    torch.manual_seed(seed)
    return create_encoder("vit_tiny_patch16_224", **{**TINY_VIT, **kw}).eval()


def _images(n: int = 2, size: tuple[int, int] = (32, 32), seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, *size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- SPT
def test_shift_image_by_hand():
    x = torch.arange(1.0, 10.0).view(1, 1, 3, 3)  # [[1 2 3] [4 5 6] [7 8 9]]
    assert shift_image(x, 1, 1)[0, 0].tolist() == [[0, 0, 0], [0, 1, 2], [0, 4, 5]]  # down-right
    assert shift_image(x, -1, -1)[0, 0].tolist() == [[5, 6, 0], [8, 9, 0], [0, 0, 0]]  # up-left
    assert shift_image(x, -1, 1)[0, 0].tolist() == [[0, 4, 5], [0, 7, 8], [0, 0, 0]]  # up-right
    assert shift_image(x, 1, -1)[0, 0].tolist() == [[0, 0, 0], [2, 3, 0], [5, 6, 0]]  # down-left


def test_spt_stack_of_a_tiny_image_by_hand():
    """Patch 2 -> shift 1: the image, then its up-left, up-right, down-left, down-right copies."""
    spt = ShiftedPatchTokenizer(patch_size=2, embed_dim=4, in_chans=1)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 1, 2, 2)
    stack = spt.shifted_stack(x)[0]  # (5, 2, 2)
    expected = [
        [[1, 2], [3, 4]],  # the image
        [[4, 0], [0, 0]],  # up-left: out[i, j] = x[i + 1, j + 1]
        [[0, 3], [0, 0]],  # up-right: out[i, j] = x[i + 1, j - 1]
        [[0, 0], [2, 0]],  # down-left: out[i, j] = x[i - 1, j + 1]
        [[0, 0], [0, 1]],  # down-right: out[i, j] = x[i - 1, j - 1]
    ]
    assert stack.tolist() == expected


def _spt_reference(spt: ShiftedPatchTokenizer, x: torch.Tensor) -> torch.Tensor:
    """Slow SPT from the paper's description: zero-pad by the shift, slice each diagonal shift out,
    then for every patch flatten channel by channel, LayerNorm, Linear. ``[B, D, h, w]``."""
    p, s = spt.patch_size, spt.shift
    b, c, height, width = x.shape
    padded = F.pad(x, (s, s, s, s))
    shifts = [(0, 0), (-s, -s), (-s, s), (s, -s), (s, s)]  # (dy, dx): content moves by (dy, dx)
    copies = [padded[:, :, s - dy : s - dy + height, s - dx : s - dx + width] for dy, dx in shifts]
    stack = torch.cat(copies, dim=1)  # (B, 5C, H, W)
    h, w = height // p, width // p
    out = torch.zeros(b, spt.linear.out_features, h, w)
    for i in range(h):
        for j in range(w):
            vec = stack[:, :, i * p : (i + 1) * p, j * p : (j + 1) * p].reshape(b, -1)  # channel-major
            vec = F.layer_norm(vec, vec.shape[-1:], spt.norm.weight, spt.norm.bias, spt.norm.eps)
            out[:, :, i, j] = F.linear(vec, spt.linear.weight, spt.linear.bias)
    return out


def test_spt_matches_a_slow_reference():
    torch.manual_seed(0)
    spt = ShiftedPatchTokenizer(patch_size=4, embed_dim=8)
    with torch.no_grad():
        spt.norm.weight.normal_(), spt.norm.bias.normal_()  # not the identity: the test sees the norm
    x = torch.randn(2, 3, 8, 12)
    with torch.no_grad():
        assert torch.allclose(spt(x), _spt_reference(spt, x), atol=1e-5)


@pytest.mark.parametrize("size", [(32, 32), (24, 40)])
def test_spt_stem_keeps_the_linear_stems_token_grid(size):
    x = _images(size=size)
    linear, spt = _encoder(stem="patch"), _encoder(stem="spt")
    with torch.no_grad():
        a, b = linear(x), spt(x)
    assert a.grid == b.grid == (size[0] // 8, size[1] // 8)
    assert a.tokens.shape == b.tokens.shape == (2, 1 + size[0] // 8 * size[1] // 8, 32)
    assert isinstance(spt.model.patch_embed.proj, ShiftedPatchTokenizer) and spt.stem == "spt"
    with pytest.raises(ValueError, match="patch_size >= 2"):
        ShiftedPatchTokenizer(patch_size=1, embed_dim=8)
    with pytest.raises(ValueError, match="'patch', 'conv', 'cnn' or 'spt'"):
        _encoder(stem="shifted")


# ---------------------------------------------------------------------------- LSA
def _timm_attention(fused: bool, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(16, num_heads=2, qkv_bias=True).eval()
    with torch.no_grad():
        attn.qkv.weight.mul_(4.0)  # peaked attention: the diagonal matters
    attn.fused_attn = fused
    return attn


@pytest.mark.parametrize("fused", [False, True])
def test_lsa_without_mask_at_initial_temperature_is_timms_attention(fused):
    timm_attn = _timm_attention(fused)
    lsa = LocalitySelfAttention.from_attention(timm_attn, mask_diagonal=False)
    assert lsa.fused_attn == fused and lsa is not timm_attn
    assert torch.equal(lsa.qkv.weight, timm_attn.qkv.weight) and torch.equal(lsa.proj.bias, timm_attn.proj.bias)
    assert lsa.temperature.item() == pytest.approx(8 ** -0.5, rel=1e-7)  # head_dim 8
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        assert torch.allclose(lsa(x), timm_attn(x), atol=1e-6, rtol=0)
        lsa.mask_diagonal = True
        assert (lsa(x) - timm_attn(x)).abs().max() > 1e-3  # the mask does change the output


def _lsa_reference(attn: LocalitySelfAttention, x: torch.Tensor) -> torch.Tensor:
    """``softmax(T q kᵀ, diagonal -> -inf) v`` per head, then the output projection."""
    b, n, d = x.shape
    heads, hd = attn.num_heads, attn.head_dim
    q, k, v = F.linear(x, attn.qkv.weight, attn.qkv.bias).split(d, dim=-1)
    out = []
    for h in range(heads):
        qh, kh, vh = (t[..., h * hd : (h + 1) * hd] for t in (q, k, v))
        scores = attn.temperature * qh @ kh.transpose(1, 2)  # (B, N, N)
        scores = scores.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf"))
        out.append(scores.softmax(-1) @ vh)
    return F.linear(torch.cat(out, dim=-1), attn.proj.weight, attn.proj.bias)


def test_lsa_fused_and_explicit_paths_equal_the_reference():
    lsa = LocalitySelfAttention.from_attention(_timm_attention(fused=True))
    with torch.no_grad():
        getattr(lsa, LSA_TEMPERATURE_KEY).fill_(0.7)  # a learned temperature, not the initial one
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _lsa_reference(lsa, x)
        fused = lsa(x)
        lsa.fused_attn = False
        explicit = lsa(x)
    # float32 kernels round differently between CPUs (a few units in the last place); a wrong mask
    # or temperature moves the outputs by tenths
    assert torch.allclose(fused, explicit, atol=1e-5, rtol=0)
    assert torch.allclose(explicit, ref, atol=1e-5, rtol=0)


def test_lsa_temperature_is_a_positive_trainable_parameter_without_weight_decay():
    enc = _encoder(lsa=True)
    names = [n for n, _ in enc.named_parameters() if n.endswith(LSA_TEMPERATURE_KEY)]
    assert names == [f"model.blocks.{i}.attn.{LSA_TEMPERATURE_KEY}" for i in range(2)]
    attn = enc.model.blocks[0].attn
    assert attn.temperature.item() == pytest.approx(attn.head_dim ** -0.5, rel=1e-7)
    enc.train()
    enc(_images()).tokens.square().mean().backward()
    gain = getattr(attn, LSA_TEMPERATURE_KEY)
    assert gain.requires_grad and gain.grad is not None and gain.grad.abs().item() > 0
    with torch.no_grad():
        gain.fill_(-50.0)  # the parameterisation keeps it positive however far it goes
    assert attn.temperature.item() > 0
    assert set(names) <= no_weight_decay_names(enc)  # a scalar: not decayed (it would pull T to 1)


def test_lsa_swap_keeps_the_trained_weights():
    plain = _encoder()
    swapped = _encoder(seed=1)  # other random weights...
    swapped.model.load_state_dict(plain.model.state_dict())  # ...replaced by plain's
    assert apply_locality_self_attention(swapped.model, mask_diagonal=False) == 2
    x = _images()
    with torch.no_grad():
        assert torch.allclose(swapped(x).tokens, plain(x).tokens, atol=1e-6, rtol=0)
    with pytest.raises(EncoderError, match="timm's ViT Attention"):
        LocalitySelfAttention.from_attention(torch.nn.MultiheadAttention(16, 2))


def test_captured_lsa_attention_has_a_zero_diagonal_and_is_the_modules_softmax():
    enc = _encoder(lsa=True)
    block_inputs: list[torch.Tensor] = []
    hook = enc.model.blocks[0].attn.register_forward_pre_hook(lambda _m, args: block_inputs.append(args[0]))
    try:
        with torch.no_grad(), capture_attention(enc) as attn:
            enc(_images())
    finally:
        hook.remove()
    assert len(attn) == 2 and attn[0].shape == (2, 2, 17, 17)
    assert enc.model.blocks[0].attn.fused_attn  # restored after the capture
    for a in attn:
        assert torch.equal(a.diagonal(dim1=-2, dim2=-1), torch.zeros(2, 2, 17))
        assert torch.allclose(a.sum(-1), torch.ones(2, 2, 17), atol=1e-6)
    # block 0's recorded probabilities are softmax(T q kᵀ, no diagonal), computed here by hand
    m, x = enc.model.blocks[0].attn, block_inputs[0]
    q, k, _ = F.linear(x, m.qkv.weight, m.qkv.bias).split(32, dim=-1)
    q, k = (t.view(2, 17, 2, 16).transpose(1, 2) for t in (q, k))  # (B, heads, T, d)
    scores = (m.temperature * q @ k.transpose(-2, -1)).masked_fill(torch.eye(17, dtype=torch.bool), float("-inf"))
    assert torch.allclose(attn[0], scores.softmax(-1), atol=1e-6)


def _task(pooling: str = "cls", **encoder_kw) -> ClassificationTask:
    torch.manual_seed(0)
    return ClassificationTask(create_encoder("vit_tiny_patch16_224", **{**TINY_VIT, **encoder_kw}), num_classes=3,
                              head=ClassifierConfig(pooling=pooling)).eval()


def test_lrp_conserves_relevance_with_spt_and_lsa():
    """AttnLRP's rules reach the LSA module (a timm Attention) and SPT's LayerNorm: the explained
    logits are conserved exactly as for a plain ViT."""
    task = _task(stem="spt", lsa=True).double()
    with torch.no_grad():
        for blk in task.encoder.model.blocks:
            getattr(blk.attn, LSA_TEMPERATURE_KEY).fill_(0.3)
    budget = relevance_budget(task, _images().double())
    assert budget["total"] == pytest.approx(budget["score"], rel=1e-9)
    assert abs(budget["pixels"]) > 1e-3 * abs(budget["score"])


def test_lrp_conserves_relevance_through_sequence_pooling():
    """Sequence pooling is a one-query attention for AttnLRP: its softmax's share is in the
    ledger and the product w x gets the uniform rule, so the logits are still conserved."""
    task = _task("seq").double()
    with torch.no_grad():
        task.head.seq_pool.score.weight.normal_(std=1.0)  # far from uniform weights
    budget = relevance_budget(task, _images().double())
    assert budget["total"] == pytest.approx(budget["score"], rel=1e-9)
    assert abs(budget["softmax"]) > 1e-3 * abs(budget["score"])  # the pooling softmax keeps a share


# ---------------------------------------------------------------------------- weights and checkpoints
def test_weights_files_of_spt_and_lsa_encoders_load_and_mismatches_are_clear(tmp_path, caplog):
    src = _encoder(stem="spt", lsa=True)
    with torch.no_grad():
        for blk in src.model.blocks:
            getattr(blk.attn, LSA_TEMPERATURE_KEY).fill_(0.25)
    path = tmp_path / "spt_lsa.safetensors"
    save_file({k: v.contiguous() for k, v in src.model.state_dict().items()}, str(path))
    loaded = _encoder(seed=5, stem="spt", lsa=True, weights_file=str(path))
    x = _images()
    with torch.no_grad():
        assert torch.equal(loaded(x).tokens, src(x).tokens)
    with pytest.raises(EncoderError, match="lsa=True"):
        _encoder(stem="spt", weights_file=str(path))
    with pytest.raises(EncoderError, match="stem='conv', 'cnn' or 'spt'"):
        _encoder(lsa=True, weights_file=str(path))

    plain = tmp_path / "plain.safetensors"
    save_file({k: v.contiguous() for k, v in _encoder().model.state_dict().items()}, str(plain))
    for stem in ("spt", "conv"):
        with pytest.raises(EncoderError, match=rf"stem='{stem}'.*stem='patch'"):
            _encoder(stem=stem, weights_file=str(plain))
    lsa = _encoder(seed=5, lsa=True, weights_file=str(plain))  # a plain ViT's weights: temperatures at init
    assert torch.equal(lsa.model.blocks[1].attn.qkv.weight, _encoder().model.blocks[1].attn.qkv.weight)
    assert getattr(lsa.model.blocks[1].attn, LSA_TEMPERATURE_KEY).item() == 0.0


def test_checkpoint_roundtrip_rebuilds_spt_lsa_and_seq_pooling(shapes_root, tmp_path):
    from vision_attn.data.classification import ImageFolderDataModule

    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", stem="spt", lsa=True, **TINY_VIT)
    task = ClassificationTask(enc, head=ClassifierConfig(pooling="seq"))
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(task, datamodule=dm)
    gain = getattr(task.encoder.model.blocks[0].attn, LSA_TEMPERATURE_KEY).item()
    assert gain != 0.0  # trained: the temperature moved
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    stored = torch.load(path, weights_only=False)["vision_attn"]["model"]["init_args"]
    assert stored["encoder"]["init_args"]["stem"] == "spt" and stored["encoder"]["init_args"]["lsa"] is True
    assert stored["head"]["pooling"] == "seq"
    loaded = load_task(path, expected_task="classification").eval()
    assert isinstance(loaded.encoder.model.blocks[1].attn, LocalitySelfAttention)
    assert isinstance(loaded.encoder.model.patch_embed.proj, ShiftedPatchTokenizer)
    assert isinstance(loaded.head.seq_pool, SequencePooling)
    assert getattr(loaded.encoder.model.blocks[0].attn, LSA_TEMPERATURE_KEY).item() == gain
    x = _images()
    task.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), task(x))


# ---------------------------------------------------------------------------- sequence pooling
@pytest.mark.parametrize("prefix", [0, 1, 5])
def test_seq_pooling_against_a_manual_computation(prefix):
    torch.manual_seed(0)
    tokens = torch.randn(2, prefix + 6, 8)
    out = EncoderOutput(tokens, prefix, (2, 3))
    head = ClassificationHead(8, 3, pooling="seq")
    u, c = head.seq_pool.score.weight[0], head.seq_pool.score.bias[0]
    patches = tokens[:, prefix:]
    manual = torch.zeros(2, 8)
    for b in range(2):
        scores = torch.stack([patches[b, i] @ u + c for i in range(6)])
        w = scores.exp() / scores.exp().sum()
        manual[b] = sum(w[i] * patches[b, i] for i in range(6))
    assert torch.allclose(head.pool(out), manual, atol=1e-6)
    weights = head.token_weights(out)
    assert weights.shape == (2, prefix + 6) and torch.equal(weights[:, :prefix], torch.zeros(2, prefix))
    assert torch.allclose(weights.sum(1), torch.ones(2)) and torch.allclose(weights[:, None] @ tokens,
                                                                             manual[:, None], atol=1e-6)
    with pytest.raises(ValueError, match="auto, cls, mean, seq"):
        ClassificationHead(8, 3, pooling="attention")


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_token_weights_of_the_other_poolings_give_their_pool(pooling):
    tokens = torch.randn(2, 1 + 4, 8)
    out = EncoderOutput(tokens, 1, (2, 2))
    head = ClassificationHead(8, 3, pooling=pooling)
    assert torch.allclose((head.token_weights(out)[:, None] @ tokens)[:, 0], head.pool(out), atol=1e-6)


def test_seq_row_is_the_pooling_weights_mixture_of_rows_by_hand():
    """One block, one head, T = 3 (no prefix): the explained row is w @ A (attention) and
    w @ (A + I) / 2 (rollout), with w the pooling weights."""
    a = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.2, 0.2, 0.6]]).view(1, 1, 3, 3)
    w = torch.tensor([[0.5, 0.0, 0.5]])
    row = torch.tensor([[0.35, 0.225, 0.425]])  # 0.5 * row 0 + 0.5 * row 2
    assert torch.allclose(last_layer_attention([a], (1, 3), 0, token_index=w), normalize_maps(row.view(1, 1, 3)))
    rollout_row = (row + w) / 2  # rows of (A + I) sum to 2
    assert torch.allclose(attention_rollout([a], (1, 3), 0, token_index=w), normalize_maps(rollout_row.view(1, 1, 3)))
    uniform = attention_rollout([a], (1, 3), 0, token_index="patches")
    assert not torch.allclose(uniform, normalize_maps(rollout_row.view(1, 1, 3)))  # not the mean's row


@pytest.mark.parametrize("class_token", [True, False])
def test_explanations_of_a_seq_pooled_model(class_token):
    kw = {} if class_token else {"class_token": False, "global_pool": "avg"}  # CCT: no class token
    task = _task("seq", stem="spt", lsa=True, **kw)
    x = _images(3)
    methods = ("rollout", "attention", "relevance", "gradcam", "lrp")
    expl = explain_classifier(task, x, methods)
    p = 1 if class_token else 0
    assert expl.num_prefix_tokens == p
    with torch.no_grad():
        out = task.encoder(x)
    assert torch.allclose(expl.token_index, task.head.token_weights(out), atol=1e-6)
    assert torch.allclose(explained_token(task.head, p, out), task.head.token_weights(out))
    for method in methods:
        m = expl.maps[method]
        assert m.shape == (3, 4, 4) and torch.isfinite(m).all() and float(m.amax()) == 1.0, method
    # the attention map is the pooling weights' mixture of the last block's head-mean rows
    manual = torch.einsum("bt,btu->bu", expl.token_index, expl.attentions[-1].mean(1))
    assert torch.allclose(expl.maps["attention"], normalize_maps(manual[:, p:].reshape(3, 4, 4)), atol=1e-6)
    with pytest.raises(ValueError, match="pass the encoder output"):
        explained_token(task.head, p)


# ---------------------------------------------------------------------------- local feed-forward
def _local_reference(mlp: LocalMlp, x: torch.Tensor, grid: tuple[int, int], valid=None) -> torch.Tensor:
    """LocalMlp written out cell by cell: fc1, then per patch cell the sum over its 3x3
    neighbourhood (cells outside the grid, or padded, count as zero) of the kernel tap times the
    neighbour, plus the bias; the prefix tokens skip it; then the activation and fc2."""
    p = mlp.num_prefix_tokens
    h = mlp.fc1(x)
    gh, gw = grid
    w = mlp.dwconv.weight[:, 0]  # (C, 3, 3)
    cells = h[:, p:].reshape(h.shape[0], gh, gw, -1)
    if valid is not None:
        cells = cells * valid[..., None]
    out = torch.zeros_like(cells)
    for i in range(gh):
        for j in range(gw):
            acc = mlp.dwconv.bias.expand(h.shape[0], -1).clone()
            for di in (-1, 0, 1):
                for dj in (-1, 0, 1):
                    if 0 <= i + di < gh and 0 <= j + dj < gw:
                        acc = acc + cells[:, i + di, j + dj] * w[:, di + 1, dj + 1]
            out[:, i, j] = acc
    h = torch.cat([h[:, :p], out.reshape(h.shape[0], gh * gw, -1)], dim=1)
    return mlp.fc2(mlp.act(h))


def test_local_mlp_equals_a_cell_by_cell_reference_and_the_prefix_skips_the_convolution():
    enc = _encoder(local_mlp=True)
    mlp = enc.model.blocks[0].mlp
    assert isinstance(mlp, LocalMlp) and enc.model.num_prefix_tokens == 1
    with torch.no_grad():
        mlp.dwconv.weight.normal_()
        mlp.dwconv.bias.normal_()
    x = torch.randn(2, 1 + 3 * 5, 32, dtype=torch.float64)
    mlp.double()
    mlp.grid, mlp.valid = (3, 5), None
    torch.testing.assert_close(mlp(x), _local_reference(mlp, x, (3, 5)), rtol=1e-12, atol=1e-12)
    valid = torch.zeros(2, 3, 5, dtype=torch.float64)
    valid[0, :2, :4] = 1
    valid[1] = 1
    mlp.valid = valid.bool()
    torch.testing.assert_close(mlp(x), _local_reference(mlp, x, (3, 5), valid), rtol=1e-12, atol=1e-12)
    # the class token goes through fc1 -> act -> fc2 only; a patch token's output changes with its neighbours
    plain = mlp.fc2(mlp.act(mlp.fc1(x[:, :1])))
    torch.testing.assert_close(mlp(x)[:, :1], plain, rtol=1e-12, atol=1e-12)
    y = x.clone()
    y[:, 1 + 2] += 1.0  # cell (0, 2): its neighbour (1, 3) changes, the far cell (2, 0) does not
    mlp.valid = None
    d = (mlp(y) - mlp(x)).abs().sum(-1)
    assert d[0, 1 + 1 * 5 + 3] > 1e-6 and d[0, 1 + 2 * 5 + 0] == 0


def test_local_mlp_encoder_gives_a_padded_image_its_own_tokens():
    """A padded batch (images of different sizes): a real token of the small image is what the
    image alone gives, because padded cells enter the convolution as zeros."""
    enc = _encoder(local_mlp=True)
    small, big = _images(1, (16, 24), seed=3), _images(1, (32, 32), seed=4)
    batch = torch.zeros(2, 3, 32, 32)
    batch[0, :, :16, :24], batch[1] = small[0], big[0]
    with torch.no_grad():
        out = enc(batch, image_sizes=torch.tensor([[16, 24], [32, 32]]))
        alone = enc(small).tokens[0, 1:]
        big_alone = enc(big).tokens[0]
    real = out.tokens[0, 1:].reshape(4, 4, -1)[:2, :3].reshape(6, -1)
    torch.testing.assert_close(real, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.tokens[1], big_alone, rtol=0, atol=1e-5)
    # without the mask the padding would leak in: the check above can fail
    enc.model.blocks[0].mlp.valid = None
    enc._set_local_grid = lambda grid, valid: [setattr(b.mlp, "grid", grid) for b in enc.model.blocks]
    with torch.no_grad():
        leaky = enc(batch, image_sizes=torch.tensor([[16, 24], [32, 32]])).tokens[0, 1:].reshape(4, 4, -1)[:2, :3]
    assert (leaky.reshape(6, -1) - alone).abs().max() > 1e-3


def test_local_mlp_weights_checkpoints_lrp_and_merging(shapes_root, tmp_path):
    from vision_attn.models.merging import merge_tokens

    src = _encoder(local_mlp=True)
    path = tmp_path / "local.safetensors"
    save_file({k: v.contiguous() for k, v in src.model.state_dict().items()}, str(path))
    loaded = _encoder(seed=5, local_mlp=True, weights_file=str(path))
    x = _images()
    with torch.no_grad():
        assert torch.equal(loaded(x).tokens, src(x).tokens)
    with pytest.raises(EncoderError, match="local_mlp=True too"):
        _encoder(weights_file=str(path))
    plain = tmp_path / "plain.safetensors"
    save_file({k: v.contiguous() for k, v in _encoder().model.state_dict().items()}, str(plain))
    with pytest.raises(EncoderError, match="local_mlp=False to use"):
        _encoder(local_mlp=True, weights_file=str(plain))
    with pytest.raises(EncoderError, match="token merging cannot run with local_mlp"):
        merge_tokens(_encoder(local_mlp=True), 2)

    task = _task(local_mlp=True).double()
    budget = relevance_budget(task, _images().double())
    assert budget["total"] == pytest.approx(budget["score"], rel=1e-9)

    from vision_attn.data.classification import ImageFolderDataModule

    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", local_mlp=True, **TINY_VIT))
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    before = task.encoder.model.blocks[0].mlp.dwconv.weight.detach().clone()
    trainer.fit(task, datamodule=dm)
    assert not torch.equal(before, task.encoder.model.blocks[0].mlp.dwconv.weight)  # trained
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    rebuilt = load_task(tmp_path / "m.ckpt", expected_task="classification").eval()
    assert isinstance(rebuilt.encoder.model.blocks[1].mlp, LocalMlp)
    task.eval()
    with torch.no_grad():
        assert torch.equal(rebuilt(x), task(x))
