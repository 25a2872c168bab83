"""The GGUF index (`jaxengine.models.gguf_loader`): a second open of a file reads its metadata and
tensor table from the index instead of parsing the file, and gives exactly what the reader gives.
"""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest

from jaxengine.models import gguf_loader
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


def test_the_index_gives_the_readers_metadata_and_tensors(index_dir):
  path = gguf_loader.default_model_path()
  reader = gguf_loader.open_gguf(path)
  assert isinstance(reader, gguf.GGUFReader)
  assert len(list(index_dir.glob("*.json"))) == 1
  index = _reopen(path)
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
  assert gguf_loader.read_config(index) == gguf_loader.read_config(reader)


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


def test_a_broken_or_stale_index_is_rebuilt_from_the_file(index_dir, small_gguf):
  path = small_gguf
  gguf_loader.open_gguf(path)
  (index_file,) = index_dir.glob("*.json")
  index_file.write_text("{not json")
  assert isinstance(_reopen(path), gguf.GGUFReader)
  assert isinstance(_reopen(path), gguf_loader.GGUFIndex)  # rewritten by the open above
  index_file.write_text('{"version": -1}')
  assert isinstance(_reopen(path), gguf.GGUFReader)


def test_a_changed_file_gets_its_own_index(index_dir, small_gguf, tmp_path):
  copy = tmp_path / "copy.gguf"
  shutil.copyfile(small_gguf, copy)
  gguf_loader.open_gguf(copy)
  os.utime(copy, ns=(1, 1))  # another modification time: the old index no longer applies
  assert isinstance(_reopen(copy), gguf.GGUFReader)
  assert len(list(index_dir.glob("copy.gguf.*.json"))) == 2


def test_off_writes_no_index(tmp_path, monkeypatch):
  monkeypatch.setenv(gguf_loader.INDEX_DIR_ENV, "off")
  assert gguf_loader.index_dir() is None
  monkeypatch.delenv(gguf_loader.INDEX_DIR_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert gguf_loader.index_dir() == tmp_path / "jaxengine" / "gguf"
