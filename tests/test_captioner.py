"""Caption decoder: causal teacher forcing, cached == uncached decoding, beam search against
exhaustive search, beam 1 == greedy, batching, sequences that never end."""

from __future__ import annotations

import itertools

import pytest
import torch

from vision_attn.models.captioner import CaptionDecoder, DecoderConfig, apply_repetition_penalty
from vision_attn.models.encoder import EncoderOutput

PAD, BOS, EOS = 0, 1, 2


def _enc(b: int = 2, grid=(3, 3), dim: int = 16, prefix: int = 1, seed: int = 0) -> EncoderOutput:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(b, prefix + grid[0] * grid[1], dim, generator=g)
    return EncoderOutput(tokens=tokens, num_prefix_tokens=prefix, grid=grid)


def _decoder(vocab: int = 12, max_length: int = 12, seed: int = 0, sharpen: float = 4.0) -> CaptionDecoder:
    torch.manual_seed(seed)
    dec = CaptionDecoder(vocab, in_dim=16, config=DecoderConfig(hidden_dim=16, num_layers=2, num_heads=2, mlp_ratio=2.0,
                                                                dropout=0.0, max_length=max_length)).eval()
    with torch.no_grad():  # random weights of a larger scale than the init: varied, peaky, image-dependent captions
        for p in dec.parameters():
            p.normal_(0.0, 0.4 if p.ndim > 1 else 1.0)
        dec.embed.weight.normal_(0.0, 0.15)  # small tied embedding: no bias towards repeating the input token
        dec.embed.weight[PAD].zero_()
        dec.norm.weight.fill_(6.0 * sharpen)
    return dec


def test_teacher_forcing_shapes_and_causality():
    dec = _decoder()
    enc = _enc()
    tokens = torch.tensor([[BOS, 5, 6, 7, 8], [BOS, 9, 4, 3, PAD]])
    logits, weights = dec(enc, tokens, need_weights=True)
    assert logits.shape == (2, 5, 12)
    assert len(weights) == 2 and weights[0].shape == (2, 2, 5, 9)  # (B, heads, T, patches): prefix token dropped
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(2, 2, 5))
    changed = tokens.clone()
    changed[:, 3] = 10
    logits2, _ = dec(enc, changed)
    torch.testing.assert_close(logits2[:, :3], logits[:, :3])  # the future does not leak into the past
    assert not torch.allclose(logits2[:, 3:], logits[:, 3:])


def test_too_long_input_is_a_clear_error():
    with pytest.raises(ValueError, match="longer than the decoder's max_length 12"):
        _decoder()(_enc(), torch.full((2, 13), 4))


@pytest.mark.parametrize("beam_size", [1, 3])
def test_cached_and_uncached_decoding_are_identical(beam_size):
    dec = _decoder()
    enc = _enc(b=3)
    a = dec.generate(enc, BOS, EOS, beam_size=beam_size, use_cache=True, return_attention=True)
    b = dec.generate(enc, BOS, EOS, beam_size=beam_size, use_cache=False, return_attention=True)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.lengths, b.lengths)
    # the same words; their summed log-probabilities as close as float32 sums in another order are
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(a.attention, b.attention)
    assert a.attention.shape == (3, a.tokens.shape[1], 2, 9)
    produced = torch.arange(a.tokens.shape[1])[None] < a.lengths[:, None]  # (B, T): words, then padding
    torch.testing.assert_close(a.attention.sum(-1), produced[..., None].float().expand(-1, -1, 2))


def test_beam_size_one_equals_greedy():
    dec = _decoder(seed=3)
    enc = _enc(b=4, seed=3)
    greedy = dec.generate(enc, BOS, EOS, beam_size=1, return_attention=True)
    beam = dec._search(enc, BOS, EOS, None, 1, 1.0, True, True, greedy=False)
    assert torch.equal(greedy.tokens, beam.tokens)
    torch.testing.assert_close(greedy.scores, beam.scores)
    torch.testing.assert_close(greedy.attention, beam.attention)


