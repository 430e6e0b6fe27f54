"""Caption decoder: each word cross-attends over the image's patch tokens ("Show, Attend and Tell"
with a transformer decoder).

- Input: the encoder's patch tokens (prefix tokens such as CLS dropped: the image *regions*),
  projected to the decoder width, with a 2-D sine position embedding added to the keys
  (``embedding_memory``: plus the same patch's token from before the encoder's first block).
- Words: token embedding + learned position embedding, ``num_layers`` of
  :class:`~vision_attn.models.layers.DecoderLayer` (causal self-attention, cross-attention,
  feed-forward; the layer the DETR head uses), final norm, output projection tied to the
  token embedding.
- :meth:`CaptionDecoder.forward`: teacher forcing, logits ``[B, T, V]``.
- :meth:`CaptionDecoder.generate`: greedy or beam search with the key/value cache, batched;
  beam search keeps a pool of finished hypotheses ranked with the length penalty (fairseq,
  Hugging Face ``generate``); returns the token ids, their scores and, on request, every
  generated token's cross-attention over the patches (of the chosen hypothesis). Decoding
  constraints, applied to each step's logits before the softmax: ``min_length`` (no ``<eos>``
  before that many words) and ``repetition_penalty`` (Hugging Face's rule, see
  :func:`apply_repetition_penalty`).
- :meth:`CaptionDecoder.sample` and :meth:`CaptionDecoder.token_logprobs`: captions sampled from
  the decoder's softmax (batched, cached, no graph) and their log-probabilities recomputed with
  gradients in one teacher-forced pass, for self-critical training (:mod:`vision_attn.losses.scst`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.models.encoder import EncoderOutput
from vision_attn.models.layers import DecoderLayer, LayerCache, sine_position_embedding_2d

__all__ = ["CaptionDecoder", "DecoderConfig", "Generation", "GenerationOptions", "apply_repetition_penalty"]


@dataclass(frozen=True)
class DecoderConfig:
    """What a :class:`CaptionDecoder` is built from (besides the vocabulary and the encoder's width).

    Attributes:
        hidden_dim: decoder width (divisible by 4).
        num_layers: decoder layers.
        num_heads: attention heads.
        mlp_ratio: feed-forward width relative to ``hidden_dim``.
        dropout: dropout in the decoder and on the embeddings.
        max_length: longest token sequence (position embeddings; ``<bos>`` and ``<eos>``
            included).
        embedding_memory: add the encoder's embedding tokens (the first block's input,
            :attr:`EncoderOutput.embedding_tokens`, each through its own linear + LayerNorm) to
            the projected output tokens of the same patch: the memory keeps one token per patch,
            so the cross-attention maps and their explanations are unchanged in shape. Low-level
            evidence (an object's colour) reaches the words even where the encoder's output tokens
            are dominated by what an auxiliary loss asks for.
        pixel_memory: add each patch's own pixels (:attr:`EncoderOutput.pixel_tokens`, through
            their own linear + LayerNorm) to its memory token, a path to the colours that no
            training of the encoder can remove.
    """

    hidden_dim: int = 256
    num_layers: int = 3
    num_heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.1
    max_length: int = 32
    embedding_memory: bool = False
    pixel_memory: bool = False

    def __post_init__(self) -> None:
        if self.hidden_dim % 4:
            raise ValueError(f"hidden_dim must be divisible by 4, got {self.hidden_dim}")


DEFAULT_DECODER = DecoderConfig()


@dataclass
class GenerationOptions:
    """How captions are generated: the captioning task's inference options (``--generate.*`` of
    ``eval.py``, ``predict`` and ``explain``; ``None`` = the model's own setting).

    BLIP (Li et al. 2022) decodes its COCO captions with beam search of width 3, at least 5 and
    at most 20 tokens and no repetition penalty (its ``generate()`` defaults: beam 3,
    ``min_length`` 10, ``max_length`` 30, ``repetition_penalty`` 1.0; its lengths are BERT
    word pieces and include the prompt "a picture of"). Here lengths count words, and the
    defaults of :class:`~vision_attn.tasks.captioning.CaptioningTask` are beam 3, length
    penalty 1, ``min_length`` 0, ``max_length`` what the decoder holds, penalty 1.0.

    Attributes:
        beam_size: 1 = greedy search; more = beam search.
        length_penalty: beam search ranks finished hypotheses by
            ``log p / length ** length_penalty`` (0 = raw log-probability, favouring short
            captions; 1 = per-word average).
        max_length: most tokens generated (``<eos>`` included).
        min_length: fewest words before ``<eos>`` (``<eos>`` is impossible until then).
        repetition_penalty: the logit of every word already generated in the caption is
            divided by it when positive and multiplied by it when negative (Hugging Face's
            ``repetition_penalty``; 1 = off, > 1 discourages repeating a word).
    """

    beam_size: int | None = None
    length_penalty: float | None = None
    max_length: int | None = None
    min_length: int | None = None
    repetition_penalty: float | None = None


def apply_repetition_penalty(logits: Tensor, generated: Tensor, penalty: float) -> Tensor:
    """Hugging Face's repetition penalty (Keskar et al. 2019, CTRL): ``logits [B, V]`` with the
    entries of the tokens in ``generated [B, t]`` divided by ``penalty`` where positive and
    multiplied by it where negative (a token generated twice is penalised once). Returns a new
    tensor; ``penalty == 1`` returns ``logits`` itself."""
    if penalty == 1.0 or generated.shape[1] == 0:
        return logits
    seen = logits.gather(1, generated)  # (B, t)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(1, generated, seen)


@dataclass
class Generation:
    """Output of :meth:`CaptionDecoder.generate` for ``B`` images.

    Attributes:
        tokens: ``[B, T]`` generated ids (no ``<bos>``); after ``<eos>`` padded with ``pad_id``.
        lengths: ``[B]`` tokens up to and including ``<eos>`` (``T`` when it never came).
        scores: ``[B]`` sum of the tokens' log-probabilities.
        attention: ``[B, T, L, N]`` per generated token and decoder layer, the cross-attention
            over the ``N`` patches, averaged over heads (``None`` unless requested). Entry
            ``t`` is the attention of the step that *produced* token ``t``; entries after
            ``<eos>`` (``t >= lengths``) are zero.
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
        config: width, depth, heads, dropout, longest sequence and the extra memory paths
            (:class:`DecoderConfig`).
        pad_id: id of ``<pad>`` (its embedding stays zero).
        pixel_dim: values of each patch's pixel tokens (``3 * p * p``); needed with
            ``config.pixel_memory``.
    """

    def __init__(self, vocab_size: int, in_dim: int, config: DecoderConfig = DEFAULT_DECODER, pad_id: int = 0,
                 pixel_dim: int | None = None) -> None:
        super().__init__()
        if config.pixel_memory and not pixel_dim:
            raise ValueError("pixel_memory needs pixel_dim, the values of each patch's pixel tokens (3 * p * p)")
        self.config = config
        hidden_dim, max_length = config.hidden_dim, config.max_length
        self.vocab_size, self.hidden_dim, self.max_length, self.pad_id = vocab_size, hidden_dim, max_length, pad_id
        self.input_proj = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.LayerNorm(hidden_dim))
        self.embedding_proj = (nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.LayerNorm(hidden_dim))
                               if config.embedding_memory else None)
        self.pixel_proj = (nn.Sequential(nn.Linear(pixel_dim, hidden_dim), nn.LayerNorm(hidden_dim))
                           if config.pixel_memory else None)
        self.embed = nn.Embedding(vocab_size, hidden_dim, padding_idx=pad_id)
        self.pos = nn.Parameter(torch.zeros(max_length, hidden_dim))
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(DecoderLayer(hidden_dim, config.num_heads, config.mlp_ratio, config.dropout)
                                    for _ in range(config.num_layers))
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
        if self.embedding_proj is not None:
            if enc.embedding_tokens is None:
                raise ValueError("embedding_memory needs the encoder's embedding tokens "
                                 "(ViTEncoder.keep_embedding = True)")
            memory = memory + self.embedding_proj(enc.embedding_tokens[:, enc.num_prefix_tokens :])
        if self.pixel_proj is not None:
            if enc.pixel_tokens is None:
                raise ValueError("pixel_memory needs the encoder's pixel tokens (ViTEncoder.keep_pixels = True)")
            memory = memory + self.pixel_proj(enc.pixel_tokens.to(memory.dtype))
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
        """Logits ``[B, V]`` (float32) of the next token after ``tokens [B, t]`` and the cross-attention
        of that step ``[B, L, N]`` (heads averaged). With caches only the last token is fed."""
        if caches is not None:
            logits, w = self._decode(tokens[:, -1:], memory, memory_pos, tokens.shape[1] - 1, caches, need_weights)
        else:
            logits, w = self._decode(tokens, memory, memory_pos, need_weights=need_weights)
        attn = torch.stack([a[:, :, -1].float().mean(1) for a in w], dim=1) if need_weights else None  # (B, L, N)
        return logits[:, -1].float(), attn

    def _next_logprobs(self, logits: Tensor, tokens: Tensor, step: int, bos_id: int, eos_id: int, min_length: int,
                       repetition_penalty: float) -> Tensor:
        """Log-probabilities ``[B, V]`` of the next token from the step's ``logits [B, V]``: the
        repetition penalty on the words generated so far (``tokens [B, 1 + step]``, ``<bos>``
        first), ``<eos>`` impossible while fewer than ``min_length`` words stand, then the
        softmax; ``<bos>`` and ``<pad>`` are never generated."""
        logits = apply_repetition_penalty(logits, tokens[:, 1:], repetition_penalty)
        if step < min_length:
            logits = logits.clone()
            logits[:, eos_id] = float("-inf")
        logp = logits.log_softmax(-1)
        logp[:, bos_id] = float("-inf")  # never generated
        logp[:, self.pad_id] = float("-inf")
        return logp

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
        min_length: int = 0,
        repetition_penalty: float = 1.0,
    ) -> Generation:
        """Greedy (``beam_size=1``) or beam search, batched over images.

        Args:
            enc: the encoder output of ``B`` images.
            bos_id: the start token.
            eos_id: the end token; a hypothesis that emits it is finished (later positions
                are ``pad_id``). Hypotheses that never emit it stop at ``max_length``.
            max_length: most generated tokens (default: what the position embedding allows).
            beam_size: hypotheses kept per image.
            length_penalty: finished hypotheses are ranked by
                ``score / length ** length_penalty`` (see :meth:`_beam`).
            use_cache: reuse the keys/values of earlier tokens (identical result, faster);
                ``False`` recomputes the whole prefix at every step.
            return_attention: also return each token's cross-attention (see :class:`Generation`).
            min_length: fewest words before ``<eos>`` (its probability is zero until then; a
                ``min_length`` at or above ``max_length`` gives captions that never end).
            repetition_penalty: see :func:`apply_repetition_penalty` (1 = off).

        With ``min_length`` or a repetition penalty, ``scores`` are the log-probabilities of
        the constrained distribution (as Hugging Face's processed scores).
        """
        if beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {beam_size}")
        if min_length < 0:
            raise ValueError(f"min_length must be at least 0, got {min_length}")
        if not repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be positive (1 = off), got {repetition_penalty}")
        return self._search(enc, bos_id, eos_id, max_length, beam_size, length_penalty, use_cache, return_attention,
                            greedy=beam_size == 1, min_length=min_length, repetition_penalty=repetition_penalty)

    def _search(self, enc: EncoderOutput, bos_id: int, eos_id: int, max_length: int | None, beam_size: int,
                length_penalty: float, use_cache: bool, return_attention: bool, greedy: bool, min_length: int = 0,
                repetition_penalty: float = 1.0) -> Generation:
        """The search loop: ``greedy`` takes the best token of each row; otherwise beam search
        (which, with ``beam_size=1``, must give what greedy gives: tested)."""
        max_new = min(max_length or self.max_length - 1, self.max_length - 1)
        memory, memory_pos = self.encode_memory(enc)
        constraints = (min_length, repetition_penalty)
        if greedy:
            return self._greedy(memory, memory_pos, bos_id, eos_id, max_new, use_cache, return_attention, constraints)
        return self._beam(memory, memory_pos, bos_id, eos_id, max_new, beam_size, length_penalty, use_cache,
                          return_attention, constraints)

    @torch.no_grad()
    def sample(self, enc: EncoderOutput, bos_id: int, eos_id: int, num_samples: int = 1, max_length: int | None = None,
               use_cache: bool = True, generator: torch.Generator | None = None,
               temperature: float = 1.0) -> Generation:
        """``num_samples`` captions per image drawn from the decoder's own softmax (multinomial
        sampling, as self-critical training needs: :mod:`vision_attn.losses.scst`), batched over
        images and samples, with the key/value cache.

        Rows are image-major: rows ``i * num_samples .. (i + 1) * num_samples - 1`` are image
        ``i``'s. Each token is drawn from the softmax of the step's logits renormalised without
        ``<bos>`` and ``<pad>`` (never generated), divided by ``temperature`` (1: the model's
        own distribution; below 1: sharper), with no decoding constraint (no
        ``min_length``, no repetition penalty): ``scores`` are the sums of the sampled tokens'
        log-probabilities under that distribution, which :meth:`token_logprobs` (same
        ``temperature``) recomputes with gradients. Nothing here builds an autograd graph; the module's mode decides
        dropout (the caller's choice).
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {num_samples}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        max_new = min(max_length or self.max_length - 1, self.max_length - 1)
        memory, memory_pos = self.encode_memory(enc)
        memory = memory.repeat_interleave(num_samples, dim=0)  # (B*S, N, D), an image's samples adjacent
        return self._greedy(memory, memory_pos, bos_id, eos_id, max_new, use_cache, False, sample=True,
                            generator=generator, temperature=temperature)

    def token_logprobs(self, enc: EncoderOutput, tokens: Tensor, bos_id: int, repeats: int = 1,
                       temperature: float = 1.0) -> Tensor:
        """Teacher-forced log-probabilities ``[R, T]`` of generated ``tokens [R, T]`` (no ``<bos>``,
        as :class:`Generation` holds them), with gradients, under the distribution
        :meth:`sample` draws from (``<bos>`` and ``<pad>`` excluded from the softmax).

        ``enc`` holds ``B`` images and ``R = B * repeats`` (rows image-major, as :meth:`sample`
        returns them): the image memory is projected once and repeated. Entries at ``<pad>``
        (after ``<eos>``) are not log-probabilities of anything: mask them with the lengths.
        """
        memory, memory_pos = self.encode_memory(enc)
        memory = memory.repeat_interleave(repeats, dim=0)  # (B*S, N, D)
        if memory.shape[0] != tokens.shape[0]:
            raise ValueError(f"{tokens.shape[0]} token rows for {memory.shape[0] // repeats} images x {repeats}")
        inputs = torch.cat([tokens.new_full((tokens.shape[0], 1), bos_id), tokens[:, :-1]], dim=1)  # (R, T)
        logits = self._decode(inputs, memory, memory_pos)[0].float() / temperature  # (R, T, V)
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        banned[[bos_id, self.pad_id]] = True
        logp = logits.masked_fill(banned, float("-inf")).log_softmax(-1)
        allowed = next(i for i in range(3) if i not in (bos_id, self.pad_id))  # a finite entry for padded positions
        picked = logp.gather(-1, torch.where(tokens == self.pad_id, allowed, tokens)[..., None])  # (R, T, 1)
        return picked.squeeze(-1)

    def _greedy(self, memory: Tensor, memory_pos: Tensor, bos_id: int, eos_id: int, max_new: int, use_cache: bool,
                return_attention: bool, constraints: tuple[int, float] = (0, 1.0), sample: bool = False,
                generator: torch.Generator | None = None, temperature: float = 1.0) -> Generation:
        """Greedy search, or (``sample``) multinomial sampling from the renormalised softmax
        (of the log-probabilities divided by ``temperature``)."""
        rows, device = memory.shape[0], memory.device
        caches = [LayerCache() for _ in self.layers] if use_cache else None
        tokens = torch.full((rows, 1), bos_id, dtype=torch.long, device=device)
        scores = torch.zeros(rows, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        attention: list[Tensor] = []
        for step in range(max_new):
            logits, attn = self._step(tokens, memory, memory_pos, caches, return_attention)
            logp = self._next_logprobs(logits, tokens, step, bos_id, eos_id, *constraints)
            if sample:
                logp = (logp / temperature).log_softmax(-1)  # renormalised without <bos> / <pad>
                next_tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
                step_scores = logp.gather(1, next_tok[:, None]).squeeze(1)
            else:
                step_scores, next_tok = logp.max(-1)
            ended = finished
            next_tok = torch.where(finished, self.pad_id, next_tok)  # a finished caption continues with <pad>
            scores = scores + torch.where(finished, 0.0, step_scores)
            lengths = lengths + (~finished).long()
            finished = finished | (next_tok == eos_id)
            tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
            if return_attention:
                attention.append(torch.where(ended[:, None, None], 0.0, attn))  # no word produced: zeros
            if bool(finished.all()):
                break
        att = torch.stack(attention, dim=1) if return_attention else None  # (B, T, L, N)
        return Generation(tokens=tokens[:, 1:], lengths=lengths, scores=scores, attention=att)

    def _beam(self, memory: Tensor, memory_pos: Tensor, bos_id: int, eos_id: int, max_new: int, k: int,
              length_penalty: float, use_cache: bool, return_attention: bool,
              constraints: tuple[int, float] = (0, 1.0)) -> Generation:
        """Beam search with a pool of finished hypotheses per image (as fairseq and Hugging Face
        ``generate``).

        Each step extends the ``K`` live hypotheses of an image by every token and ranks the
        ``2K`` best extensions by log-probability. An extension that ends with ``<eos>`` and
        ranks among the first ``K`` is finished: it enters the image's pool with its score
        normalised *now*, ``log p / length ** length_penalty`` (the pool keeps the ``K`` best);
        the ``K`` best other extensions stay live. Finished hypotheses never take a live slot.
        An image is done when its pool is full and its best live hypothesis, normalised at the
        current length, cannot beat the pool's worst (Hugging Face's ``early_stopping=False``);
        at ``max_new`` tokens the live hypotheses enter the pool unfinished. The answer is the
        pool's best.
        """
        b, device = memory.shape[0], memory.device
        memory = memory.repeat_interleave(k, dim=0)  # (B*K, N, D), beams of an image adjacent
        rows = b * k
        caches = [LayerCache() for _ in self.layers] if use_cache else None
        tokens = torch.full((rows, 1), bos_id, dtype=torch.long, device=device)
        scores = torch.zeros(b, k, device=device)
        scores[:, 1:] = float("-inf")  # all beams start equal: expand only the first
        # the pool: K finished hypotheses per image (tokens padded to max_new)
        pool_tokens = torch.full((b, k, max_new), self.pad_id, dtype=torch.long, device=device)
        pool_scores = torch.full((b, k), float("-inf"), device=device)  # sum of log-probabilities
        pool_norm = torch.full((b, k), float("-inf"), device=device)  # ranking score
        pool_lengths = torch.zeros(b, k, dtype=torch.long, device=device)
        pool_attention: Tensor | None = None  # (B, K, max_new, L, N)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        attention: list[Tensor] = []  # per step (B*K, L, N) of the live hypotheses
        image = torch.arange(b, device=device)[:, None]
        steps = 0
        for step in range(max_new):
            steps = step + 1
            logits, attn = self._step(tokens, memory, memory_pos, caches, return_attention)
            logp = self._next_logprobs(logits, tokens, step, bos_id, eos_id, *constraints)
            v = logp.shape[-1]
            cand = (scores.reshape(rows, 1) + logp).view(b, k * v)  # (B, K*V)
            cand_scores, flat = cand.topk(2 * k, dim=-1)  # (B, 2K), best first
            beam, tok = flat // v, flat % v  # (B, 2K)
            src = image * k + beam  # (B, 2K) rows of the extended hypotheses
            is_eos = tok == eos_id
            prefix = tokens[:, 1:].view(b, k, -1)
            prefix_att = (torch.stack(attention, dim=1).view(b, k, step, *attn.shape[1:])
                          if step and return_attention else None)
            # 1. finished: <eos> extensions ranked among the first K enter the pool
            first_k = torch.arange(2 * k, device=device)[None] < k
            fin = is_eos & first_k & torch.isfinite(cand_scores) & ~done[:, None]  # (B, 2K)
            new_norm = torch.where(fin, cand_scores / float(steps) ** length_penalty, float("-inf"))
            new_tokens, new_att = self._extensions(prefix, prefix_att, attn if return_attention else None,
                                                   beam, tok, max_new, memory)
            pool_tokens, pool_scores, pool_norm, pool_lengths, pool_attention = self._merge_pool(
                (pool_tokens, pool_scores, pool_norm, pool_lengths, pool_attention),
                (new_tokens, cand_scores, new_norm, torch.full_like(tok, steps), new_att), k)
            # 2. live: the K best extensions that do not end
            keep = torch.sort(is_eos.int(), dim=1, stable=True).indices[:, :k]  # (B, K) best first
            scores = cand_scores.gather(1, keep)
            rows_src = src.gather(1, keep).reshape(rows)
            next_tok = tok.gather(1, keep).reshape(rows)
            tokens = torch.cat([tokens[rows_src], next_tok[:, None]], dim=1)
            if caches is not None:
                for c in caches:  # the image memory is the same for an image's beams: only self-attention moves
                    c.self_attn.reorder(rows_src)
            if return_attention:
                attention = [a[rows_src] for a in attention] + [attn[rows_src]]
            # 3. done: a full pool that no live hypothesis beats at the current length
            best_live = scores.amax(dim=1) / float(steps) ** length_penalty
            done = done | (torch.isfinite(pool_norm).all(dim=1) & (best_live <= pool_norm.amin(dim=1)))
            if bool(done.all()):
                break
        # hypotheses still live at max_new enter the pool unfinished (length max_new)
        live = self._live_hypotheses(tokens, scores, done, attention if return_attention else None, steps,
                                     max_new, length_penalty, memory)
        pool_tokens, pool_scores, pool_norm, pool_lengths, pool_attention = self._merge_pool(
            (pool_tokens, pool_scores, pool_norm, pool_lengths, pool_attention), live, k)
        best = pool_norm.argmax(dim=1)  # (B,)
        att = pool_attention[image[:, 0], best, :steps] if return_attention else None  # (B, T, L, N)
        return Generation(tokens=pool_tokens[image[:, 0], best, :steps], lengths=pool_lengths[image[:, 0], best],
                          scores=pool_scores[image[:, 0], best], attention=att)

    def _extensions(self, prefix: Tensor, prefix_att: Tensor | None, attn: Tensor | None, beam: Tensor,
                    tok: Tensor, max_new: int, memory: Tensor) -> tuple[Tensor, Tensor | None]:
        """The ``2K`` ranked extensions of a beam-search step as pool entries: their tokens
        ``[B, 2K, max_new]`` (padded) and, when the step's cross-attention ``attn [B*K, L, N]`` is
        given, their attention ``[B, 2K, max_new, L, N]`` (``prefix_att``: the earlier steps')."""
        b, k, step = prefix.shape[0], prefix.shape[1], prefix.shape[2]
        new_tokens = torch.full((b, 2 * k, max_new), self.pad_id, dtype=torch.long, device=prefix.device)
        new_tokens[:, :, :step] = prefix.gather(1, beam[..., None].expand(-1, -1, step))
        new_tokens[:, :, step] = tok
        if attn is None:
            return new_tokens, None
        image = torch.arange(b, device=prefix.device)[:, None]
        step_att = attn.view(b, k, *attn.shape[1:])  # (B, K, L, N)
        new_att = memory.new_zeros(b, 2 * k, max_new, *attn.shape[1:], dtype=attn.dtype)
        if prefix_att is not None:
            new_att[:, :, :step] = prefix_att[image, beam]
        new_att[:, :, step] = step_att[image, beam]
        return new_tokens, new_att

    def _live_hypotheses(self, tokens: Tensor, scores: Tensor, done: Tensor, attention: list[Tensor] | None,
                         steps: int, max_new: int, length_penalty: float, memory: Tensor) -> tuple:
        """The live hypotheses at the end of beam search as pool entries ``(tokens, scores, ranking
        scores, lengths, attention or None)`` (those of finished images score ``-inf``)."""
        b, k = scores.shape
        live_scores = torch.where(done[:, None], float("-inf"), scores)
        live_tokens = torch.full((b, k, max_new), self.pad_id, dtype=torch.long, device=tokens.device)
        live_tokens[:, :, :steps] = tokens[:, 1:].view(b, k, steps)
        live_att = None
        if attention is not None:
            live_att = memory.new_zeros(b, k, max_new, *attention[0].shape[1:], dtype=attention[0].dtype)
            live_att[:, :, :steps] = torch.stack(attention, dim=1).view(b, k, steps, *attention[0].shape[1:])
        lengths = torch.full((b, k), steps, dtype=torch.long, device=tokens.device)
        return live_tokens, live_scores, live_scores / float(steps) ** length_penalty, lengths, live_att

    @staticmethod
    def _merge_pool(pool: tuple, new: tuple, k: int) -> tuple:
        """The ``K`` best by ranking score of a pool and new hypotheses, both ``(tokens, scores,
        ranking scores, lengths, attention or None)`` with the hypotheses on dim 1. Pool
        entries come first, so on ties a hypothesis already in the pool stays."""
        norm = torch.cat([pool[2], new[2]], dim=1)
        order = norm.sort(dim=1, descending=True, stable=True).indices[:, :k]  # (B, K)
        out = []
        for old, add in zip(pool, new, strict=True):
            if old is None and add is None:
                out.append(None)
                continue
            if old is None:  # no attention stored yet: the pool held nothing real
                old = add.new_zeros(add.shape[0], k, *add.shape[2:])
            both = torch.cat([old, add], dim=1)
            idx = order.view(*order.shape, *([1] * (both.dim() - 2))).expand(-1, -1, *both.shape[2:])
            out.append(both.gather(1, idx))
        return tuple(out)
