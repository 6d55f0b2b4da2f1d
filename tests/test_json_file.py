"""json_file.read_json_file: configs and target specs are parsed as JSON, and every failure is one UserError line."""

import pytest

from dayzero import UserError
from dayzero.targets.json_file import read_json_file
from dayzero.targets.spec import load_target_spec
from dayzero.tools.capacity import load_config


def test_reads_json(tmp_path):
    (tmp_path / "c.json").write_text('{"a": [1, 2]}')
    assert read_json_file(tmp_path / "c.json", "config") == {"a": [1, 2]}


@pytest.mark.parametrize("text, needle", [(None, "config file not found: "), ("{oops", "cannot read JSON"),
                                          ("[" * 100_000, "cannot read JSON"), (b"\xff\xfe{", "cannot read JSON")])
def test_bad_files_are_one_line_user_errors(tmp_path, text, needle):
    p = tmp_path / "c.json"
    if isinstance(text, str):
        p.write_text(text)
    elif text is not None:
        p.write_bytes(text)
    with pytest.raises(UserError, match=needle) as e:
        read_json_file(p, "config")
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_config_and_target_spec_loaders_share_it(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(UserError, match=r"^config .*config\.json: cannot read JSON"):
        load_config(tmp_path)
    (tmp_path / "t.json").write_text("{oops")
    with pytest.raises(UserError, match=r"^target spec .*t\.json: cannot read JSON"):
        load_target_spec(tmp_path / "t.json")
