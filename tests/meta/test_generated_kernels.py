"""The generated kernel instantiations in csrc/cuda/generated/ are the ones scripts/generate_kernels.py writes: a
change to its lists (or a hand edit of a generated file) without regenerating fails here, not in a GPU session."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_kernels_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate_kernels.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_check_names_a_stale_file(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import generate_kernels
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(generate_kernels, "OUT", tmp_path)
    assert generate_kernels.main([]) == 0
    stale = tmp_path / "decode_fp16_h8.cu"
    stale.write_text(stale.read_text() + "// edited by hand\n")
    (tmp_path / "leftover.cu").write_text("")
    assert generate_kernels.main(["--check"]) == 1
    assert generate_kernels.main([]) == 0
    assert not (tmp_path / "leftover.cu").exists()
    assert generate_kernels.main(["--check"]) == 0
