"""The GGUF index (`jaxengine.models.gguf_loader`): a second open of a file reads its metadata and
tensor table from the index instead of parsing the file, and gives exactly what the reader gives.
"""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest

from jaxengine.models import gguf_header, gguf_loader
from jaxengine.tokenizer import Tokenizer


@pytest.fixture
def index_dir(tmp_path, monkeypatch):
  """A fresh index directory, and no file kept open in memory from earlier opens."""
  directory = tmp_path / "index"
  monkeypatch.setenv(gguf_loader.INDEX_DIR_ENV, str(directory))
  gguf_loader._open_cached.cache_clear()
  yield directory
  gguf_loader._open_cached.cache_clear()


@pytest.fixture
def small_gguf(tmp_path):
  """A GGUF file of a few fields and one tensor: for the tests of when an index is (re)built,
  which need a file, not the default model's (whose metadata takes seconds to parse)."""
  path = tmp_path / "small.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(2)
  writer.add_token_list(["<s>", "</s>", "a", "b"])
  writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(4, 3))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def _reopen(path):
  gguf_loader._open_cached.cache_clear()
  return gguf_loader.open_gguf(path)


def _assert_same_file(index, reader):
  """`index` (a `GGUFIndex`) holds exactly what `reader` (a `gguf.GGUFReader`) reads."""
  assert isinstance(index, gguf_loader.GGUFIndex)
  assert list(index.fields) == list(reader.fields)
  for key, field in reader.fields.items():
    assert index.fields[key].contents() == field.contents(), key
  assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
  for ours, theirs in zip(index.tensors, reader.tensors, strict=True):
    assert ours.tensor_type == theirs.tensor_type, ours.name
    assert ours.shape.tolist() == theirs.shape.tolist(), ours.name
    assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
    np.testing.assert_array_equal(ours.data, theirs.data)


def test_the_header_and_the_index_give_the_readers_metadata_and_tensors(index_dir):
  """The first open reads the header itself (`gguf_header.scan_gguf`, not the reader), the
  second the index it wrote: both give what `gguf.GGUFReader` gives."""
  path = gguf_loader.default_model_path()
  reader = gguf.GGUFReader(path)
  scanned = gguf_loader.open_gguf(path)
  assert len(list(index_dir.glob("*.json"))) == 1
  _assert_same_file(scanned, reader)
  index = _reopen(path)
  _assert_same_file(index, reader)
  assert gguf_loader.read_config(index) == gguf_loader.read_config(reader)


def test_the_header_scan_reads_every_value_type_and_tensor_layout(tmp_path):
  """Every metadata value type (scalars, strings, arrays of numbers, strings and arrays), an
  alignment of 64, and float, integer and block-quantized tensors: the scan's fields and
  tensor table are the reader's."""
  path = tmp_path / "types.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_custom_alignment(64)
  for i, kind in enumerate(["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64"]):
    writer.add_key_value(f"test.{kind}", i + 1, getattr(gguf.GGUFValueType, kind.upper()))
  writer.add_int64("test.int64", -(2**40))
  writer.add_float32("test.float32", 1e-5)
  writer.add_float64("test.float64", 1e-300)
  writer.add_bool("test.bool", True)
  writer.add_string("test.string", "naïve café")
  writer.add_array("test.ints", [1, -2, 3])
  writer.add_array("test.floats", [0.5, 1e-5])
  writer.add_array("test.strings", ["a", "", "ü"])
  rows = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
  writer.add_tensor("f32", rows)
  writer.add_tensor("f16", rows.astype(np.float16))
  writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(3, 2))
  q8 = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
  writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  reader = gguf.GGUFReader(str(path))
  scanned = gguf_header.scan_gguf(str(path))
  expected = gguf_loader.reader_index(reader)
  assert list(scanned["fields"]) == list(expected["fields"])
  for key, value in expected["fields"].items():
    assert scanned["fields"][key] == value and type(scanned["fields"][key]) is type(value), key
  assert scanned["tensors"] == expected["tensors"]
  _assert_same_file(gguf_loader.index_file(scanned, str(path)), reader)


