"""Reading a user's image files: one decoder for the VLM's pairs, the pairs encoder and the digit readers' inference.

  * Anything Pillow opens (PNG, JPEG, TIFF, ...), grey-scale ("L") or RGB.
  * A photo's EXIF orientation is applied, so it reads as a viewer shows it.
  * A 16-bit, 32-bit or floating-point image is scaled from its type's range (`_eight_bit`): Pillow's 8-bit
    conversion clips (a 16-bit scan with a mid-grey ground came out 99.6% white).
  * A transparent image is laid on white first: transparent pixels carry arbitrary colour (often black, as the
    ink is), so ink on a transparent background would read as an empty image.
  * `ink_high`: a mostly light image (dark ink on paper) is inverted, so ink is high as in the bundled digits.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
from absl import logging


class _PixelError(ValueError):
  """An image whose pixel values cannot be drawn."""


def _eight_bit(image):
  """A single-channel 16-bit, 32-bit integer or float image as 8-bit grey: 16-bit data over the smallest of
  0-4095 (12-bit data, as cameras and scanners store it in 16) and 0-65535 that holds them, 32-bit integers over
  the smallest of 0-255, 0-65535 and 0-2^31-1, floats in [0, 1] as they are, other floats stretched from their
  minimum to their maximum. A transparent value (a PNG's tRNS) becomes white, as a transparent pixel is laid on
  white paper. NaN or infinite pixels are refused (ValueError)."""
  from PIL import Image

  pixels = np.asarray(image, np.float64)
  transparent = pixels == image.info["transparency"] if isinstance(image.info.get("transparency"), int) else None
  if not np.isfinite(pixels).all():  # one NaN made the range NaN, and the whole image read as blank
    raise _PixelError(f"holds NaN or infinite pixel values ({np.size(pixels) - np.isfinite(pixels).sum()} of "
                      f"{np.size(pixels)})")
  if image.mode == "F":
    low, high = (0.0, 1.0) if pixels.min() >= 0 and pixels.max() <= 1 else (pixels.min(), pixels.max())
  else:
    depths = (12, 16) if image.mode.startswith("I;16") else (8, 16, 31)
    bits = next(b for b in depths if pixels.max() < 2 ** b)
    low, high = 0.0, 2.0 ** bits - 1
  scaled = (pixels - low) / max(high - low, 1e-12)
  if transparent is not None:
    scaled[transparent] = 1.0
  return Image.fromarray(np.round(np.clip(scaled, 0.0, 1.0) * 255).astype(np.uint8), "L")


def open_image(path: str, *, grey: bool = True):
  """The image file at `path` as a Pillow image of mode "L" (grey) or "RGB", decoded as the module says.

  Raises OSError (missing or not a file) or ValueError (not an image Pillow can read, or one over Pillow's
  decompression-bomb limit of pixels), saying which.
  """
  from PIL import Image, ImageOps, UnidentifiedImageError  # Pillow only where a user's images are read

  if not os.path.exists(path):
    raise OSError(f"image {path!r} does not exist")
  if not os.path.isfile(path):
    raise OSError(f"image {path!r} is not a regular file")
  try:
    with warnings.catch_warnings(record=True) as said:  # Pillow's own warning would name neither file nor line
      warnings.simplefilter("always", Image.DecompressionBombWarning)
      with Image.open(path) as opened:
        opened.load()
        if any(issubclass(w.category, Image.DecompressionBombWarning) for w in said):
          logging.warning("image %r is %d x %d pixels, past Pillow's warning limit for untrusted files: decoding "
                          "it takes time and memory before it is fitted to the canvas", path, *opened.size)
        image = ImageOps.exif_transpose(opened)
        if image.mode in ("I", "F") or image.mode.startswith("I;16"):
          image = _eight_bit(image)  # lays a transparent value on white itself
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
          white = Image.new("RGBA", image.size, (255, 255, 255, 255))
          image = Image.alpha_composite(white, image.convert("RGBA"))
        return image.convert("L" if grey else "RGB")
  except _PixelError as error:
    raise ValueError(f"image {path!r} {error}") from None
  except Image.DecompressionBombError as error:  # an Exception of its own, not an OSError
    raise ValueError(f"image {path!r} is too large to decode ({error}); shrink it, or raise Pillow's "
                     "PIL.Image.MAX_IMAGE_PIXELS where you trust the file") from None
  except (UnidentifiedImageError, OSError, ValueError) as error:
    raise ValueError(f"image {path!r} cannot be read as an image ({type(error).__name__}: {error})") from None


def ink_high(pixels: np.ndarray) -> np.ndarray:
  """float32 pixels in [0, 1], inverted if mostly light (dark ink on paper), so that ink is high."""
  return (1.0 - pixels if pixels.mean() > 0.5 else pixels).astype(np.float32)


def read_image(path: str, *, grey: bool = True) -> np.ndarray:
  """One image file -> float32 [h, w] (grey) or [h, w, 3] in [0, 1] at its own size, ink high."""
  return ink_high(np.asarray(open_image(path, grey=grey), np.float32) / 255.0)
