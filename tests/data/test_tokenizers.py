"""Tokenizers: exact round trips, special ids, and a SentencePiece model that is reproducible and reused."""
import logging
import os
import random
import re
import shutil

import pytest
from hypothesis import given, settings, strategies as st

from xattn_jax.data import dates, tokenizers


@pytest.fixture(scope="module")
def date_text():
  """Training and held-out date strings in English, French, German and Japanese."""
  train, held_out = [], []
  for locale in ("fr", "de", "ja"):
    pairs = dates.date_pairs(locale, first_year=1995, last_year=2004, eval_fraction=0.05)
    train += [text for pair in pairs.train for text in pair]
    held_out += [text for pair in pairs.eval for text in pair]
  return train, held_out


@pytest.fixture(scope="module")
def sentencepiece_model(date_text, tmp_path_factory):
  path = tmp_path_factory.mktemp("spm") / "dates.model"
  return tokenizers.train_sentencepiece(date_text[0], path, vocab_size=200)


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_byte_round_trip_of_any_unicode(text):
  tokenizer = tokenizers.ByteTokenizer()
  ids = tokenizer.encode(text)
  assert tokenizer.decode(ids) == text
  assert all(3 <= i < tokenizer.vocab_size for i in ids)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.sampled_from("dimanche novembre 29 ., \u00e9\u65e5\u2603\U0001F600\t"), max_size=40) | st.text())
def test_token_bytes_give_each_id_its_span_of_the_texts_utf8_bytes(sentencepiece_model, text):
  """Bits per byte divides by them: a text's leading word-boundary mark spans nothing, an unknown piece
  (here a snowman, an emoji, any character the dates never held) its characters' bytes."""
  for tokenizer in (sentencepiece_model, tokenizers.ByteTokenizer()):
    counts = tokenizer.token_bytes(text)
    assert len(counts) == len(tokenizer.encode(text)) and sum(counts) == len(text.encode())
    assert all(count >= 0 for count in counts)


def test_byte_decode_stops_at_eos_and_skips_pad_and_bos():
  tokenizer = tokenizers.ByteTokenizer()
  ids = tokenizer.encode("29 nov.")
  assert tokenizer.decode([tokenizer.bos_id] + ids[:3] + [tokenizer.pad_id] + ids[3:] + [tokenizer.eos_id]
                          + tokenizer.encode("junk")) == "29 nov."


def test_byte_pieces_label_specials_ascii_and_bytes():
  tokenizer = tokenizers.ByteTokenizer()
  assert [tokenizer.id_to_piece(i) for i in (0, 1, 2)] == ["<pad>", "<s>", "</s>"]
  assert [tokenizer.id_to_piece(i) for i in tokenizer.encode("a日")] == ["a", "<0xE6>", "<0x97>", "<0xA5>"]


def test_byte_encode_rejects_what_utf8_cannot_hold():
  with pytest.raises(ValueError, match="not encodable as UTF-8"):
    tokenizers.ByteTokenizer().encode("lone \ud800 surrogate")
  with pytest.raises(ValueError, match="text must be a str"):
    tokenizers.ByteTokenizer().encode(b"bytes")


def test_sentencepiece_round_trips_unseen_dates_in_every_locale(sentencepiece_model, date_text):
  held_out = date_text[1]
  assert any("年" in text for text in held_out) and any("März" in text or "Mai" in text for text in held_out)
  for text in held_out:
    assert sentencepiece_model.decode(sentencepiece_model.encode(text)) == text


def test_sentencepiece_has_the_shared_special_ids(sentencepiece_model):
  model = sentencepiece_model
  assert (model.pad_id, model.bos_id, model.eos_id, model.vocab_size) == (0, 1, 2, 200)
  ids = model.encode("dimanche 29 novembre 2026")
  assert min(ids) > 2
  assert model.decode([model.bos_id] + ids + [model.eos_id, 7, 9]) == "dimanche 29 novembre 2026"
  assert "".join(model.id_to_piece(i) for i in ids).replace("\u2581", " ").strip() == "dimanche 29 novembre 2026"


def test_sentencepiece_training_is_deterministic(sentencepiece_model, date_text, tmp_path):
  again = tokenizers.train_sentencepiece(date_text[0], tmp_path / "again.model", vocab_size=200)
  with open(sentencepiece_model.model_path, "rb") as first, open(again.model_path, "rb") as second:
    assert first.read() == second.read()


