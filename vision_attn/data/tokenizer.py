"""Word-level caption tokenizer on the ``tokenizers`` library, trained from the training captions
and saved in checkpoints.

Text is normalised the same way for training, generation and metrics
(:func:`normalize_caption`): Unicode NFKC, lower case (a capital sigma ending a word becomes
``ς``, as Python's ``str.lower`` does), punctuation and symbols removed (as COCO's evaluation
tokenizer does; apostrophes inside words stay), whitespace collapsed. Letters and numbers are
Unicode's ``L`` and ``N`` categories; combining marks count as punctuation. The Unicode tables
are those of ``tokenizers``: characters assigned in recent Unicode versions may be letters
here where an older Python dropped them.

The pipeline is a ``tokenizers.Tokenizer``: that normaliser, a whitespace split, a ``WordLevel``
model and a post-processor adding ``<bos>``/``<eos>``. Its vocabulary is the four special tokens
(``<pad>`` = 0, ``<bos>``, ``<eos>``, ``<unk>``) followed by every word seen at least
``min_freq`` times, most frequent first (ties alphabetically), so training twice on the same
captions gives the same ids. The special tokens are not "added tokens": a caption containing
the text ``<unk>`` is normalised to the word ``unk`` like any other text.

Saving: :meth:`WordTokenizer.to_json` is the pipeline's JSON, the form new checkpoints store;
:meth:`WordTokenizer.restore` reads it, or the plain vocabulary list that older checkpoints store.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Sequence

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from tokenizers.trainers import WordLevelTrainer

from vision_attn.errors import CheckpointError
from vision_attn.schema import limit

log = logging.getLogger("vision_attn")

__all__ = ["BOS", "EOS", "PAD", "SPECIAL_TOKENS", "UNK", "WordTokenizer", "caption_normalizer",
           "normalize_caption"]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# Python's str.lower rule for a final capital sigma (Unicode's Final_Sigma condition).
_FINAL_SIGMA = r"(?<=\p{Cased}\p{Case_Ignorable}*)\u03a3(?!\p{Case_Ignorable}*\p{Cased})"
_NOT_WORD = r"[^\p{L}\p{N}']+|_"  # punctuation, symbols, marks; apostrophes stay inside words
_LONE_APOSTROPHE = r"(^|\s)'+|'+(\s|$)"


def caption_normalizer() -> normalizers.Normalizer:
    """The ``tokenizers`` normaliser of captions (see the module docstring); its output still
    needs its whitespace collapsed (the tokenizer's whitespace split does that)."""
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.Replace(Regex(_FINAL_SIGMA), "\u03c2"),
        normalizers.Lowercase(),
        normalizers.Replace("\u2019", "'"),
        normalizers.Replace(Regex(_NOT_WORD), " "),
        normalizers.Replace(Regex(_LONE_APOSTROPHE), " "),
    ])


_NORMALIZER = caption_normalizer()
_PIPELINE_PARTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens")


def normalize_caption(text: str) -> str:
    """Lower-case ``text``, drop punctuation, collapse whitespace (``"A red, circle."`` -> ``"a red circle"``).

    Args:
        text: a caption.
    """
    return " ".join(_NORMALIZER.normalize_str(text).split())


def _pipeline(vocab: list[str]) -> Tokenizer:
    """The ``tokenizers`` pipeline of a checked vocabulary (special tokens first)."""
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=UNK))
    tok.normalizer = caption_normalizer()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, vocab.index(BOS)), (EOS, vocab.index(EOS))])
    return tok


