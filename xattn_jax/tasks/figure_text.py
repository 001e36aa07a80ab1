"""User-written text in figures (pieces, captions, file names): each character drawn by an installed font that has
it, or written as \\uXXXX where none has (empty boxes and a warning per glyph otherwise); shared by the tasks' plots."""
from __future__ import annotations

import functools

# Tried in order for each character (matplotlib font fallback); the CJK ones only where installed.
_FONTS = ("DejaVu Sans", "Noto Sans CJK JP", "Noto Sans CJK SC", "Noto Sans", "IPAexGothic", "IPAGothic",
          "Source Han Sans", "WenQuanYi Zen Hei", "Arial Unicode MS")
_POINTS = 7  # the size the fonts are looked up at (the plots' tick and axis labels)


@functools.cache
def installed_fonts():
  """(names, FT2Font objects) of the _FONTS matplotlib can find on this machine.

  Each FT2Font is of the file matplotlib itself draws that family from (font_manager.findfont, as
  its per-character fallback does), not of any file registered under the name: e.g. "DejaVu Sans"
  is both matplotlib's own DejaVuSans.ttf (with Arabic) and a system DejaVuSansCondensed-Oblique.ttf
  (without).
  """
  from matplotlib import font_manager, ft2font
  names, paths = [], []
  for name in _FONTS:
    try:
      path = font_manager.findfont(font_manager.FontProperties(family=name, size=_POINTS),
                                   fallback_to_default=False)
    except ValueError:  # family not installed
      continue
    names.append(name)
    if path not in paths:
      paths.append(path)
  # findfont may return a FontPath (a str with the face index in a .ttc collection).
  return names, [ft2font.FT2Font(path, face_index=getattr(path, "face_index", 0)) for path in paths]


def drawable(piece: str, fonts) -> str:
  """piece with every character no installed font can draw written as \\uXXXX (e.g. Japanese
  without a CJK font): a readable label instead of empty boxes and a warning per glyph."""
  return "".join(c if c.isspace() or any(font.get_char_index(ord(c)) for font in fonts) else f"\\u{ord(c):04x}"
                 for c in piece)


def drawable_text(text: str) -> tuple[str, list[str]]:
  """(text as drawable writes it with the fonts installed here, those fonts' family names): for any figure's
  user-written text (a VLM's prompt and caption), drawn with `fontfamily=` the names and `parse_math=False`
  (a '$' in it is a character, not mathtext: '$^$' raises at savefig)."""
  names, fonts = installed_fonts()
  return drawable(text, fonts), names
