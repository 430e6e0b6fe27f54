"""Caption decoder: each word cross-attends over the image's patch tokens ("Show, Attend and Tell"
with a transformer decoder).

- Input: the encoder's patch tokens (prefix tokens such as CLS dropped: the image *regions*),
  projected to the decoder width, with a 2-D sine position embedding added to the keys.
- Words: token embedding + learned position embedding, ``num_layers`` of
  :class:`~vision_attn.models.layers.DecoderLayer` (causal self-attention, cross-attention,
  feed-forward; the layer the DETR head uses), final norm, output projection tied to the
  token embedding.
- :meth:`CaptionDecoder.forward`: teacher forcing, logits ``[B, T, V]``.
- :meth:`CaptionDecoder.generate`: greedy or beam search with the key/value cache, batched;
  returns the token ids, their scores and, on request, every generated token's
  cross-attention over the patches (of the chosen beam).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.models.encoder import EncoderOutput
from vision_attn.models.layers import DecoderLayer, LayerCache, sine_position_embedding_2d

__all__ = ["CaptionDecoder", "Generation", "GenerationOptions"]


@dataclass
class GenerationOptions:
    """How captions are generated (``--generate.*`` of ``eval.py``; ``None`` = the model's own setting).

    Args:
        beam_size: 1 = greedy search; more = beam search.
        length_penalty: beam hypotheses are ranked by ``log p / length ** length_penalty``
            (0 = raw log-probability, favouring short captions; 1 = per-word average).
        max_length: most tokens generated (``<eos>`` included).
    """

    beam_size: int | None = None
    length_penalty: float | None = None
    max_length: int | None = None


@dataclass
class Generation:
    """Output of :meth:`CaptionDecoder.generate` for ``B`` images.

    Attributes:
        tokens: ``[B, T]`` generated ids (no ``<bos>``); after ``<eos>`` padded with ``pad_id``.
        lengths: ``[B]`` tokens up to and including ``<eos>`` (``T`` when it never came).
        scores: ``[B]`` sum of the tokens' log-probabilities.
        attention: ``[B, T, L, N]`` per generated token and decoder layer, the cross-attention
            over the ``N`` patches, averaged over heads (``None`` unless requested). Entry
            ``t`` is the attention of the step that *produced* token ``t``.
    """

    tokens: Tensor
    lengths: Tensor
    scores: Tensor
    attention: Tensor | None = None


class CaptionDecoder(nn.Module):
    """Transformer caption decoder over patch tokens.

    Args:
        vocab_size: ``V`` (the tokenizer's length).
        in_dim: width of the encoder tokens.
        hidden_dim: decoder width.
        num_layers: decoder layers.
        num_heads: attention heads.
        mlp_ratio: feed-forward width relative to ``hidden_dim``.
        dropout: dropout in the decoder and on the embeddings.
        max_length: longest token sequence (position embeddings).
        pad_id: id of ``<pad>`` (its embedding stays zero).
    """

    def __init__(
        self,
        vocab_size: int,
        in_dim: int,
        hidden_dim: int = 256,
        num_layers: int = 3,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        dropout: float = 0.1,
        max_length: int = 32,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        if hidden_dim % 4:
            raise ValueError(f"hidden_dim must be divisible by 4, got {hidden_dim}")
        self.vocab_size, self.hidden_dim, self.max_length, self.pad_id = vocab_size, hidden_dim, max_length, pad_id
        self.input_proj = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.LayerNorm(hidden_dim))
        self.embed = nn.Embedding(vocab_size, hidden_dim, padding_idx=pad_id)
        self.pos = nn.Parameter(torch.zeros(max_length, hidden_dim))
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(DecoderLayer(hidden_dim, num_heads, mlp_ratio, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_dim)
        self.out_bias = nn.Parameter(torch.zeros(vocab_size))  # the output weight is the embedding (tied)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        with torch.no_grad():
            self.embed.weight[pad_id].zero_()

    # ------------------------------------------------------------------ pieces
    def encode_memory(self, enc: EncoderOutput) -> tuple[Tensor, Tensor]:
        """``(memory [B, N, D], memory_pos [1, N, D])`` from the encoder's patch tokens."""
        patches = enc.tokens[:, enc.num_prefix_tokens :]  # (B, N, in_dim)
        memory = self.input_proj(patches)
        pos = sine_position_embedding_2d(enc.grid, self.hidden_dim, device=memory.device).to(memory.dtype)
        return memory, pos.unsqueeze(0)

    def _decode(self, tokens: Tensor, memory: Tensor, memory_pos: Tensor, start: int = 0,
                caches: list[LayerCache] | None = None, need_weights: bool = False) -> tuple[Tensor, list[Tensor]]:
        """Logits ``[B, T, V]`` of ``tokens`` at positions ``start .. start + T - 1``."""
        t = tokens.shape[1]
        if start + t > self.max_length:
            raise ValueError(f"caption of {start + t} tokens is longer than the decoder's max_length {self.max_length}")
        x = self.drop(self.embed(tokens) + self.pos[start : start + t])  # (B, T, D)
        weights = []
        for i, layer in enumerate(self.layers):
            x, w = layer(x, memory, memory_pos=memory_pos, causal=True, need_weights=need_weights,
                         cache=caches[i] if caches is not None else None)
            if need_weights:
                weights.append(w)  # (B, heads, T, N)
        h = self.norm(x)
        return F.linear(h, self.embed.weight, self.out_bias), weights

    def forward(self, enc: EncoderOutput, tokens: Tensor, need_weights: bool = False) -> tuple[Tensor, list[Tensor]]:
        """Teacher forcing: ``tokens [B, T]`` (starting with ``<bos>``) -> ``(logits [B, T, V],
        cross-attention per layer [B, heads, T, N] if need_weights)``; logits ``t`` predict token ``t + 1``."""
        memory, memory_pos = self.encode_memory(enc)
        return self._decode(tokens, memory, memory_pos, need_weights=need_weights)

    # ------------------------------------------------------------------ generation
    def _step(self, tokens: Tensor, memory: Tensor, memory_pos: Tensor, caches: list[LayerCache] | None,
              need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probabilities ``[B, V]`` of the next token after ``tokens [B, t]`` and the cross-attention
        of that step ``[B, L, N]`` (heads averaged). With caches only the last token is fed."""
        if caches is not None:
            logits, w = self._decode(tokens[:, -1:], memory, memory_pos, tokens.shape[1] - 1, caches, need_weights)
        else:
            logits, w = self._decode(tokens, memory, memory_pos, need_weights=need_weights)
        attn = torch.stack([a[:, :, -1].float().mean(1) for a in w], dim=1) if need_weights else None  # (B, L, N)
        return logits[:, -1].float().log_softmax(-1), attn

    @torch.no_grad()
    def generate(
        self,
        enc: EncoderOutput,
        bos_id: int,
        eos_id: int,
        max_length: int | None = None,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        use_cache: bool = True,
        return_attention: bool = False,
    ) -> Generation:
        """Greedy (``beam_size=1``) or beam search, batched over images.

        Args:
            enc: the encoder output of ``B`` images.
            bos_id: the start token.
            eos_id: the end token; a hypothesis that emits it is finished (later positions
                are ``pad_id``). Hypotheses that never emit it stop at ``max_length``.
            max_length: most generated tokens (default: what the position embedding allows).
            beam_size: hypotheses kept per image.
            length_penalty: final ranking by ``score / length ** length_penalty``.
            use_cache: reuse the keys/values of earlier tokens (identical result, faster);
                ``False`` recomputes the whole prefix at every step.
            return_attention: also return each token's cross-attention (see :class:`Generation`).
        """
        if beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {beam_size}")
        return self._search(enc, bos_id, eos_id, max_length, beam_size, length_penalty, use_cache, return_attention,
                            greedy=beam_size == 1)

    def _search(self, enc: EncoderOutput, bos_id: int, eos_id: int, max_length: int | None, beam_size: int,
                length_penalty: float, use_cache: bool, return_attention: bool, greedy: bool) -> Generation:
        """The search loop: ``greedy`` takes the best token of each row; otherwise beam search
        (which, with ``beam_size=1``, must give what greedy gives: tested)."""
        max_new = min(max_length or self.max_length - 1, self.max_length - 1)
        memory, memory_pos = self.encode_memory(enc)
        b, k = memory.shape[0], beam_size
        if k > 1:
            memory = memory.repeat_interleave(k, dim=0)  # (B*K, N, D), beams of an image adjacent
        rows = b * k
        device = memory.device
        caches = [LayerCache() for _ in self.layers] if use_cache else None
        tokens = torch.full((rows, 1), bos_id, dtype=torch.long, device=device)
        scores = torch.zeros(rows, device=device)
        if k > 1:
            scores.view(b, k)[:, 1:] = float("-inf")  # all beams start equal: expand only the first
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        attention: list[Tensor] = []
        for _ in range(max_new):
            logp, attn = self._step(tokens, memory, memory_pos, caches, return_attention)
            # a finished hypothesis only continues with <pad>, at no cost
            logp[:, bos_id] = float("-inf")  # never generated
            logp = torch.where(finished[:, None], torch.full_like(logp, float("-inf")), logp)
            logp[:, self.pad_id] = torch.where(finished, 0.0, float("-inf"))
            if greedy:
                step_scores, next_tok = logp.max(-1)
                scores = scores + step_scores
                src = torch.arange(rows, device=device)
            else:
                cand = (scores[:, None] + logp).view(b, k * logp.shape[-1])  # (B, K*V)
                scores, flat = cand.topk(k, dim=-1)  # (B, K)
                scores = scores.reshape(rows)
                src = (torch.arange(b, device=device)[:, None] * k + flat // logp.shape[-1]).reshape(rows)
                next_tok = (flat % logp.shape[-1]).reshape(rows)
                tokens, finished, lengths = tokens[src], finished[src], lengths[src]
                if caches is not None:
                    for c in caches:  # the image memory is the same for an image's beams: only self-attention moves
                        c.self_attn.reorder(src)
                if return_attention:
                    attention = [a[src] for a in attention]
                    attn = attn[src]
            lengths = lengths + (~finished).long()
            finished = finished | (next_tok == eos_id)
            tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
            if return_attention:
                attention.append(attn)
            if bool(finished.all()):
                break
        out_tokens = tokens[:, 1:]
        if not greedy:
            norm = scores / lengths.clamp(min=1).float() ** length_penalty
            best = norm.view(b, k).argmax(-1) + torch.arange(b, device=device) * k  # (B,)
            out_tokens, scores, lengths = out_tokens[best], scores[best], lengths[best]
            attention = [a[best] for a in attention]
        att = torch.stack(attention, dim=1) if return_attention else None  # (B, T, L, N)
        return Generation(tokens=out_tokens, lengths=lengths, scores=scores, attention=att)