@torch.no_grad()
def _sequence_logprob(dec, enc, seq: list[int], min_length: int = 0, repetition_penalty: float = 1.0) -> float:
    """Log-probability of ``seq`` from teacher-forced logits, with the decoding constraints applied
    by hand: the logits of words already in the caption divided by the penalty where positive,
    multiplied where negative; ``<eos>`` impossible before ``min_length`` words."""
    logits, _ = dec(enc, torch.tensor([[BOS, *seq[:-1]]]))
    total = 0.0
    for t, s in enumerate(seq):
        row = logits[0, t].clone()
        for w in set(seq[:t]):
            row[w] = row[w] / repetition_penalty if row[w] > 0 else row[w] * repetition_penalty
        if t < min_length:
            row[EOS] = float("-inf")
        total += float(row.log_softmax(-1)[s])
    return total


@pytest.mark.parametrize(("length_penalty", "min_length", "repetition_penalty"),
                         [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.0, 2, 1.0), (0.0, 0, 3.0), (1.0, 1, 2.0)])
def test_wide_beam_finds_the_exhaustive_optimum(length_penalty, min_length, repetition_penalty):
    # Vocabulary: pad, bos, eos + 3 words; at most 3 generated tokens. A beam wide enough to keep
    # every hypothesis must return the best of all sequences, ranked as generate() ranks them,
    # under the decoding constraints (min_length, repetition penalty) applied by hand.
    dec = _decoder(vocab=6, max_length=4, seed=1, sharpen=1.0)
    enc = _enc(b=1, seed=1)
    best, best_seq = -float("inf"), None
    for length in (1, 2, 3):
        for body in itertools.product([EOS, 3, 4, 5], repeat=length):
            if EOS in body[:-1] or (body[-1] != EOS and length < 3):  # complete captions only
                continue
            lp = _sequence_logprob(dec, enc, list(body), min_length, repetition_penalty)
            norm = lp / length**length_penalty
            if norm > best:
                best, best_seq = norm, list(body)
    out = dec.generate(enc, BOS, EOS, max_length=3, beam_size=64, length_penalty=length_penalty,
                       min_length=min_length, repetition_penalty=repetition_penalty)
    n = int(out.lengths[0])
    assert out.tokens[0, :n].tolist() == best_seq
    if min_length:
        assert n > min_length
    expected = _sequence_logprob(dec, enc, best_seq, min_length, repetition_penalty)
    assert float(out.scores[0]) == pytest.approx(expected, abs=1e-4)
    assert (out.tokens[0, n:] == PAD).all()


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.2, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    generated = torch.tensor([[0, 1, 1], [4, 4, 4]])  # token 1 twice: penalised once
    out = apply_repetition_penalty(logits, generated, 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, -0.2, 3.0], [1.0, 1.0, 1.0, 1.0, 0.5]]))
    assert logits[0, 0] == 2.0  # the input is not changed
    assert apply_repetition_penalty(logits, generated, 1.0) is logits


@pytest.mark.parametrize("beam_size", [1, 3])
def test_min_length_forbids_eos_before_it(beam_size):
    dec = _decoder(seed=2)
    enc = _enc(b=3, seed=2)
    with torch.no_grad():
        dec.out_bias[EOS] = 50.0  # <eos> wins every step it is allowed
    assert (dec.generate(enc, BOS, EOS, beam_size=beam_size).lengths == 1).all()
    out = dec.generate(enc, BOS, EOS, beam_size=beam_size, min_length=3)
    assert (out.lengths == 4).all() and (out.tokens[:, 3] == EOS).all()
    assert not (out.tokens[:, :3] == EOS).any()
    # the three words are those of a search that may never end, stopped after three tokens:
    # <eos>'s logit changes no other word's rank
    with torch.no_grad():
        dec.out_bias[EOS] = -1e4
    banned = dec.generate(enc, BOS, EOS, max_length=3, beam_size=beam_size)
    assert torch.equal(out.tokens[:, :3], banned.tokens)