def test_an_array_of_arrays_is_left_to_the_reader(index_dir, tmp_path):
  path = tmp_path / "nested.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_array("test.nested", [[1, 2], [3]])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.close()
  with pytest.raises(gguf_header.UnsupportedHeader):
    gguf_header.scan_gguf(str(path))
  expected = gguf.GGUFReader(str(path)).fields["test.nested"].contents()
  assert gguf_loader.open_gguf(path).fields["test.nested"].contents() == expected


def test_a_file_the_scan_does_not_read_is_left_to_the_reader(index_dir, tmp_path):
  """Not GGUF, another version, truncated: `scan_gguf` refuses (UnsupportedHeader) and
  `open_gguf` raises the reader's verdict as a ValueError naming the file."""
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(8))
  truncated = tmp_path / "truncated.gguf"
  truncated.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little"))
  for path in (junk, truncated, tmp_path / "plain.gguf"):
    if not path.exists():
      path.write_text("not a model")
    with pytest.raises(gguf_header.UnsupportedHeader):
      gguf_header.scan_gguf(str(path))
    with pytest.raises(ValueError, match=path.name):
      _reopen(path)


def test_a_tokenizer_from_the_index_encodes_and_renders_as_from_the_reader(index_dir):
  path = gguf_loader.default_model_path()
  text = "Hello, world! 12345 <|im_start|> naïve café"
  messages = [{"role": "user", "content": "What is 2 + 2?"}]
  from_reader = Tokenizer.from_gguf(path)
  _reopen(path)  # the index now exists and is what the next tokenizer reads
  from_index = Tokenizer.from_gguf(path)
  assert from_index.encode(text) == from_reader.encode(text)
  assert from_index.apply_chat_template(messages) == from_reader.apply_chat_template(messages)
  assert from_index.eos_token_id == from_reader.eos_token_id


def _index_version(index_file):
  try:
    return json.loads(index_file.read_text()).get("version")
  except ValueError:
    return None


def test_a_broken_or_stale_index_is_rebuilt_from_the_file(index_dir, small_gguf):
  path = small_gguf
  gguf_loader.open_gguf(path)
  (index_file,) = index_dir.glob("*.json")
  for broken in ("{not json", '{"version": -1}'):
    index_file.write_text(broken)
    opened = _reopen(path)
    assert opened.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "</s>", "a", "b"]
    assert _index_version(index_file) == gguf_loader.INDEX_VERSION  # rewritten by the open


def test_a_changed_file_gets_its_own_index(index_dir, small_gguf, tmp_path):
  copy = tmp_path / "copy.gguf"
  shutil.copyfile(small_gguf, copy)
  gguf_loader.open_gguf(copy)
  os.utime(copy, ns=(1, 1))  # another modification time: the old index no longer applies
  _reopen(copy)
  assert len(list(index_dir.glob("copy.gguf.*.json"))) == 2


def test_off_writes_no_index(tmp_path, monkeypatch):
  monkeypatch.setenv(gguf_loader.INDEX_DIR_ENV, "off")
  assert gguf_loader.index_dir() is None
  monkeypatch.delenv(gguf_loader.INDEX_DIR_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert gguf_loader.index_dir() == tmp_path / "jaxengine" / "gguf"


def test_tensors_are_dequantized_in_order_and_at_most_a_few_ahead(monkeypatch):
  """`load_gguf` places each tensor while the next ones dequantize on threads: the arrays come
  in the tensors' order, and no more than `DEQUANTIZE_AHEAD` are done or under way beyond the
  one the caller holds (a large model's float32 copies are not all alive at once)."""
  started: list[int] = []
  monkeypatch.setattr(gguf_loader, "_dequantize", lambda i: started.append(i) or np.full(2, i))
  taken = []
  for array in gguf_loader._dequantize_ahead(list(range(10))):
    taken.append(int(array[0]))
    assert len(started) <= len(taken) + gguf_loader.DEQUANTIZE_AHEAD
  assert taken == list(range(10)) and sorted(started) == taken
