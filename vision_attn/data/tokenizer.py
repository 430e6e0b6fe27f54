"""Word-level caption tokenizer, trained from the training captions and saved in checkpoints.

Text is normalised the same way for training, generation and metrics
(:func:`normalize_caption`): Unicode NFKC, lower case, punctuation removed (as COCO's
evaluation tokenizer does), whitespace collapsed. The vocabulary is the four special tokens
(``<pad>`` = 0, ``<bos>``, ``<eos>``, ``<unk>``) followed by every word seen at least
``min_freq`` times, most frequent first (ties alphabetically), so training twice on the same
captions gives the same ids.

The vocabulary is a plain list of strings: it travels inside the captioning checkpoint (the
task's ``vocab`` argument) and needs no extra file.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence

from vision_attn.errors import CheckpointError

__all__ = ["BOS", "EOS", "PAD", "SPECIAL_TOKENS", "UNK", "WordTokenizer", "normalize_caption"]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

_NOT_WORD = re.compile(r"[^\w']+|_")  # punctuation and symbols; apostrophes stay inside words
_LONE_APOSTROPHE = re.compile(r"(^|\s)'+|'+(\s|$)")


def normalize_caption(text: str) -> str:
    """Lower-case ``text``, drop punctuation, collapse whitespace (``"A red, circle."`` -> ``"a red circle"``)."""
    text = unicodedata.normalize("NFKC", text).lower().replace("\u2019", "'")
    text = _NOT_WORD.sub(" ", text)
    text = _LONE_APOSTROPHE.sub(" ", text)
    return " ".join(text.split())


class WordTokenizer:
    """Maps normalised words to ids and back.

    Args:
        vocab: the id -> word list; must start with :data:`SPECIAL_TOKENS`.
    """

    def __init__(self, vocab: Sequence[str]) -> None:
        vocab = list(vocab)
        if tuple(vocab[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise CheckpointError(
                f"a caption vocabulary must start with the special tokens {list(SPECIAL_TOKENS)}, "
                f"got {vocab[:4]}; was it written by vision_attn?"
            )
        if len(set(vocab)) != len(vocab):
            dup = next(w for w, n in Counter(vocab).items() if n > 1)
            raise CheckpointError(f"the caption vocabulary lists the word {dup!r} twice")
        self.vocab = vocab
        self.index = {w: i for i, w in enumerate(vocab)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (self.index[t] for t in SPECIAL_TOKENS)

    @classmethod
    def train(cls, captions: Iterable[str], min_freq: int = 1, max_size: int | None = None) -> WordTokenizer:
        """Build the vocabulary of ``captions`` (words seen at least ``min_freq`` times, at most
        ``max_size`` words besides the special tokens)."""
        counts = Counter(w for c in captions for w in normalize_caption(c).split())
        words = sorted((w for w, n in counts.items() if n >= min_freq and w not in SPECIAL_TOKENS),
                       key=lambda w: (-counts[w], w))
        if max_size is not None:
            words = words[:max_size]
        return cls([*SPECIAL_TOKENS, *words])

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """``[bos, w1, ..., wn, eos]``; unknown words map to ``<unk>``; with ``max_length`` the
        words are cut so the whole sequence (with bos and eos) fits."""
        ids = [self.index.get(w, self.unk_id) for w in normalize_caption(text).split()]
        if max_length is not None:
            ids = ids[: max(0, max_length - 2)]
        return [self.bos_id, *ids, self.eos_id]

    def decode_words(self, ids: Iterable[int]) -> list[str]:
        """The words of ``ids`` up to the first ``<eos>`` (``<bos>``/``<pad>`` skipped)."""
        words = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.bos_id, self.pad_id):
                continue
            words.append(self.vocab[i] if 0 <= i < len(self.vocab) else UNK)
        return words

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.decode_words(ids))