class _RepeatTable(CaptionDecoder):
    """Fixed next-token logits per prefix (vocabulary pad, bos, eos, a = 3, b = 4): greedy says
    "a a" without a penalty; with penalty 2, "a"'s negative logit after "a" is doubled (-0.4 <
    -0.3: "b"), then both words' positive logits are halved (a 1.0, b 0.6 < eos 1.5)."""

    TABLE = {(): {EOS: -1.0, 3: 2.0, 4: 1.0}, (3,): {EOS: -2.0, 3: -0.2, 4: -0.3}, (3, 3): {EOS: 3.0},
             (3, 4): {EOS: 1.5, 3: 2.0, 4: 1.2}, (3, 4, 3): {EOS: 3.0}}

    def __init__(self) -> None:
        super().__init__(5, in_dim=16, config=DecoderConfig(hidden_dim=16, num_layers=1, num_heads=2, dropout=0.0,
                                                            max_length=6))

    def row(self, prefix: tuple[int, ...]) -> torch.Tensor:
        row = torch.full((5,), -3.0)
        for tok, value in self.TABLE.get(prefix, {}).items():
            row[tok] = value
        return row

    def _step(self, tokens, memory, memory_pos, caches, need_weights):
        return torch.stack([self.row(tuple(r[1:].tolist())) for r in tokens]), None


def test_repetition_penalty_in_greedy_search_as_hand_computed():
    dec = _RepeatTable().eval()
    enc = _enc(b=1, dim=16)
    assert dec.generate(enc, BOS, EOS).tokens[0].tolist() == [3, 3, EOS]
    out = dec.generate(enc, BOS, EOS, repetition_penalty=2.0)
    assert out.tokens[0].tolist() == [3, 4, EOS]
    # the softmax runs over the whole vocabulary (<pad> and <bos> at the table's -3), as for the
    # scores without constraints (test_scores_are_the_log_probability_of_the_returned_caption)
    rows = [torch.tensor([-3.0, -3.0, -1.0, 2.0, 1.0]), torch.tensor([-3.0, -3.0, -2.0, -0.4, -0.3]),
            torch.tensor([-3.0, -3.0, 1.5, 1.0, 0.6])]
    expected = sum(float(r.log_softmax(-1)[t]) for r, t in zip(rows, [3, 4, EOS], strict=True))
    assert float(out.scores[0]) == pytest.approx(expected, abs=1e-6)


def test_constrained_beam_one_equals_greedy_and_cache_changes_nothing():
    dec = _decoder(seed=5)
    enc = _enc(b=3, seed=5)
    kw = dict(min_length=2, repetition_penalty=1.5)
    greedy = dec.generate(enc, BOS, EOS, beam_size=1, **kw)
    beam = dec._search(enc, BOS, EOS, None, 1, 1.0, True, False, greedy=False, **kw)
    uncached = dec.generate(enc, BOS, EOS, beam_size=3, use_cache=False, **kw)
    cached = dec.generate(enc, BOS, EOS, beam_size=3, **kw)
    assert torch.equal(greedy.tokens, beam.tokens)
    assert torch.equal(cached.tokens, uncached.tokens)
    for out in (greedy, cached):
        for i in range(3):
            n = int(out.lengths[i])
            one = EncoderOutput(tokens=enc.tokens[i : i + 1], num_prefix_tokens=1, grid=enc.grid)
            seq = out.tokens[i, :n].tolist()
            assert float(out.scores[i]) == pytest.approx(_sequence_logprob(dec, one, seq, 2, 1.5), abs=1e-4)


