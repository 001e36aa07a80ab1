"""Translation: the encoder-decoder on bundled CLDR dates or a user's TSV corpus."""