def test_existing_sentencepiece_model_is_reused_for_its_texts_and_refused_for_others(sentencepiece_model, date_text,
                                                                                     tmp_path):
  path = tmp_path / "dates.model"
  for suffix in ("", ".texts"):  # a copy: the fixture is shared
    shutil.copyfile(sentencepiece_model.model_path + suffix, str(path) + suffix)
  before = path.read_bytes()
  reused = tokenizers.train_sentencepiece(date_text[0], path, vocab_size=200)
  assert path.read_bytes() == before and reused.encode("29. Mai 2000") == sentencepiece_model.encode("29. Mai 2000")
  # An earlier attempt in the same workdir read another file: its model is refused, not silently reused ...
  with pytest.raises(tokenizers.OtherTextsError, match=rf"{len(date_text[0])} texts, not these 1\): an earlier run"):
    tokenizers.train_sentencepiece(["completely different text"], path, vocab_size=200)
  # ... but kept where the caller says any text goes (evaluation), and where no digest says what it was trained on
  # (a model copied in from another run, or written before digests were kept).
  assert tokenizers.train_sentencepiece(["other"], path, vocab_size=200, texts_must_match=False).vocab_size == 200
  os.remove(str(path) + ".texts")
  tokenizers.train_sentencepiece(["completely different text"], path, vocab_size=200)
  assert path.read_bytes() == before


def test_existing_model_with_another_vocab_size_raises(sentencepiece_model):
  with pytest.raises(ValueError, match="has vocab_size 200, but vocab_size=300"):
    tokenizers.train_sentencepiece(["x"], sentencepiece_model.model_path, vocab_size=300)


def test_unigram_model_also_round_trips(date_text, tmp_path):
  model = tokenizers.train_sentencepiece(date_text[0], tmp_path / "unigram.model", vocab_size=100,
                                         model_type="unigram", max_sentences=5000)
  assert all(model.decode(model.encode(text)) == text for text in date_text[1])


def test_subsampled_training_still_covers_every_character(date_text, tmp_path):
  model = tokenizers.train_sentencepiece(date_text[0], tmp_path / "few.model", vocab_size=100, max_sentences=30)
  assert all(model.decode(model.encode(text)) == text for text in date_text[1])


def test_vocab_smaller_than_the_alphabet_raises(date_text, tmp_path):
  with pytest.raises(ValueError, match="vocab_size=40 cannot hold every character.*at least 64"):
    tokenizers.train_sentencepiece(date_text[0], tmp_path / "tiny.model", vocab_size=40)


def test_vocab_too_large_for_corpus_raises_with_the_limit(tmp_path):
  with pytest.raises(ValueError, match=r"vocab_size=5000 is too large .* at most \d+ pieces"):
    tokenizers.train_sentencepiece(["abc def", "def ghi"], tmp_path / "small.model", vocab_size=5000)
  assert not (tmp_path / "small.model").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"vocab_size": 4}, "vocab_size must be an integer >= 8"),
    ({"vocab_size": 64, "model_type": "word"}, "model_type must be 'bpe' or 'unigram'"),
    ({"vocab_size": 64, "max_sentences": 0}, "max_sentences"),
    ({"vocab_size": 64, "exact": "no"}, "exact must be True or False"),
])
def test_bad_training_arguments_raise(tmp_path, kwargs, message):
  with pytest.raises(ValueError, match=message):
    tokenizers.train_sentencepiece(["abc"], tmp_path / "m.model", **kwargs)


def test_lines_longer_than_sentencepieces_default_limit_still_train_the_tokenizer(tmp_path):
  """SentencePiece drops sentences over 4192 bytes by default without a word: the characters of a
  long line then became one unknown piece."""
  texts = ["one two three", "four five", "greek letters " + "αβγδεζ" * 400]  # 4,814 bytes
  tokenizer = tokenizers.train_sentencepiece(texts, str(tmp_path / "spm.model"), vocab_size=40)
  assert tokenizer.decode(tokenizer.encode("αβγδεζ")) == "αβγδεζ"


def _largest_exact_size(texts, path):
  """The most pieces SentencePiece says it can build from texts (from the exact-size error)."""
  with pytest.raises(ValueError, match=r"at most \d+ pieces") as error:
    tokenizers.train_sentencepiece(texts, path, vocab_size=5000)
  return int(re.search(r"at most (\d+) pieces", str(error.value)).group(1))


def test_vocab_size_as_a_cap_takes_as_many_pieces_as_the_corpus_supports_and_logs_it(tmp_path, caplog):
  texts = [f"{n} cats and {n + 1} dogs" for n in range(50)]
  largest = _largest_exact_size(texts, tmp_path / "exact.model")
  with caplog.at_level(logging.INFO):
    model = tokenizers.train_sentencepiece(texts, tmp_path / "capped.model", vocab_size=5000, exact=False)
  assert model.vocab_size == largest < 5000
  assert any(f"supports {largest} pieces, below the cap vocab_size=5000" in r.getMessage() for r in caplog.records)
  assert all(model.decode(model.encode(text)) == text for text in texts)


