"""read_toml: a file that is missing, unreadable, not UTF-8 or not TOML is a TomlFileError naming the
problem, never another exception."""

from __future__ import annotations

import pytest

from servicekit.toml_file import TomlFileError, read_toml


def test_reads_a_table(tmp_path):
    (tmp_path / "a.toml").write_text('name = "x"\n[t]\nn = 1\n')
    assert read_toml(tmp_path / "a.toml") == {"name": "x", "t": {"n": 1}}


@pytest.mark.parametrize("content, problem", [
    (None, "file not found"),
    (b"name = \n", "not valid TOML"),
    (b'name = "\xff\xfe"\n', "not valid TOML: not UTF-8 text (byte 0xff at offset 8)"),
    (b"\xef\xbb\xbfname = 1\n", "not valid TOML"),  # a byte-order mark is not TOML either
])
def test_problems_are_named(tmp_path, content, problem):
    path = tmp_path / "a.toml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TomlFileError) as caught:
        read_toml(path)
    assert caught.value.problem.startswith(problem) and str(path) in str(caught.value)


def test_a_directory_cannot_be_read(tmp_path):
    with pytest.raises(TomlFileError, match="cannot read"):
        read_toml(tmp_path)