def _check_vocab(vocab: list[str]) -> None:
    if tuple(vocab[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
        raise CheckpointError(
            f"a caption vocabulary must start with the special tokens {list(SPECIAL_TOKENS)}, "
            f"got {vocab[:4]}; was it written by vision_attn?"
        )
    if not all(isinstance(w, str) for w in vocab):
        bad = next(w for w in vocab if not isinstance(w, str))
        raise CheckpointError(f"the caption vocabulary holds {bad!r}, which is not a word")
    if len(set(vocab)) != len(vocab):
        dup = next(w for w, n in Counter(vocab).items() if n > 1)
        raise CheckpointError(f"the caption vocabulary lists the word {dup!r} twice")


class WordTokenizer:
    """Maps normalised words to ids and back (a ``tokenizers`` WordLevel pipeline inside).

    Args:
        vocab: the id -> word list; must start with :data:`SPECIAL_TOKENS`.
    """

    def __init__(self, vocab: Sequence[str]) -> None:
        vocab = list(vocab)
        _check_vocab(vocab)
        self._setup(vocab, _pipeline(vocab))

    def _setup(self, vocab: list[str], backend: Tokenizer) -> None:
        self.vocab = vocab
        self.index = {w: i for i, w in enumerate(vocab)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (self.index[t] for t in SPECIAL_TOKENS)
        self.backend = backend

    @classmethod
    def train(cls, captions: Iterable[str], min_freq: int = 1, max_size: int | None = None) -> WordTokenizer:
        """Build the vocabulary of ``captions`` (words seen at least ``min_freq`` times, at most
        ``max_size`` words besides the special tokens) with ``tokenizers``' WordLevel trainer."""
        backend = _pipeline(list(SPECIAL_TOKENS))
        # The trainer orders by count, then by word (code points), as the module docstring says.
        size = len(SPECIAL_TOKENS) + max_size if max_size is not None else 2**31 - 1
        trainer = WordLevelTrainer(vocab_size=size, min_frequency=max(min_freq, 0),
                                   special_tokens=list(SPECIAL_TOKENS), show_progress=False)
        backend.train_from_iterator(captions, trainer)
        # The trainer also registers its special tokens as "added tokens", matched in the raw
        # text; ours are plain vocabulary entries (see the module docstring): rebuild from the ids.
        ids = backend.get_vocab(with_added_tokens=False)
        return cls(sorted(ids, key=ids.__getitem__))

    # ------------------------------------------------------------------ saving
    def to_json(self) -> str:
        """The ``tokenizers`` JSON of the whole pipeline (what checkpoints store)."""
        return self.backend.to_str()

    @classmethod
    def from_json(cls, text: str) -> WordTokenizer:
        """The tokenizer of a ``tokenizers`` JSON written by :meth:`to_json`.

        Only the vocabulary is read: the text pipeline (normaliser, whitespace split, ``<bos>`` /
        ``<eos>``) is this module's, whatever the JSON holds (a warning when it holds another).

        Raises:
            CheckpointError: not such a JSON, not a WordLevel model, or a vocabulary that does
                not start with the special tokens, has gaps in its ids or exceeds
                ``VISION_ATTN_MAX_VOCAB`` words.
        """
        try:
            stored = json.loads(text)
        except (ValueError, RecursionError) as err:
            raise CheckpointError(f"the stored caption tokenizer is not a tokenizers JSON: {err}") from err
        model = stored.get("model") if isinstance(stored, dict) else None
        if not isinstance(model, dict) or model.get("type") != "WordLevel" or model.get("unk_token") != UNK:
            raise CheckpointError("the stored caption tokenizer is not a WordLevel model with <unk>; "
                                  "was it written by vision_attn?")
        ids = model.get("vocab")
        if not isinstance(ids, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids.values()):
            raise CheckpointError("the stored caption tokenizer's vocabulary is not a mapping of words to ids")
        if len(ids) > limit("vocab"):
            raise CheckpointError(f"the stored caption tokenizer has {len(ids)} words, over the limit of "
                                  f"{limit('vocab')} (VISION_ATTN_MAX_VOCAB)")
        vocab = sorted(ids, key=ids.__getitem__)
        if [ids[w] for w in vocab] != list(range(len(vocab))):
            raise CheckpointError("the stored caption tokenizer's word ids are not 0..V-1")
        tok = cls(vocab)  # the pipeline rebuilt: a stored normaliser or pre-tokenizer runs no rule of its own
        if any(stored.get(part) != json.loads(tok.to_json()).get(part) for part in _PIPELINE_PARTS):
            log.warning("the stored caption tokenizer's text pipeline differs from this version's; its vocabulary "
                        "is used with this version's normalisation")
        return tok

    @classmethod
    def restore(cls, saved: str | Sequence[str]) -> WordTokenizer:
        """The tokenizer a checkpoint stores: its ``tokenizers`` JSON (a string), or the plain
        vocabulary list of checkpoints written before the JSON."""
        return cls.from_json(saved) if isinstance(saved, str) else cls(saved)

    def __getstate__(self) -> dict:  # DataLoader workers pickle datasets holding the tokenizer
        return {"json": self.to_json()}

    def __setstate__(self, state: dict) -> None:
        saved = WordTokenizer.from_json(state["json"])
        self._setup(saved.vocab, saved.backend)

    # ------------------------------------------------------------------ use
    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """``[bos, w1, ..., wn, eos]``; unknown words map to ``<unk>``; with ``max_length`` the
        words are cut so the whole sequence (with bos and eos) fits."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
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