def test_a_cap_the_corpus_can_fill_gives_the_same_pieces_as_that_exact_size(sentencepiece_model, date_text, tmp_path):
  capped = tokenizers.train_sentencepiece(date_text[0], tmp_path / "capped.model", vocab_size=200, exact=False)
  assert [capped.id_to_piece(i) for i in range(capped.vocab_size)] == [
      sentencepiece_model.id_to_piece(i) for i in range(200)]


def test_an_existing_model_within_the_cap_is_reused_and_one_above_it_refused(sentencepiece_model):
  reused = tokenizers.train_sentencepiece(["other text"], sentencepiece_model.model_path, vocab_size=300, exact=False,
                                          texts_must_match=False)
  assert reused.vocab_size == 200
  with pytest.raises(ValueError, match="has vocab_size 200, but the cap is vocab_size=100"):
    tokenizers.train_sentencepiece(["other text"], sentencepiece_model.model_path, vocab_size=100, exact=False)


def test_exact_vocab_size_too_large_still_fails_naming_the_size_and_the_cap_option(tmp_path):
  with pytest.raises(ValueError, match=r"vocab_size=5000 is too large .* at most \d+ pieces; .*exact=False"):
    tokenizers.train_sentencepiece(["abc def", "def ghi"], tmp_path / "m.model", vocab_size=5000, exact=True)


def test_a_cap_below_the_alphabet_still_fails(date_text, tmp_path):
  with pytest.raises(ValueError, match="vocab_size=40 cannot hold every character.*at least 64, or 324 .*bytes"):
    tokenizers.train_sentencepiece(date_text[0], tmp_path / "tiny.model", vocab_size=40, exact=False)


@pytest.fixture(scope="module")
def many_characters():
  """Texts over 1,500 CJK characters drawn by a Zipf law, as a Chinese or Japanese corpus has, plus spaces and
  Latin words: more characters than the pieces of a 1,024 vocabulary."""
  rng = random.Random(0)
  characters = [chr(0x4E00 + i) for i in range(1500)]
  weights = [1 / (rank + 1) for rank in range(1500)]
  return [f"{''.join(rng.choices(characters, weights, k=24))} text {n}" for n in range(2000)]


@pytest.mark.parametrize("exact", [False, True])
def test_a_vocab_below_the_alphabet_spells_the_rarer_characters_in_utf8_bytes(many_characters, tmp_path, caplog,
                                                                             exact):
  """A user's CJK corpus at the default vocab_size stopped here; now the most frequent characters are pieces
  and the others, even ones the training text never held, round-trip through byte pieces."""
  distinct = len(set("".join(many_characters)))
  assert distinct + 4 > 1024
  with caplog.at_level(logging.INFO):
    model = tokenizers.train_sentencepiece(many_characters, tmp_path / "m.model", vocab_size=1024, exact=exact)
  assert model.vocab_size == 1024
  assert all(model.decode(model.encode(text)) == text for text in many_characters)
  unseen = "snow \u2603, ga\u00eft\u00e9 \U0001F600"
  assert model.decode(model.encode(unseen)) == unseen and model.unknown_characters([unseen]) == ""
  assert model.unk_id not in model.encode(unseen + many_characters[0])
  for text in (unseen, many_characters[0], chr(0x4E00 + 1499) * 3):  # byte pieces: one byte each
    assert sum(model.token_bytes(text)) == len(text.encode()) and len(model.token_bytes(text)) == len(model.encode(text))
  frequent, rare = chr(0x4E00), chr(0x4E00 + 1499)  # ranks 1 and 1,500
  assert len(model.encode(frequent)) <= 2 and model.id_to_piece(model.encode(rare)[-1]).startswith("<0x")
  message = next(r.getMessage() for r in caplog.records if "byte fallback" in r.getMessage())
  kept = int(re.search(r"its (\d+) most frequent", message).group(1))
  assert f"cannot hold all {distinct} characters" in message and 32 <= kept <= (1024 - 260) // 2
  pieces = [model.id_to_piece(i) for i in range(model.vocab_size)]
  # Every kept character is one piece (the space as "\u2581"); half the pieces or more are merges.
  assert sum(len(piece) == 1 for piece in pieces) == kept
  assert sum(len(piece) > 1 and not piece.startswith("<") for piece in pieces) == 1024 - 260 - kept >= kept
  # A line break is spelled in bytes too, and never generated: an answer is written as one line.
  breaks = [pieces.index(piece) for piece in ("<0x0A>", "<0x0D>")]
  assert breaks[0] in model.encode("\n") and breaks[1] in model.encode("\r")
  assert model.never_generated_ids == (tokenizers.PAD_ID, tokenizers.BOS_ID, model.unk_id, *breaks)


