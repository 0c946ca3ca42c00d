"""Config loading: composition, overrides, validation errors, TOML round trip."""

from pathlib import Path

import msgspec
import pytest
from primerl_protocol.config import (
    Config,
    ConfigError,
    SharedConfig,
    field_docs,
    load_config,
    split_args,
    to_toml,
)


class Inner(Config):
    """A nested section."""

    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """Decay."""
    betas: tuple[float, float] = (0.9, 0.99)


class Section(Config):
    """A package's section."""

    name: str = "x"
    """A string key."""
    steps: int = 1
    inner: Inner = msgspec.field(default_factory=Inner)
    """A subsection."""
    items: list[Inner] = []


class Root(SharedConfig):
    section: Section = msgspec.field(default_factory=Section)
    """The section."""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def base(tmp_path):
    return write(tmp_path, "base.toml", '[model]\nname = "m"\n[section]\nsteps = 3\n[section.inner]\nlr = 0.5\n')


def test_files_compose_left_to_right_then_overrides(tmp_path, base):
    over = write(tmp_path, "over.toml", "seq_len = 64\n[section.inner]\nweight_decay = 0.1\n")
    cfg = load_config(Root, ["@", str(base), f"@{over}", "section.steps=7", "--section.inner.lr", "2e-5"])
    assert cfg.seq_len == 64
    assert cfg.section.steps == 7  # command line beats base.toml
    assert cfg.section.inner == Inner(lr=2e-5, weight_decay=0.1)  # tables merge key by key
    assert cfg.model.name == "m"


def test_later_file_wins(tmp_path, base):
    second = write(tmp_path, "b.toml", "[section]\nsteps = 9\n")
    assert load_config(Root, ["@", str(base), "@", str(second)]).section.steps == 9
    assert load_config(Root, ["@", str(second), "@", str(base)]).section.steps == 3


def test_string_keys_take_override_text_as_is(base):
    # "true" and "123" would parse as TOML bool/int; a str key gets the text itself.
    cfg = load_config(Root, ["@", str(base), "section.name=true", "model.name=123"])
    assert cfg.section.name == "true" and cfg.model.name == "123"


def test_list_overrides_parse_as_toml(base):
    cfg = load_config(Root, ["@", str(base), "section.inner.betas=[0.5, 0.6]"])
    assert cfg.section.inner.betas == (0.5, 0.6)


def test_misspelt_key_names_full_path_source_and_nearest_key(tmp_path, base):
    bad = write(tmp_path, "bad.toml", "[section.inner]\nweight_decy = 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(Root, ["@", str(base), "@", str(bad)])
    msg = str(err.value)
    assert "unknown key `section.inner.weight_decy`" in msg
    assert str(bad) in msg
    assert "did you mean `section.inner.weight_decay`?" in msg


def test_unknown_key_without_near_match_lists_valid_keys(base):
    with pytest.raises(ConfigError, match=r"unknown key `section.zzz` .* valid keys here: name, steps, inner, items"):
        load_config(Root, ["@", str(base), "section.zzz=1"])


def test_unknown_key_inside_array_of_tables(tmp_path, base):
    arr = write(tmp_path, "arr.toml", "[[section.items]]\nlr = 1.0\n[[section.items]]\nlrr = 2.0\n")
    with pytest.raises(
        ConfigError, match=r"unknown key `section.items\[1\].lrr`.*did you mean `section.items\[1\].lr`"
    ):
        load_config(Root, ["@", str(base), "@", str(arr)])


def test_wrong_type_names_key_expected_type_and_source(base):
    with pytest.raises(ConfigError) as err:
        load_config(Root, ["@", str(base), "section.steps=many"])
    msg = str(err.value)
    assert "config key `section.steps`" in msg
    assert "expected int, got str" in msg
    assert "command line `section.steps=many`" in msg


def test_wrong_type_in_file_names_the_file(tmp_path, base):
    bad = write(tmp_path, "bad.toml", '[section.inner]\nlr = "fast"\n')
    with pytest.raises(
        ConfigError, match=r"`section.inner.lr`: expected float, got str \(value 'fast' from .*bad.toml\)"
    ):
        load_config(Root, ["@", str(base), "@", str(bad)])


def test_constraint_violation(base):
    with pytest.raises(ConfigError, match=r"`seq_len`: expected int >= 1"):
        load_config(Root, ["@", str(base), "seq_len=0"])


def test_missing_required_key(tmp_path):
    empty = write(tmp_path, "e.toml", "")
    with pytest.raises(ConfigError, match=r"missing required key `model` \(a table \[model\]; required keys: name\)"):
        load_config(Root, ["@", str(empty)])


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        load_config(Root, ["@", str(tmp_path / "nope.toml")])


def test_invalid_toml_names_file_and_line(tmp_path):
    bad = write(tmp_path, "bad.toml", '[model]\nname = "m"\nseq_len = = 3\n')
    with pytest.raises(ConfigError, match=r"bad.toml: invalid TOML: .*line 3"):
        load_config(Root, ["@", str(bad)])


def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[model]\nname = "caf\u00e9"\n'.encode("latin-1"))  # e-acute: byte 19 (8 + 11), 0xe9
    with pytest.raises(ConfigError, match=r"latin1.toml: not UTF-8 text .*byte 19 is b'\\xe9'"):
        load_config(Root, ["@", str(latin1)])


@pytest.mark.parametrize(
    "args, message",
    [
        (["@"], "`@` must be followed by a config file path"),
        (["--section.steps"], "option `--section.steps` needs a value"),
        (["loose"], "cannot read argument 'loose'"),
        (["sec..tion=1"], "is not a dotted config key"),
    ],
)
def test_bad_arguments(args, message):
    with pytest.raises(ConfigError, match=message):
        split_args(args)


def test_setting_a_key_below_a_scalar_is_refused(base):
    with pytest.raises(ConfigError, match="`section.steps` is not a table"):
        load_config(Root, ["@", str(base), "section.steps.x=1"])


def test_dry_run_toml_loads_back_equal(tmp_path, base):
    arr = write(tmp_path, "arr.toml", "max_steps = 5\n[[section.items]]\nlr = 1.0\n")
    cfg = load_config(Root, ["@", str(base), "@", str(arr), "section.name=q"])
    dumped = write(tmp_path, "dumped.toml", to_toml(cfg))
    assert load_config(Root, ["@", str(dumped)]) == cfg


def test_shared_values_are_handed_down_by_projection(base):
    class TrainerOnly(SharedConfig):
        section: Section = msgspec.field(default_factory=Section)

    cfg = load_config(Root, ["@", str(base), "seq_len=128"])
    part = cfg.project(TrainerOnly)
    assert (part.seq_len, part.model, part.section) == (128, cfg.model, cfg.section)


def test_field_docs_come_from_the_source():
    docs = field_docs(Section)
    assert docs["name"] == "A string key."
    assert "steps" not in docs  # no docstring under it
    assert field_docs(Root)["seq_len"].startswith("Tokens in one packed training row")
