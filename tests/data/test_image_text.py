"""A user's image-caption pairs: good files read, every malformed case refused naming file and line."""
import warnings

import numpy as np
import pytest
from PIL import Image

from xattn_jax.data import files, image_files
from xattn_jax.data.image_text import (ImageTextFormatError, fit_size, read_image_text_pairs, read_images,
                                       read_pair_texts)

CANVAS = (8, 32)


@pytest.fixture
def folder(tmp_path):
  """Two images next to where the pairs files go: a 16x32 dark-on-white PNG and a 10x10 white-on-black JPEG."""
  paper = np.full((16, 32), 255, np.uint8)
  paper[4:12, 4:12] = 0
  Image.fromarray(paper).save(tmp_path / "seven two.png")
  (tmp_path / "sub").mkdir()
  ink = np.zeros((10, 10, 3), np.uint8)
  ink[2:8, 2:8] = 255
  Image.fromarray(ink).save(tmp_path / "sub" / "one.jpg")
  (tmp_path / "broken.png").write_bytes(b"not an image")
  return tmp_path


def write(folder, data: bytes, name="pairs.tsv"):
  path = folder / name
  path.write_bytes(data)
  return path


def test_reads_pairs_in_order_with_paths_relative_to_the_file(folder, monkeypatch):
  monkeypatch.chdir("/")
  examples = read_image_text_pairs(write(folder, b"seven two.png\tseven two\r\nsub/one.jpg\t one \n\n"), canvas=CANVAS)
  assert [e.segments for e in examples] == [(("image", 0), ("target", "seven two")),
                                           (("image", 0), ("target", " one "))]
  assert {e.kind for e in examples} == {"user"}


def test_a_path_from_the_home_folder_is_read_there_as_an_infer_lines_is(folder, tmp_path_factory, monkeypatch):
  """`~/sub/one.jpg` was read as <the file's folder>/~/sub/one.jpg, 'does not exist'."""
  pairs_folder = tmp_path_factory.mktemp("pairs")
  monkeypatch.setenv("HOME", str(folder))
  (example,) = read_image_text_pairs(write(pairs_folder, b"~/sub/one.jpg\tone\n"), canvas=CANVAS)
  assert example.images[0].shape == (8, 8)


def test_a_path_written_from_the_current_directory_is_named_with_the_path_to_write(folder, monkeypatch):
  """`sub/one.jpg` in sub/pairs.tsv, run from the folder above: '.../sub/sub/one.jpg does not exist', no more."""
  monkeypatch.chdir(folder)
  with pytest.raises(ImageTextFormatError) as error:
    read_image_text_pairs(write(folder / "sub", b"sub/one.jpg\tone\nmissing.jpg\tnone\n"), canvas=CANVAS)
  first, second = (message for _, message in error.value.problems)
  assert first.endswith(f"(paths are relative to the pairs file's folder, {folder / 'sub'}; 'sub/one.jpg' is a file "
                        "from the current directory: write it as 'one.jpg')")
  assert second.endswith("does not exist")


def test_a_path_with_windows_backslashes_is_named_with_the_path_to_write(folder):
  with pytest.raises(ImageTextFormatError, match=r"sub\\\\one\.jpg' does not exist \(write 'sub/one\.jpg': folders "):
    read_image_text_pairs(write(folder, b"sub\\one.jpg\tone\n"), canvas=CANVAS)


def test_images_are_grey_ink_high_and_fit_the_canvas_keeping_aspect(folder):
  first, second = read_image_text_pairs(write(folder, b"seven two.png\ta\nsub/one.jpg\tb\n"), canvas=CANVAS)
  assert first.images[0].shape == (8, 16) and second.images[0].shape == (8, 8)
  image = first.images[0]
  assert image.dtype == np.float32 and 0.0 <= image.min() and image.max() <= 1.0
  assert image[3:5, 3:5].min() > 0.9 and image[:, 8:].max() < 0.1  # the dark square became ink


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_ink_on_a_transparent_background_is_ink(tmp_path, mode):
  """Transparent pixels are black in most icons: alpha was ignored and the image read as empty."""
  rgba = np.zeros((16, 32, 4), np.uint8)  # transparent black everywhere ...
  rgba[4:12, 4:12] = (0, 0, 0, 255)  # ... but an opaque black square
  image = Image.fromarray(rgba, "RGBA")
  if mode == "P":
    image = image.convert("P")
    image.info["transparency"] = image.getpixel((0, 0))
  else:
    image = image.convert(mode)
  image.save(tmp_path / "icon.png")
  [pixels] = read_images([tmp_path / "icon.png"], CANVAS)
  assert pixels[3:5, 3:5].min() > 0.9 and pixels[:, 8:].max() < 0.1


