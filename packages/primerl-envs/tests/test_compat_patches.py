"""primerl's patches of other packages (primerl_envs.compat.PATCHES): each is written for a range
of its package's versions; this fails when the lock moves a package out of its range, so the
patch is looked at (still needed? still right?) rather than applied blind."""

import logging

import pytest
from primerl_envs import compat


@pytest.mark.parametrize("patch", compat.PATCHES, ids=lambda p: p.name)
def test_each_patch_covers_the_installed_version_of_its_package(patch):
    installed = patch.installed()
    assert patch.covers(installed), (
        f"{patch.name!r} was written for {patch.package} {patch.versions[0]} to before {patch.versions[1]}, "
        f"{installed} is installed: check it, then widen its versions or remove it ({patch.remove_when})"
    )
    assert patch.remove_when


@pytest.mark.parametrize(
    "version, covered",
    [
        ("2.13.9", False),
        ("2.14.0", True),
        ("2.14.4", True),
        ("2.14.10", True),
        ("2.15.0", False),
        ("2.15.0rc1", False),
        ("2.14.5.post1", True),
        ("3", False),
    ],
)
def test_versions_compare_by_their_numbers_not_their_text(version, covered):
    patch = compat.Patch("p", "pydantic", ("2.14.0", "2.15.0"), "never", lambda: None)
    assert patch.covers(version) is covered


def test_an_uncovered_version_warns_naming_the_patch_and_a_missing_target_fails_naming_it(monkeypatch, caplog):
    applied = []
    newer = compat.Patch("a patch", "pydantic", ("1.0", "1.1"), "pydantic does it itself", lambda: applied.append(1))
    monkeypatch.setattr(compat, "PATCHES", (newer,))
    monkeypatch.setattr(compat, "_installed", False)
    with caplog.at_level(logging.WARNING, logger="primerl.envs"):
        compat.install()
    assert applied == [1]
    assert "'a patch' was written for pydantic 1.0 to before 1.1" in caplog.text
    assert "remove it when pydantic does it itself" in caplog.text
    compat.install()  # once per process
    assert applied == [1]

    def gone():
        from pydantic._internal import _fields

        _fields.no_such_function  # noqa: B018 -- the target a newer pydantic removed

    monkeypatch.setattr(compat, "PATCHES", (compat.Patch("gone", "pydantic", ("0", "99"), "never", gone),))
    monkeypatch.setattr(compat, "_installed", False)
    with pytest.raises(RuntimeError, match=r"primerl patch 'gone' cannot be applied to pydantic .*AttributeError"):
        compat.install()
