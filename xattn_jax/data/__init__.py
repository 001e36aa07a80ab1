"""Data for the models: bundled and user data sets, tokenizers and host-side numpy batching.

  dates.py       English -> target-locale date pairs from Babel's CLDR data, split by date
  files.py       the checks every reader of a user's UTF-8 line file shares (missing, UTF-16, bare \r)
  tsv.py         a user's parallel corpus (source<TAB>target), validated line by line
  text.py        a user's text file (one document per line) packed into next-token rows for a causal LM
  corpus.py      a bundled LM corpus generated from CLDR (Babel) and English number words
  splits.py      stable hash-based train / eval membership
  tokenizers.py  ByteTokenizer and a SentencePiece model trained into the workdir
  batching.py    TranslationBatches: deterministic train batches by step, buckets, packing, eval
  digits.py      scikit-learn's bundled 8x8 digits for the latent readers
  vlm_digits.py  image-to-text examples on strips of those digits (captions, questions, two images), split
                 by source image and by digit sequence; collate_images for batches of images
  image_text.py  a user's image_path<TAB>text pairs (PNG / JPEG through Pillow), validated line by line
"""