@pytest.mark.parametrize("depth", ["uint16", "int32", "float32", "float32 counts"])
def test_a_deep_image_is_scaled_from_its_own_range_not_clipped_to_8_bits(tmp_path, depth):
  """Pillow's 8-bit conversion clips: a 16-bit scan of a bright stroke on a mid-grey ground became all white,
  then all black once inverted; floats in [0, 1] became 0 or 1."""
  ground, stroke = {"uint16": (20_000, 60_000), "int32": (20_000, 60_000), "float32": (0.3, 0.9),
                    "float32 counts": (300.0, 900.0)}[depth]
  pixels = np.full((16, 32), ground, depth.split()[0])
  pixels[4:12, 4:12] = stroke
  path = tmp_path / ("scan.png" if depth == "uint16" else "scan.tif")
  Image.fromarray(pixels).save(path)
  [read] = read_images([path], CANVAS)
  assert read[3:5, 3:5].min() - read[:, 8:].max() > 0.5  # the stroke stands out from its ground


def test_a_transparent_value_of_a_16_bit_image_is_laid_on_white_as_an_8_bit_ones_is(tmp_path):
  """The 16-bit conversion dropped the tRNS value: the transparent ground read black, the picture inverted."""
  pixels = np.zeros((16, 32), np.uint16)  # a transparent 0 ground ...
  pixels[4:12, 4:12] = 1000  # ... under a dark stroke
  Image.fromarray(pixels).save(tmp_path / "deep.png", transparency=0)
  [read] = read_images([tmp_path / "deep.png"], CANVAS)
  assert read[3:5, 3:5].min() > 0.5 and read[:, 8:].max() < 0.1  # ink high on a white (then inverted) ground


def test_an_image_past_pillows_warning_limit_is_logged_naming_it(tmp_path, monkeypatch, caplog):
  """Pillow's DecompressionBombWarning printed its own source line, naming neither the file nor the line."""
  import logging
  caplog.set_level(logging.WARNING)
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400)  # the 16 x 32 image is over it but under twice it
  Image.fromarray(np.zeros((16, 32), np.uint8)).save(tmp_path / "big.png")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    image_files.open_image(str(tmp_path / "big.png"))
  assert any("big.png' is 32 x 16 pixels, past Pillow's warning limit" in r.getMessage() for r in caplog.records)


def test_12_bit_data_in_a_16_bit_file_is_scaled_from_0_4095(tmp_path):
  """A 12-bit scan stored in 16 bits read at most 15/255: nearly black."""
  pixels = np.full((16, 32), 200, np.uint16)
  pixels[4:12, 4:12] = 4000
  Image.fromarray(pixels).save(tmp_path / "scan.png")
  read = np.asarray(image_files.open_image(str(tmp_path / "scan.png")))
  assert read.max() == round(4000 / 4095 * 255) and read.min() == round(200 / 4095 * 255)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_an_image_holding_nan_or_infinite_pixels_is_refused(tmp_path, bad):
  """One NaN made the float range NaN and the whole image read as blank, with numpy's warning only."""
  pixels = np.full((16, 32), 0.2, np.float32)
  pixels[4:12, 4:12] = 0.9
  pixels[0, 0] = bad
  Image.fromarray(pixels).save(tmp_path / "scan.tif")
  with pytest.raises(ValueError, match=r"scan.tif' holds NaN or infinite pixel values \(1 of 512\)"):
    image_files.open_image(str(tmp_path / "scan.tif"))


def test_a_photos_exif_orientation_is_applied(tmp_path):
  """A phone photo stored sideways with an EXIF 'rotate 90' tag reads as a viewer shows it."""
  pixels = np.zeros((16, 32), np.uint8)
  pixels[:, :4] = 255  # a bright band along the stored image's left edge
  exif = Image.Exif()
  exif[0x0112] = 6  # orientation: the stored image turns 90 degrees clockwise to be seen upright
  Image.fromarray(pixels).save(tmp_path / "photo.jpg", exif=exif, quality=95)
  [read] = read_images([tmp_path / "photo.jpg"], (32, 32))
  assert read.shape == (32, 16)  # upright: taller than wide
  assert read[:3].mean() > 0.8 and read[8:].mean() < 0.2  # the left edge is now the top


