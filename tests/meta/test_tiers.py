"""The test tiers hold together: every test file lives in one layer's folder, every layer's marker is registered, and
the scripts that pick tests by path (CI's legs, the fast tier, the GPU check) name files and folders that exist."""

import pathlib
import re

from conftest import LAYERS

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def test_every_test_file_lives_in_a_layer_folder():
    outside = [str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py")
               if path.relative_to(TESTS).parts[0] not in LAYERS]
    assert not outside, f"test files outside the layer folders {sorted(LAYERS)}: {outside}"
    assert all((TESTS / folder).is_dir() for folder in LAYERS)


def test_every_layer_marker_is_registered():
    markers = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    registered = set(re.findall(r'^\s*"(\w+):', markers, re.M))
    assert set(LAYERS.values()) | {"slow", "model"} <= registered


def test_the_scripts_name_test_paths_that_exist():
    named = set()
    for script in (ROOT / "scripts").glob("*.sh"):
        named |= {(script.name, path) for path in re.findall(r"tests/[\w/*]+(?:\.py)?", script.read_text())}
    missing = [f"{script}: {path}" for script, path in sorted(named) if not list(ROOT.glob(path))]
    assert named and not missing, missing
