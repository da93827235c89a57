"""The rooms stay small and mapped: no source folder holds more than 20 modules, and docs/layout.md
names every module (and every room) of ``sim``, ``executor``, ``calibrate`` and ``gpipe``."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "executor", "calibrate", "gpipe")
MOST_MODULES = 20
LAYOUT_PAGE = ROOT / "docs" / "layout.md"


def source_folders() -> list[pathlib.Path]:
    return sorted({p.parent for package in PACKAGES for p in (ROOT / package).rglob("*.py")})


def test_no_folder_holds_more_than_twenty_modules():
    crowded = {str(folder.relative_to(ROOT)): n for folder in source_folders()
               if (n := len(list(folder.glob("*.py")))) > MOST_MODULES}
    assert crowded == {}


def test_every_room_is_a_package_that_says_what_it_holds():
    import ast

    for folder in source_folders():
        init = folder / "__init__.py"
        assert init.exists(), f"{folder.relative_to(ROOT)} has no __init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text()))
        assert docstring and docstring.strip(), f"{init.relative_to(ROOT)} says nothing of its room"


def test_the_layout_page_names_every_module_and_room():
    page = LAYOUT_PAGE.read_text()
    missing = [str(p.relative_to(ROOT)) for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(ROOT)}`" not in page]
    missing += [f"{folder.relative_to(ROOT)}/" for folder in source_folders()
                if f"`{folder.relative_to(ROOT)}/`" not in page]
    assert missing == []


def test_the_layout_page_names_no_module_that_is_gone():
    import re

    named = re.findall(r"`((?:sim|executor|calibrate|gpipe)/[a-z_/]+\.py)`", LAYOUT_PAGE.read_text())
    assert named and [path for path in named if not (ROOT / path).exists()] == []
