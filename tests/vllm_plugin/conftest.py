"""The vLLM plugin's tests run in .venv-vllm (vLLM's CPU build pins its own torch: scripts/setup_vllm.sh), where
fdc_ops is an installed copy whose extension is built against that torch. Anywhere else they skip, saying so."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest

from .vllm_engines import KV_CACHE_GIB

REPOSITORY = Path(__file__).resolve().parents[2]
SKIP_REASON = ("vLLM is not installed in this environment: the plugin tests run in .venv-vllm "
               "(scripts/setup_vllm.sh makes it; scripts/test.sh runs them there)")


def quick_benchmark_report(script: str, tmp_path: Path, kind: str) -> tuple[dict, str]:
    """Runs bench/<script> --quick as documented (PYTHONSAFEPATH: the installed fdc_ops), its JSON into tmp_path;
    returns the one report named *-<kind>-quick-*.json and what the script printed."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    result = subprocess.run([sys.executable, str(REPOSITORY / "bench" / script), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (written,) = tmp_path.glob(f"*-{kind}-quick-*.json")
    return json.loads(written.read_text()), result.stdout


def vllm_installed() -> bool:
    """Whether the real vLLM is importable (its spec has a file: a namespace package, such as a folder named vllm on
    sys.path, has none)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)  # finally blocks and atexit run: servers the tests started are stopped


def pytest_configure(config):
    """SIGTERM (a CI timeout, `kill`) and SIGHUP end the run like an error would, so nothing it started outlives it
    (vllm_engines.start_server)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)


def pytest_collection_modifyitems(config, items):
    if vllm_installed():
        import fdc_ops

        location = Path(fdc_ops.__file__).resolve()
        if location.parent == REPOSITORY / "fdc_ops":
            raise pytest.UsageError(
                f"fdc_ops was imported from the checkout ({location}), whose extension is built for the main "
                "environment's torch; run the plugin tests with `PYTHONSAFEPATH=1 python -m pytest` (no current "
                "directory on sys.path, in pytest and in the processes vLLM starts) so that .venv-vllm's installed "
                "copy is used, as scripts/test.sh does")
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="module", autouse=True)
def engine_environment():
    """vLLM reads these when an engine starts: the KV cache size on CPU, and the engine core in this process (one
    process instead of three per engine). PYTHONSAFEPATH: vLLM inspects model classes in a subprocess started in the
    current directory, which must not put the checkout's fdc_ops (its _C built for another torch) on sys.path."""
    names = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "PYTHONSAFEPATH")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["PYTHONSAFEPATH"] = "1"
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