def test_invalid_decoding_options_are_clear_errors():
    with pytest.raises(ValueError, match="min_length"):
        _decoder().generate(_enc(), BOS, EOS, min_length=-1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        _decoder().generate(_enc(), BOS, EOS, repetition_penalty=0.0)


def test_batched_beam_search_equals_one_image_at_a_time():
    dec = _decoder(seed=3)
    enc = _enc(b=3, seed=3)  # one caption ends early, one late, one never: padding and beams of mixed state
    together = dec.generate(enc, BOS, EOS, beam_size=4, return_attention=True)
    for i in range(3):
        single = EncoderOutput(tokens=enc.tokens[i : i + 1], num_prefix_tokens=1, grid=enc.grid)
        alone = dec.generate(single, BOS, EOS, beam_size=4, return_attention=True)
        t = alone.tokens.shape[1]
        assert torch.equal(together.tokens[i, :t], alone.tokens[0])
        assert (together.tokens[i, t:] == PAD).all()
        torch.testing.assert_close(together.scores[i], alone.scores[0])
        torch.testing.assert_close(together.attention[i, :t], alone.attention[0])


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_caption_that_never_ends_stops_at_max_length(beam_size):
    dec = _decoder()
    with torch.no_grad():
        dec.out_bias[EOS] = -1e4  # <eos> is never chosen
    out = dec.generate(_enc(), BOS, EOS, max_length=7, beam_size=beam_size, return_attention=True)
    assert out.tokens.shape == (2, 7) and (out.lengths == 7).all()
    assert (out.tokens != PAD).all() and torch.isfinite(out.scores).all()
    assert out.attention.shape[1] == 7


def test_scores_are_the_log_probability_of_the_returned_caption():
    dec = _decoder(seed=4)
    enc = _enc(b=2, seed=4)
    out = dec.generate(enc, BOS, EOS, beam_size=3)
    for i in range(2):
        n = int(out.lengths[i])
        one = EncoderOutput(tokens=enc.tokens[i : i + 1], num_prefix_tokens=1, grid=enc.grid)
        assert float(out.scores[i]) == pytest.approx(_sequence_logprob(dec, one, out.tokens[i, :n].tolist()), abs=1e-4)


class _TableDecoder(CaptionDecoder):
    """A decoder whose next-token logits are a fixed table of the prefix (no image): search
    bookkeeping tested on its own. Vocabulary: pad, bos, eos, a (3), b (4)."""

    TABLE = {(): {EOS: -0.5, 3: -1.0, 4: -1.2}, (4,): {3: -0.05}, (4, 3): {EOS: -0.05}}
    DEFAULT = -3.0

    def __init__(self) -> None:
        super().__init__(5, in_dim=16, config=DecoderConfig(hidden_dim=16, num_layers=1, num_heads=2, dropout=0.0,
                                                            max_length=4))

    def logp(self, prefix: tuple[int, ...]) -> torch.Tensor:
        row = torch.full((5,), self.DEFAULT)
        row[[PAD, BOS]] = float("-inf")
        for tok, value in self.TABLE.get(prefix, {}).items():
            row[tok] = value
        return row

    def _step(self, tokens, memory, memory_pos, caches, need_weights):
        return torch.stack([self.logp(tuple(r[1:].tolist())) for r in tokens]), None


def _exhaustive(dec: _TableDecoder, max_new: int, length_penalty: float) -> tuple[list[int], float]:
    """Best complete caption (ends with <eos>, or reaches max_new tokens) by generate()'s ranking."""
    best, best_seq = -float("inf"), None
    for length in range(1, max_new + 1):
        for body in itertools.product([EOS, 3, 4], repeat=length):
            if EOS in body[:-1] or (body[-1] != EOS and length < max_new):
                continue
            lp = sum(float(dec.logp(body[:t]).log_softmax(-1)[s]) for t, s in enumerate(body))
            if lp / length**length_penalty > best:
                best, best_seq = lp / length**length_penalty, list(body)
    return best_seq, best


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_finished_hypotheses_leave_the_beam_and_are_ranked_with_the_length_penalty(length_penalty):
    # Beam 2. The most probable first token is <eos> ("" scores -0.74 after the softmax); "b a
    # <eos>" (-1.64) is the best caption once lengths count. Kept in a beam slot and compared on raw log-probability,
    # the finished "" pushed "b" out of the beam at step 1; in the pool of finished hypotheses
    # it frees its slot and the search reaches the exhaustive optimum.
    dec = _TableDecoder().eval()
    enc = _enc(b=2, dim=16)
    best_seq, best = _exhaustive(dec, 3, length_penalty)
    out = dec.generate(enc, BOS, EOS, max_length=3, beam_size=2, length_penalty=length_penalty)
    for i in range(2):
        n = int(out.lengths[i])
        assert out.tokens[i, :n].tolist() == best_seq
        assert (out.tokens[i, n:] == PAD).all()
        assert float(out.scores[i]) / n**length_penalty == pytest.approx(best)
    assert best_seq == ([EOS] if length_penalty == 0 else [4, 3, EOS])


def test_embedding_memory_adds_the_first_blocks_input_per_patch():
    """``embedding_memory``: memory token ``n`` = projected output token ``n`` + projected
    embedding token ``n`` (prefix dropped), so the words read both; without the embedding tokens
    it is a clear error."""
    torch.manual_seed(0)
    dec = CaptionDecoder(12, in_dim=16, config=DecoderConfig(hidden_dim=16, num_layers=2, num_heads=2, dropout=0.0,
                                                             embedding_memory=True)).eval()
    enc = _enc()
    with pytest.raises(ValueError, match="keep_embedding"):
        dec(enc, torch.tensor([[BOS, 5]]).expand(2, -1))
    enc.embedding_tokens = torch.randn_like(enc.tokens)
    memory, _ = dec.encode_memory(enc)
    expected = dec.input_proj(enc.tokens[:, 1:]) + dec.embedding_proj(enc.embedding_tokens[:, 1:])
    torch.testing.assert_close(memory, expected)
    tokens = torch.tensor([[BOS, 5, 6], [BOS, 7, 8]])
    logits, _ = dec(enc, tokens)
    moved = EncoderOutput(enc.tokens, 1, enc.grid, embedding_tokens=enc.embedding_tokens.roll(1, dims=1))
    assert not torch.allclose(dec(moved, tokens)[0], logits)  # the words depend on the embedding tokens
    assert CaptionDecoder(12, in_dim=16, config=DecoderConfig(hidden_dim=16)).embedding_proj is None  # off by default


def test_pixel_memory_adds_each_patchs_own_pixels():
    """``pixel_dim``: memory token ``n`` = projected output token ``n`` + projected pixels of
    patch ``n``; the words depend on them; without the pixel tokens it is a clear error."""
    torch.manual_seed(0)
    dec = CaptionDecoder(12, in_dim=16, pixel_dim=12, config=DecoderConfig(hidden_dim=16, num_layers=2, num_heads=2,
                                                                           dropout=0.0, pixel_memory=True)).eval()
    enc = _enc()
    tokens = torch.tensor([[BOS, 5, 6], [BOS, 7, 8]])
    with pytest.raises(ValueError, match="keep_pixels"):
        dec(enc, tokens)
    n = enc.tokens.shape[1] - 1
    enc.pixel_tokens = torch.randn(2, n, 12)
    memory, _ = dec.encode_memory(enc)
    torch.testing.assert_close(memory, dec.input_proj(enc.tokens[:, 1:]) + dec.pixel_proj(enc.pixel_tokens))
    logits, _ = dec(enc, tokens)
    moved = EncoderOutput(enc.tokens, 1, enc.grid, pixel_tokens=enc.pixel_tokens.roll(1, dims=1))
    assert not torch.allclose(dec(moved, tokens)[0], logits)
    assert CaptionDecoder(12, in_dim=16, config=DecoderConfig(hidden_dim=16)).pixel_proj is None  # off by default