def test_without_an_eval_file_a_share_of_the_images_is_held_out_every_pair_of_each(tmp_path):
  """One split for the three runs that read a pairs file: by image (relative to the file), stable when the folder
  moves, at least one image held out."""
  from xattn_jax.data import image_text
  lines = "".join(f"img{n}.png\tcaption {n}\nimg{n}.png\tanother caption {n}\n" for n in range(300))
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "pairs.tsv").write_text(lines)
  held = image_text.held_out_pairs(tmp_path / "a" / "pairs.tsv")  # (images need not exist to be split)
  assert all((2 * n in held) == (2 * n + 1 in held) for n in range(300))  # both pairs of an image
  assert 0.02 < len(held) / 600 < 0.1
  (tmp_path / "b" / "deeper").mkdir(parents=True)
  (tmp_path / "b" / "deeper" / "pairs.tsv").write_text(lines)
  assert image_text.held_out_pairs(tmp_path / "b" / "deeper" / "pairs.tsv") == held
  assert image_text.side_of_split(list(range(600)), tmp_path / "a" / "pairs.tsv", eval_side=True) == sorted(held)
  (tmp_path / "two.tsv").write_text("x.png\tone\ny.png\ttwo\n")
  assert len(image_text.held_out_pairs(tmp_path / "two.tsv")) == 1


def test_rgb_images_keep_three_channels(folder):
  [example] = read_image_text_pairs(write(folder, b"sub/one.jpg\tb\n"), canvas=CANVAS, grey=False)
  assert example.images[0].shape == (8, 8, 3)


@pytest.mark.parametrize("data, line_number, problem", [
    (b"seven two.png\ta\nno tab here\n", 2, "no tab"),
    (b"seven two.png\ta\tb\n", 1, "2 tabs"),
    (b"\tseven two\n", 1, "empty image path"),
    (b"seven two.png\ta\nsub/one.jpg\t  \n", 2, "empty text"),
    (b"seven two.png\ta\n\nsub/one.jpg\tb\n", 2, "blank line"),
    (b"seven two.png\tcaf\xe9\n", 1, "not valid UTF-8"),
    (b"seven two.png\ta\nmissing.png\tb\n", 2, "missing.png' does not exist"),
    (b"sub\ta\n", 1, "is not a regular file"),
    (b"seven two.png\ta\nbroken.png\tb\n", 2, "broken.png' cannot be read as an image"),
    (b"seven two.png\tlook at <image> here\n", 1, "holds '<image>', the language model's image marker"),
])
def test_malformed_line_raises_with_file_and_line_number(folder, data, line_number, problem):
  path = write(folder, data)
  with pytest.raises(ImageTextFormatError, match=problem) as caught:
    read_image_text_pairs(path, canvas=CANVAS)
  assert isinstance(caught.value, files.LineFileError)
  assert f"{path}:{line_number}: " in str(caught.value) and caught.value.line_number == line_number


def test_every_bad_line_is_reported_at_once(folder):
  path = write(folder, b"x\nmissing.png\ta\nseven two.png\tok\n\tb\n")
  with pytest.raises(ImageTextFormatError) as caught:
    read_image_text_pairs(path, canvas=CANVAS)
  assert [n for n, _ in caught.value.problems] == [1, 2, 4]


@pytest.mark.parametrize("data", [b"", b"\n \n"])
def test_empty_file_raises_naming_it(folder, data):
  path = write(folder, data)
  with pytest.raises(ImageTextFormatError, match=f"{path}: the file is empty"):
    read_image_text_pairs(path, canvas=CANVAS)


def test_missing_file_raises_naming_it(folder):
  with pytest.raises(ImageTextFormatError, match="nope.tsv: no such file"):
    read_image_text_pairs(folder / "nope.tsv", canvas=CANVAS)


def test_read_images_names_the_bad_path(folder):
  assert [i.shape for i in read_images([folder / "sub" / "one.jpg"], CANVAS)] == [(8, 8)]
  with pytest.raises(ValueError, match="broken.png"):
    read_images([folder / "sub" / "one.jpg", folder / "broken.png"], CANVAS)


@pytest.mark.parametrize("size, fitted", [((16, 32), (8, 16)), ((4, 4), (8, 8)), ((100, 10), (8, 1)),
                                          ((1, 100), (1, 32))])
def test_fit_size_keeps_aspect_inside_the_canvas(size, fitted):
  assert fit_size(size, CANVAS) == fitted


def test_the_text_side_is_read_without_opening_the_images_and_bad_lines_name_file_and_line(folder):
  assert read_pair_texts(write(folder, b"missing.png\ta cat\nbroken.png\t on a mat \n\n")) == ["a cat", " on a mat "]
  path = write(folder, b"x.png\tfine\nno tab\nx.png\t \n")
  with pytest.raises(ImageTextFormatError) as caught:
    read_pair_texts(path)
  assert [n for n, _ in caught.value.problems] == [2, 3] and f"{path}:2: " in str(caught.value)


def test_an_image_over_pillows_decompression_bomb_limit_is_a_file_and_line_error(folder, monkeypatch):
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)  # the 16 x 32 image is over twice that: Pillow's error
  path = write(folder, b"seven two.png\ta\n")
  with pytest.raises(ImageTextFormatError, match=r"pairs.tsv:1: image .*seven two.png' is too large to decode"):
    read_image_text_pairs(path, canvas=CANVAS)
