"""Faults injected where the package writes or reads its files, and user mistakes on the command line: each ends
with the old state intact or the new one whole, and a clear message (fdc_ops.files, FDCArtifact.save and load,
calibration.save_or_keep, apps/eval.py's points, apps/cli.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from fdc_ops import artifact as artifacts
from fdc_ops import calibration, files
from fdc_ops.apps import cli
from fdc_ops.calibration import FDCArtifact
from tiny_models import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_artifact(seed: int) -> FDCArtifact:
    return calibration.calibrate(tiny_model("llama", seed=seed), text="random", num_tokens=64, seq_len=16, seed=seed,
                                 sensitivity_tokens=32, progress=False)


# A child process that saves a second artifact over the first and stops (until killed) at a chosen point of the save:
# "tensors" halfway through writing the new tensor file, "between" after it and before the JSON is replaced, "json"
# halfway through writing the new JSON.
SAVE_AND_STOP = textwrap.dedent("""
    import sys, time
    import fdc_ops.calibration as calibration
    from fdc_ops import files
    from tiny_models import tiny_model

    directory, where = sys.argv[1], sys.argv[2]
    artifact = calibration.calibrate(tiny_model("llama", seed=2), text="random", num_tokens=64, seq_len=16, seed=2,
                                     sensitivity_tokens=32, progress=False)
    original_atomically = files.write_atomically

    def stop():
        print("STOPPED", flush=True)
        time.sleep(600)

    def halfway(path, write):
        def partial(temporary):
            write(temporary)
            data = temporary.read_bytes()
            temporary.write_bytes(data[: len(data) // 2])
            stop()
        return original_atomically(path, partial)

    if where == "tensors":
        files.write_atomically = halfway
    elif where == "between":
        files.write_json_atomically = lambda *args, **kwargs: stop()
    else:
        files.write_text_atomically = lambda path, text: halfway(path, lambda temporary: temporary.write_text(text))
    artifact.save(directory)
""")


@pytest.mark.parametrize("where", ["tensors", "between", "json"])
def test_a_save_killed_at_any_point_leaves_the_old_artifact_whole(tmp_path, where):
    first = small_artifact(1)
    directory = first.save(tmp_path / "artifact")
    child = subprocess.Popen([sys.executable, "-c", SAVE_AND_STOP, str(directory), where], stdout=subprocess.PIPE,
                             text=True, cwd=os.path.join(ROOT, "tests"),
                             env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests")))
    try:
        assert child.stdout.readline().strip() == "STOPPED", "the child reached the point to be killed at"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    loaded = FDCArtifact.load(directory)  # the old artifact, whole
    assert torch.equal(loaded.qk_rotation, first.qk_rotation)
    assert loaded.metadata == first.metadata
    second = small_artifact(3)
    second.save(directory)  # and the next save goes through, leaving one tensor file and no temporary files
    assert torch.equal(FDCArtifact.load(directory).qk_rotation, second.qk_rotation)
    assert sorted(path.name for path in directory.iterdir() if not path.name.endswith(".partial")) == \
        sorted(["fdc_artifact.json", json.loads((directory / "fdc_artifact.json").read_text())["tensors_file"]])


def test_a_save_that_fails_leaves_the_old_artifact_and_no_temporary_file(tmp_path, monkeypatch):
    first = small_artifact(1)
    directory = first.save(tmp_path / "artifact")

    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_text_atomically", full_disk)
    with pytest.raises(OSError, match="No space left"):
        small_artifact(2).save(directory)
    monkeypatch.undo()
    assert torch.equal(FDCArtifact.load(directory).qk_rotation, first.qk_rotation)
    assert not [path for path in directory.iterdir() if path.name.endswith(".partial")]


def test_files_are_readable_as_the_umask_allows(tmp_path):
    previous = os.umask(0o022)
    try:
        directory = small_artifact(1).save(tmp_path / "artifact")
    finally:
        os.umask(previous)
    for path in directory.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path


def test_a_calibration_that_cannot_be_saved_where_asked_is_kept(tmp_path, monkeypatch):
    model = tiny_model("qwen2", seed=4)
    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("not a directory")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    with pytest.warns(RuntimeWarning, match=r"could not be saved to .*cache-is-a-file.*; it was saved to "
                                            r".*fdc_ops-artifacts") as caught:
        artifact = calibration.load_or_calibrate(model, text="random", num_tokens=32, seq_len=16,
                                                 sensitivity_tokens=0, directory=blocked / "artifacts",
                                                 progress=False)
    fallback = next((tmp_path / "tmp" / "fdc_ops-artifacts").iterdir())
    assert str(fallback) in str(caught[0].message)
    assert torch.equal(FDCArtifact.load(fallback, model=model).qk_rotation, artifact.qk_rotation)
    monkeypatch.setattr("tempfile.tempdir", str(blocked))  # the fallback is blocked too: kept in memory, said so
    with pytest.warns(RuntimeWarning, match=r"kept in memory only: save it with artifact.save\(directory\)"):
        again = calibration.load_or_calibrate(model, text="random", num_tokens=32, seq_len=16, sensitivity_tokens=0,
                                              seed=1, directory=blocked / "artifacts", progress=False)
    assert isinstance(again, FDCArtifact)


@pytest.mark.parametrize("damage", ["invalid field", "hand edit", "truncated", "tensors gone"])
def test_a_damaged_cache_entry_is_recalibrated(tmp_path, damage, capsys):
    model = tiny_model("mistral", seed=5)
    settings = dict(text="random", num_tokens=32, seq_len=16, sensitivity_tokens=0, directory=tmp_path,
                    progress=False)
    first = calibration.load_or_calibrate(model, **settings)
    (entry,) = tmp_path.iterdir()
    path = entry / artifacts.METADATA_FILE
    metadata = json.loads(path.read_text())
    if damage == "invalid field":
        metadata["shape"]["head_dim"] = "16"
        metadata["checksum"] = artifacts._metadata_checksum(metadata)
        path.write_text(json.dumps(metadata))
    elif damage == "hand edit":
        path.write_text(json.dumps({**metadata, "fingerprint": "0" * 64}))
    elif damage == "truncated":
        path.write_text(path.read_text()[:100])
    else:
        (entry / metadata["tensors_file"]).unlink()
    healed = calibration.load_or_calibrate(model, **settings)
    assert "recalibrating: the artifact in" in capsys.readouterr().out
    assert torch.equal(healed.qk_rotation, first.qk_rotation)  # the same settings calibrate the same artifact
    assert torch.equal(FDCArtifact.load(entry, model=model).qk_rotation, first.qk_rotation)  # and the entry is whole


def test_eval_points_that_do_not_parse_are_set_aside_not_fatal(tmp_path, capsys):
    from fdc_ops.apps import eval as eval_app

    path = tmp_path / "smollm2-eval-perplexity-points.json"
    files.write_json_atomically(path, {"settings": {}, "base": 0.5, "points": {}})
    assert eval_app._read_points(path)["base"] == 0.5
    path.write_text('{"settings": {}, "base": 0.5, "poi')  # damaged outside the program
    assert eval_app._read_points(path) == {}
    assert "could not be resumed from" in capsys.readouterr().out
    assert (tmp_path / (path.name + ".unreadable")).is_file() and not path.exists()


@pytest.mark.parametrize("arguments,message", [
    (["ops-demo", "--removal-rate", "2"], "argument --removal-rate: 2 is not in [0.0, 1.0]"),
    (["ops-demo", "--removal-rate", "nan"], "argument --removal-rate: 'nan' is not a finite number"),
    (["eval", "--eval-tokens", "256"], "argument --eval-tokens: 256 is below 512"),
    (["eval", "--grid", "0.1", "1.5"], "argument --grid: 1.5 is not in [0.0, 1.0)"),
    (["calibrate", "--model", "/nonexistent", "--out", "OUT"],
     "argument --model: /nonexistent is not a Hugging Face model directory"),
    (["calibrate", "--out", "FILE"], "argument --out: FILE exists and is not a directory"),
    (["demo", "--context", "0"], "argument --context: 0 is below 1"),
])
def test_command_line_mistakes_end_with_a_message_and_status_2_before_any_model_loads(tmp_path, arguments, message):
    (tmp_path / "FILE").write_text("")
    arguments = [str(tmp_path / a) if a in ("OUT", "FILE") else a for a in arguments]
    message = message.replace("FILE", str(tmp_path / "FILE"))
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "fdc_ops", *arguments], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    imports = [line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")]
    errors = "\n".join(line for line in lines if not line.startswith("import time:"))
    assert message in errors and "Traceback" not in errors, errors
    assert not result.stdout, "nothing ran"
    assert "fdc_ops.apps.cli" in imports and "torch" not in imports, "the arguments are checked before torch loads"


def test_the_command_lines_help_imports_no_torch():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "fdc_ops", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "python -m fdc_ops demo" in result.stdout, result.stderr
    imports = [line.rpartition("|")[2].strip() for line in result.stderr.splitlines()]
    assert "fdc_ops.apps.cli" in imports and "torch" not in imports


def test_a_missing_plotting_package_is_reported_before_work_starts(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(sys, "argv", ["python -m fdc_ops", "eval"])
    monkeypatch.setattr(cli, "_run", lambda args: pytest.fail("the command ran"))
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 2
    assert "eval draws its plots with matplotlib, which is not installed" in capsys.readouterr().err


def test_ctrl_c_ends_with_one_line_and_status_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["python -m fdc_ops", "eval"])
    monkeypatch.setattr(cli, "_run", interrupted)
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 130
    error = capsys.readouterr().err.strip()
    assert error.splitlines() == ["python -m fdc_ops eval: interrupted; the points measured so far are kept, and the "
                                  "next run resumes from them"]


def test_the_bundled_artifact_has_a_name(tmp_path):
    import fdc_ops.vllm

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    overrides = fdc_ops.vllm.hf_overrides(model, "bundled", compression=0.1)
    assert overrides["fdc"]["artifact"] == str(calibration.bundled_artifact().resolve())
    from fdc_ops import hf
    from fdc_ops.hf import loading

    smollm2, _ = loading.load_model()
    allocation = hf.compress(smollm2, "bundled", compression=0.1)
    assert allocation.compression_rate >= 0.1 - 1e-9  # the budget, up to float rounding