def test_a_continuation_keeps_the_space_its_first_word_opens_with(sentencepiece_model):
  """decode(new ids) alone drops SentencePiece's word-boundary space: 'dimanche' + '29 ...' read
  'dimanche29 ...' in the LM's infer output."""
  prompt, new = sentencepiece_model.encode("dimanche"), sentencepiece_model.encode("29 novembre")
  assert sentencepiece_model.decode(new) == "29 novembre"  # what the old infer appended
  assert sentencepiece_model.continuation(prompt, new) == " 29 novembre"
  next_word = sentencepiece_model.encode("novembre")
  assert sentencepiece_model.continuation(sentencepiece_model.encode("29"), next_word) == " novembre"
  byte = tokenizers.ByteTokenizer()
  assert byte.continuation(byte.encode("caf"), byte.encode("é au lait")) == "é au lait"
  assert byte.continuation(byte.encode("x"), [byte.eos_id, *byte.encode("never")]) == ""


def test_a_byte_continuation_cut_within_its_last_character_leaves_that_character_out():
  """max_new_tokens reached within a character's bytes: the LM printed its first bytes as U+FFFD after the text
  (likely whenever the output is CJK). A byte that starts no character still reads U+FFFD."""
  byte = tokenizers.ByteTokenizer()
  prompt, new = byte.encode("ab"), byte.encode("c日本")  # 1 + 3 + 3 bytes
  assert [byte.continuation(prompt, new[:k]) for k in range(len(new) + 1)] == [
      "", "c", "c", "c", "c日", "c日", "c日", "c日本"]
  invalid = [0xFF + 3]  # byte 0xFF, never part of UTF-8
  assert byte.continuation(prompt, [*invalid, *byte.encode("c")]) == "\ufffdc"
  assert byte.continuation(prompt, [*byte.encode("c"), *invalid]) == "c\ufffd"


def test_unknown_characters_are_those_without_a_piece(sentencepiece_model, caplog, tmp_path):
  """The tasks warn with them: a user's input line, question or eval text holding them read as '⁇'."""
  assert sentencepiece_model.unknown_characters(["dimanche 29", "novembre"]) == ""
  assert sentencepiece_model.unknown_characters(["dimanche ☃", "€ novembre ☃"]) == "€☃"
  assert sentencepiece_model.unk_id in sentencepiece_model.encode("☃")
  with_word = tokenizers.train_sentencepiece(["<image> dimanche 29", "novembre <image>"] * 20, tmp_path / "w.model",
                                             vocab_size=40, exact=False, single_piece_words=("<image>",))
  assert with_word.unknown_characters(["<image> dimanche", "29 <image>"]) == ""  # "<" alone has no piece
  assert with_word.unknown_characters(["<image> <q>"]) == "<>q"
  with caplog.at_level(logging.WARNING):
    assert sentencepiece_model.warn_unknown_characters(iter(["dimanche 29"]), "the input lines") == ""
    assert not caplog.records
    assert sentencepiece_model.warn_unknown_characters(iter(["€ ☃ 29"]), "the input lines", "; more") == "€☃"
    assert tokenizers.ByteTokenizer().warn_unknown_characters(["€ ☃"], "the input lines") == ""
  [record] = caplog.records
  assert record.getMessage() == ("the input lines hold characters the tokenizer has no piece for: '€☃'; they read "
                                 "as its unknown piece ('⁇'); more")


def test_white_space_without_a_piece_is_named_with_the_unknown_characters(sentencepiece_model):
  """A tab or a no-break space the training text never held read as '⁇' without the warning: it left out all
  white space, though only the plain space always has a piece."""
  assert sentencepiece_model.unknown_characters(["dimanche\t29", "29\u00a0novembre \u3000"]) == "\t\u00a0\u3000"
  assert sentencepiece_model.unknown_characters(["  dimanche  29 "]) == ""


def test_the_ids_a_text_never_holds_are_padding_bos_the_unknown_piece_and_line_breaks(sentencepiece_model):
  assert sentencepiece_model.never_generated_ids == (tokenizers.PAD_ID, tokenizers.BOS_ID, sentencepiece_model.unk_id)
  byte_tokenizer = tokenizers.ByteTokenizer()
  assert byte_tokenizer.never_generated_ids == (tokenizers.PAD_ID, tokenizers.BOS_ID, *byte_tokenizer.encode("\n\r"))


def test_a_file_that_is_no_sentencepiece_model_is_named_with_the_fix(tmp_path):
  (tmp_path / "sentencepiece.model").write_bytes(b"not a model")
  with pytest.raises(ValueError, match=r"sentencepiece.model' is not a SentencePiece model .*delete it"):
    tokenizers.SentencePieceTokenizer(tmp_path / "sentencepiece.model")
