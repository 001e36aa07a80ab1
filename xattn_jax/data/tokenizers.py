"""Tokenizers with one small interface: bytes, or a SentencePiece model trained on the training text.

Every tokenizer has ``pad_id = 0``, ``bos_id = 1``, ``eos_id = 2``; ``encode`` returns the text's ids
without BOS / EOS (batching adds them), and ``decode`` stops at the first EOS and skips pad and BOS,
so it can be fed a decoder's raw output row.
"""
from __future__ import annotations

import abc
import codecs
import collections
import functools
import hashlib
import io
import os
import random
import re
from collections.abc import Iterable, Sequence

import sentencepiece
from absl import logging

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# What ends a line in the files this project reads and writes (Python's text mode reads a lone \r as one too).
# Every text a model trains on is one line of a file, and generated texts are written one a line, so no id
# whose text holds one is ever generated (never_generated_ids).
LINE_BREAKS = "\n\r"


class Tokenizer(abc.ABC):
  """Text <-> token ids. ``vocab_size`` counts the special ids."""
  pad_id: int = PAD_ID
  bos_id: int = BOS_ID
  eos_id: int = EOS_ID

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids: every id is in ``range(vocab_size)``."""

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """The ids of ``text``, without BOS or EOS."""

  @abc.abstractmethod
  def _decode_ids(self, ids: list[int]) -> str:
    """Text of ids that hold no special id."""

  @abc.abstractmethod
  def id_to_piece(self, token_id: int) -> str:
    """A short readable label for one id (attention-map axes): a character, a piece or a byte."""

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """``encode`` of each text."""
    return [self.encode(text) for text in texts]

  @abc.abstractmethod
  def token_bytes(self, text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` each id of ``encode(text)`` stands for: they sum to ``len(text.encode())``
    (a tokenizer-independent unit to score a language model in: bits per byte)."""

  def decode(self, ids: Iterable[int]) -> str:
    """Text of ``ids`` up to the first EOS, with pad and BOS ids skipped. Accepts numpy rows."""
    kept = []
    for token_id in ids:
      token_id = int(token_id)
      if token_id == self.eos_id:
        break
      if token_id in (self.pad_id, self.bos_id):
        continue
      if not 0 <= token_id < self.vocab_size:
        raise ValueError(f"decode: id {token_id} is outside this tokenizer's vocabulary [0, {self.vocab_size})")
      kept.append(token_id)
    return self._decode_ids(kept)

  @property
  def never_generated_ids(self) -> tuple[int, ...]:
    """Ids a generated text never holds (`decoding.search`'s suppress_ids): padding, BOS and the ids whose text
    holds a line break (LINE_BREAKS: an answer written with one would take two lines of the output)."""
    return (self.pad_id, self.bos_id, *self._line_break_ids())

  def _line_break_ids(self) -> tuple[int, ...]:
    return ()

  def unknown_characters(self, texts: Iterable[str]) -> str:
    """The characters of `texts` this tokenizer has no id for, sorted (none here: every character has bytes)."""
    return ""

  def warn_unknown_characters(self, texts: Iterable[str], where: str, consequence: str = "") -> str:
    """Logs a warning naming the characters of `texts` without a piece (`where`: "the input lines", ...); a
    tokenizer's pieces come from its training text, and a character it never saw reads as the unknown piece,
    silently, so what the model reads is not what the user wrote. Returns them."""
    unknown = self.unknown_characters(texts)
    if unknown:
      logging.warning("%s hold characters the tokenizer has no piece for: %r; they read as its unknown piece "
                      "('\u2047')%s", where, unknown, consequence)
    return unknown

  def continuation(self, prompt_ids: Sequence[int], new_ids: Iterable[int]) -> str:
    """The text that `new_ids` add after the prompt's: decode(prompt + new) less decode(prompt).

    Decoding the new ids alone would lose what depends on what precedes them: SentencePiece drops the
    word-boundary space of a text's first piece ("my" + "friend ..." would read "myfriend ..."), and
    the bytes of one character may straddle the prompt's end.
    """
    prompt_ids = list(prompt_ids)
    prompt_text, full = self.decode(prompt_ids), self.decode(prompt_ids + list(new_ids))
    return full[len(prompt_text):] if full.startswith(prompt_text) else self.decode(new_ids)

  def _check_text(self, text) -> None:
    if not isinstance(text, str):
      raise ValueError(f"encode: text must be a str, got {type(text).__name__} {text!r:.80}")


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes shifted past the specials: byte b has id b + 3; vocab_size 259.

  Round-trips any string that UTF-8 can encode; ``decode`` replaces an invalid byte sequence (a
  model's mistake) with U+FFFD rather than raising.
  """
  _OFFSET = 3

  @property
  def vocab_size(self) -> int:
    return 256 + self._OFFSET

  def encode(self, text: str) -> list[int]:
    self._check_text(text)
    try:
      data = text.encode("utf-8")
    except UnicodeEncodeError as error:
      raise ValueError(f"encode: text is not encodable as UTF-8 ({error.reason} at {error.start}): {text!r:.80}") from None
    return [byte + self._OFFSET for byte in data]

  def _decode_ids(self, ids: list[int]) -> str:
    return bytes(token_id - self._OFFSET for token_id in ids).decode("utf-8", errors="replace")

  def continuation(self, prompt_ids: Sequence[int], new_ids: Iterable[int]) -> str:
    """As Tokenizer.continuation, less a last character whose bytes the continuation cut short (max_new_tokens
    reached within it): its first bytes are no text yet, where decode shows them as U+FFFD. An invalid sequence
    anywhere else (a model's mistake) still reads U+FFFD."""
    new_ids = list(new_ids)
    tail = []
    for token_id in reversed(new_ids):
      if not self._OFFSET <= token_id < self.vocab_size or len(tail) == 3:
        break
      tail.insert(0, token_id - self._OFFSET)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(bytes(tail), final=False)
    unfinished = len(decoder.getstate()[0])  # bytes held back: the start of a character, not yet complete
    return super().continuation(prompt_ids, new_ids[:len(new_ids) - unfinished])

  def _line_break_ids(self) -> tuple[int, ...]:
    return tuple(ord(character) + self._OFFSET for character in LINE_BREAKS)

  def token_bytes(self, text: str) -> list[int]:
    return [1] * len(self.encode(text))

  def id_to_piece(self, token_id: int) -> str:
    token_id = int(token_id)
    specials = {self.pad_id: "<pad>", self.bos_id: "<s>", self.eos_id: "</s>"}
    if token_id in specials:
      return specials[token_id]
    if not self._OFFSET <= token_id < self.vocab_size:
      raise ValueError(f"id_to_piece: id {token_id} is outside [0, {self.vocab_size})")
    byte = token_id - self._OFFSET
    return chr(byte) if 0x21 <= byte < 0x7F else f"<0x{byte:02X}>"


class SentencePieceTokenizer(Tokenizer):
  """A trained SentencePiece model; ids 0..3 are pad, BOS, EOS, unknown."""

  def __init__(self, model_path):
    model_path = os.fspath(model_path)
    if not os.path.isfile(model_path):
      raise ValueError(f"model_path {model_path!r} is not a SentencePiece model file")
    self.model_path = model_path
    try:
      self._processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
    except (RuntimeError, OSError) as error:
      raise ValueError(f"{model_path!r} is not a SentencePiece model this project can read "
                       f"({' '.join(str(error).split())}); delete it to train one there") from None
    ids = (self._processor.pad_id(), self._processor.bos_id(), self._processor.eos_id())
    if ids != (PAD_ID, BOS_ID, EOS_ID):
      raise ValueError(f"SentencePiece model {model_path!r} has (pad, bos, eos) ids {ids}; this project "
                       f"needs {(PAD_ID, BOS_ID, EOS_ID)} (train it with train_sentencepiece)")

  @property
  def vocab_size(self) -> int:
    return self._processor.get_piece_size()

  @property
  def unk_id(self) -> int:
    """The id of text the model has no piece for (a character absent from its training text)."""
    return self._processor.unk_id()

  @functools.cached_property
  def never_generated_ids(self) -> tuple[int, ...]:
    """Padding, BOS, the unknown piece (written out, it reads '⁇') and the pieces whose text holds a line break
    (byte fallback's <0x0A> and <0x0D>, a piece of a text that held one)."""
    breaks = tuple(piece_id for piece_id in range(self.vocab_size)
                   if any(character in LINE_BREAKS for character in self._piece_text(piece_id)))
    return (self.pad_id, self.bos_id, self.unk_id, *breaks)

  def _piece_text(self, piece_id: int) -> str:
    """The text one piece stands for ("" for the specials and unknown; a byte piece's byte as a character)."""
    if self._processor.is_byte(piece_id):
      return chr(int(self._processor.id_to_piece(piece_id)[3:5], 16))
    if self._processor.is_control(piece_id) or self._processor.is_unknown(piece_id):
      return ""
    return self._processor.id_to_piece(piece_id)

  def unknown_characters(self, texts: Iterable[str]) -> str:
    """The characters of `texts` that encode as unk_id where they stand, sorted (a character alone may have no
    piece yet belong to one: the "<" of a single-piece word "<image>"). The space always has a piece; other
    white space may not (a tab, a no-break space pasted from the web, the ideographic space U+3000)."""
    texts = list(texts)
    unknown = set()
    for text, ids in zip(texts, self.encode_batch(texts)):
      if self.unk_id in ids:  # where, from the pieces' spans (rare: the batch encode above is the cost)
        unknown.update(c for piece in self._processor.encode(text, return_type="proto").pieces
                       if piece.id == self.unk_id for c in piece.surface if c != " ")
    return "".join(sorted(unknown))

  def encode(self, text: str) -> list[int]:
    self._check_text(text)
    return self._processor.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    for text in texts:
      self._check_text(text)
    return self._processor.encode(list(texts))

  def _decode_ids(self, ids: list[int]) -> str:
    return self._processor.decode(ids)

  def token_bytes(self, text: str) -> list[int]:
    """Each piece's span of the text (identity normalization: offsets into its UTF-8 bytes). The word-boundary
    mark SentencePiece puts before a text's first piece spans nothing; an unknown piece spans its characters."""
    self._check_text(text)
    return [piece.end - piece.begin for piece in self._processor.encode(text, return_type="proto").pieces]

  def id_to_piece(self, token_id: int) -> str:
    token_id = int(token_id)
    if not 0 <= token_id < self.vocab_size:
      raise ValueError(f"id_to_piece: id {token_id} is outside [0, {self.vocab_size})")
    return self._processor.id_to_piece(token_id)


def _training_sample(texts: Sequence[str], limit: int) -> list[str]:
  """All texts, or a seeded random ``limit`` of them plus one text for each character the sample missed.

  Random, not strided: the corpus is periodic (source, target, next format, ...) and a stride can
  skip a whole side or format. The added texts make ``character_coverage=1.0`` cover every character.
  """
  if len(texts) <= limit:
    return list(texts)
  sample = [texts[i] for i in sorted(random.Random(0).sample(range(len(texts)), limit))]
  seen = set().union(*map(set, sample))
  for text in texts:
    unseen = set(text) - seen
    if unseen:
      sample.append(text)
      seen |= unseen
  return sample


# Byte fallback (as Llama's and Gemma's tokenizers): 256 byte pieces after the 4 specials spell in UTF-8
# whatever character has no piece of its own.
_BYTE_PIECES = 256
# The least vocab_size that leaves byte fallback room for 32 characters and 32 merges besides.
MIN_BYTE_FALLBACK_VOCAB = 4 + _BYTE_PIECES + 64
# The share of the text's characters kept as pieces under byte fallback (SentencePiece's default coverage).
_BYTE_FALLBACK_COVERAGE = 0.9995


def _byte_fallback_sample(sample: Sequence[str], vocab_size: int) -> tuple[list[str], int]:
  """The training texts for byte fallback, and how many characters they keep.

  Kept: the most frequent characters covering 99.95% of the text, at most half of the pieces left after
  the specials and the bytes (the other half are merges), and the space. The texts are cut at every other
  character, which is left out, so that no piece is learned across one (SentencePiece's own coverage
  cannot go below 0.98, which keeps thousands of characters of a CJK text).
  """
  counts = collections.Counter(c for text in sample for c in text)
  budget, threshold, taken = (vocab_size - 4 - _BYTE_PIECES) // 2, _BYTE_FALLBACK_COVERAGE * counts.total(), 0
  kept = {" "}
  for character, count in counts.most_common():
    if taken >= threshold or len(kept) >= budget:
      break
    kept.add(character)
    taken += count
  rare = f"[^{''.join(re.escape(c) for c in sorted(kept))}]+"
  return [piece for text in sample for piece in re.split(rare, text) if piece.strip()], len(kept)


class OtherTextsError(ValueError):
  """An existing SentencePiece model was trained on other texts than the ones given (train_sentencepiece)."""


def train_sentencepiece(texts: Sequence[str], model_path, *, vocab_size: int, exact: bool = True,
                        model_type: str = "bpe", max_sentences: int = 100_000,
                        single_piece_words: Sequence[str] = (), texts_must_match: bool = True,
                        retrain_unread: bool = False) -> SentencePieceTokenizer:
  """Trains a SentencePiece model on ``texts`` into ``model_path``; reuses the file if it exists.

  With ``exact=False``, ``vocab_size`` is a cap: the model gets as many pieces as the text supports,
  up to ``vocab_size`` (SentencePiece's ``hard_vocab_limit=False``, which trains the same pieces as
  asking for exactly that many), and a smaller size is logged.

  Reuse makes a resumed run tokenize exactly as the run it continues. A digest of the texts is kept beside the
  model (``<model_path>.texts``), and with ``texts_must_match`` a model trained on other texts is refused rather
  than reused (an earlier attempt in the same workdir that read another file, or a file changed since); a model
  without the digest (copied in, or written before it existed) is reused. Training is deterministic
  (one thread, no sampling inside SentencePiece: beyond ``max_sentences`` texts a seeded random
  subset is used, topped up so that every character occurs), so two runs on the same text write
  identical models.

  Settings chosen so that ``decode(encode(x)) == x`` for any text made of training characters:
  character coverage 1.0, the ``identity`` normalization (NFKC would rewrite e.g. no-break spaces
  that CLDR uses) and no whitespace collapsing. BPE is the default because it trains ~30x faster
  than unigram here (0.5 s vs ~15 s on 440k date strings).

  A text with more distinct characters than ``vocab_size`` can hold (a CJK corpus, source code with
  symbols from many scripts) gets byte fallback instead of an error, when ``vocab_size`` is at least
  ``MIN_BYTE_FALLBACK_VOCAB``: its most frequent characters are pieces (``_byte_fallback_sample``) and any
  other character, seen in training or not, is spelled by 256 UTF-8 byte pieces, so ``decode(encode(x))
  == x`` for every text. The choice is logged. A text whose characters fit trains as without it.

  Args:
    texts: training sentences (both sides of the corpus, for a shared vocabulary).
    model_path: where the ``.model`` file goes (inside the workdir); its folder is created.
    vocab_size: number of pieces, including the 4 special ones (with ``exact=False``, the most).
    exact: True: exactly ``vocab_size`` pieces or an error; False: as many as the text supports.
    model_type: ``bpe`` or ``unigram``.
    max_sentences: cap on the sentences given to the trainer.
    single_piece_words: words that are always one piece each where they start a text or follow a space
      (e.g. a multimodal model's "<image>"): SentencePiece user-defined symbols "\u2581word", so encoding
      the pieces of a text one by one, joined by single spaces, gives the ids of the whole text.
    texts_must_match: refuse an existing model whose digest names other texts (False: evaluation, or a resumed
      run, which keep the run's tokenizer whatever text they read).
    retrain_unread: an existing model this function wrote (its digest is there) that does not fit the arguments
      (the errors below) is trained again instead of refused: no model has read it yet (a run with no checkpoint:
      an attempt stopped before one, on another file or vocab_size, left it).

  Raises:
    ValueError: bad arguments; with ``exact``, a corpus too small for ``vocab_size`` (says the
      largest possible); a ``vocab_size`` below both the text's characters plus the specials and
      ``MIN_BYTE_FALLBACK_VOCAB``; an existing
      model file whose vocabulary size differs from ``vocab_size`` (with ``exact=False``: exceeds it), in
      which a ``single_piece_words`` word is not one piece, or (``texts_must_match``) trained on other texts.
  """
  model_path = os.fspath(model_path)
  if isinstance(single_piece_words, str) or any(not isinstance(w, str) or not w or any(c.isspace() for c in w)
                                                for w in single_piece_words):
    raise ValueError(f"single_piece_words must be a sequence of non-empty words without spaces, got "
                     f"{single_piece_words!r}")
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 8:
    raise ValueError(f"vocab_size must be an integer >= 8, got {vocab_size!r}")
  if not isinstance(exact, bool):
    raise ValueError(f"exact must be True or False, got {exact!r}")
  if model_type not in ("bpe", "unigram"):
    raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
  if os.path.exists(model_path):
    try:
      return _reuse(model_path, texts, vocab_size=vocab_size, exact=exact, single_piece_words=single_piece_words,
                    texts_must_match=texts_must_match)
    except ValueError as error:  # OtherTextsError too
      if not (retrain_unread and _read_digest(model_path)):
        raise
      logging.warning("%s: training it again (no model has read it yet)", str(error).split("; ")[0])
  if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
    raise ValueError(f"texts must be a non-empty sequence of strings, got {type(texts).__name__}")
  if isinstance(max_sentences, bool) or not isinstance(max_sentences, int) or max_sentences < 1:
    raise ValueError(f"max_sentences must be a positive integer, got {max_sentences!r}")
  sample = _training_sample(texts, max_sentences)
  for i, text in enumerate(sample):
    if not isinstance(text, str):
      raise ValueError(f"texts[{i}] must be a str, got {type(text).__name__}")

  def train(sample: Sequence[str], byte_fallback: bool) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sample), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        character_coverage=1.0, byte_fallback=byte_fallback, normalization_rule_name="identity",
        remove_extra_whitespaces=False, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=3, num_threads=1,
        shuffle_input_sentence=False, hard_vocab_limit=exact,
        user_defined_symbols=[f"\u2581{word}" for word in single_piece_words],
        # SentencePiece skips sentences over 4192 bytes by default, silently: their characters
        # would then be unknown pieces. Every sampled text is used, however long.
        max_sentence_length=max(4192, max((len(text.encode("utf-8")) for text in sample), default=0) + 1),
        minloglevel=2)
    return model.getvalue()

  try:
    try:
      model = train(sample, byte_fallback=False)
    except RuntimeError as error:
      needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(error))
      if not needed:
        raise
      if vocab_size < MIN_BYTE_FALLBACK_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} cannot hold every character of the training text plus the 4 "
                         f"special pieces: it needs at least {needed.group(1)}, or {MIN_BYTE_FALLBACK_VOCAB} to "
                         f"spell the rarer characters in UTF-8 bytes (byte fallback)") from None
      fallback_sample, kept = _byte_fallback_sample(sample, vocab_size)
      model = train(fallback_sample, byte_fallback=True)
      logging.info("SentencePiece: vocab_size=%d cannot hold all %d characters of the training text; its %d most "
                   "frequent are pieces and the others are spelled in UTF-8 bytes (byte fallback)", vocab_size,
                   int(needed.group(1)) - 4 - len(single_piece_words), kept)
  except RuntimeError as error:
    largest = re.search(r"value <= (\d+)", str(error))
    if largest:
      raise ValueError(f"vocab_size={vocab_size} is too large for this training text ({len(sample)} sentences): "
                       f"SentencePiece can build at most {largest.group(1)} pieces; lower vocab_size, or take it "
                       f"as a cap (exact=False)") from None
    raise ValueError(f"SentencePiece training failed for {model_path!r}: {error}") from None

  built = sentencepiece.SentencePieceProcessor(model_proto=model).get_piece_size()
  if built < vocab_size:
    logging.info("SentencePiece: the training text (%d sentences) supports %d pieces, below the cap "
                 "vocab_size=%d; the model has %d", len(sample), built, vocab_size, built)
  os.makedirs(os.path.dirname(model_path) or ".", exist_ok=True)
  # Write then rename, so an interrupted run never leaves a truncated model to be "reused"; the digest first,
  # so a model is never there without the digest of the texts it was trained on.
  for path, content in ((_digest_path(model_path), (_texts_digest(texts) + "\n").encode()), (model_path, model)):
    partial_path = f"{path}.partial.{os.getpid()}"
    with open(partial_path, "wb") as f:
      f.write(content)
    os.replace(partial_path, path)
  return SentencePieceTokenizer(model_path)


def _reuse(model_path: str, texts, *, vocab_size: int, exact: bool, single_piece_words, texts_must_match: bool
           ) -> SentencePieceTokenizer:
  """The existing model at model_path where it fits train_sentencepiece's arguments, else a ValueError saying why."""
  tokenizer = SentencePieceTokenizer(model_path)
  if tokenizer.vocab_size != vocab_size and (exact or tokenizer.vocab_size > vocab_size):
    asked = f"vocab_size={vocab_size} was asked" if exact else f"the cap is vocab_size={vocab_size}"
    raise ValueError(f"existing SentencePiece model {model_path!r} has vocab_size {tokenizer.vocab_size}, "
                     f"but {asked}; delete the file to retrain")
  split = [word for word in single_piece_words if len(tokenizer.encode(word)) != 1]
  if split:
    raise ValueError(f"existing SentencePiece model {model_path!r} does not keep {split} as one piece each "
                     f"(single_piece_words); delete the file to retrain")
  recorded = _read_digest(model_path)
  if texts_must_match and recorded and isinstance(texts, Sequence) and texts:
    digest = _texts_digest(texts)
    if digest != recorded:
      raise OtherTextsError(f"existing SentencePiece model {model_path!r} was trained on other text "
                            f"({recorded.split()[0]} texts, not these {digest.split()[0]}): an earlier run in this "
                            "workdir read another file, or the file changed since; delete the model (and any "
                            "checkpoints of the run) to train on this text, or use another workdir")
  return tokenizer


def _digest_path(model_path: str) -> str:
  return model_path + ".texts"


def _texts_digest(texts: Sequence[str]) -> str:
  """"<count> sha256:<hex>" of the texts, in order."""
  digest = hashlib.sha256()
  for text in texts:
    digest.update(text.encode("utf-8", errors="surrogatepass") + b"\0")
  return f"{len(texts)} sha256:{digest.hexdigest()}"


def _read_digest(model_path: str) -> str | None:
  """The digest kept beside a model, or None (a model copied in, or written before digests were kept)."""
  try:
    with open(_digest_path(model_path)) as f:
      return f.read().strip() or None
  except OSError:
    return None
