"""The project installs inside one `phaseserve` import package (setup.py maps the service folders into it),
so it shares a virtualenv with distributions whose top-level names match our folders': Hugging Face's
`kernels` (on transformers' optional paths) beside our kernels/. Both install into one virtualenv from their
wheels, no file of one is a file of the other, and both import from there."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HF_KERNELS = "kernels==0.17.2"


def run(*cmd, **kw) -> str:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def installed_files(site: Path, dist: str) -> set[str]:
    info = next(site.glob(f"{dist}-*.dist-info"))
    with open(info / "RECORD", newline="") as f:
        return {row[0] for row in csv.reader(f) if not row[0].startswith(info.name)}


def test_installs_beside_hugging_faces_kernels_and_both_import(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and *.egg-info there
    files = run("git", "ls-files", cwd=ROOT).split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    wheels = tmp_path / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src)
    run(sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, HF_KERNELS)
    ours, = wheels.glob("phaseserve-*.whl")
    theirs, = wheels.glob("kernels-*.whl")

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", theirs)
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    hf_init = (site / "kernels" / "__init__.py").read_bytes()
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", ours)

    theirs_files, ours_files = installed_files(site, "kernels"), installed_files(site, "phaseserve")
    assert not theirs_files & ours_files, sorted(theirs_files & ours_files)[:20]
    assert {f.split("/")[0] for f in ours_files if not f.startswith("../")} <= {"phaseserve", "bin"} | {
        f.split("/")[0] for f in ours_files if f.endswith(".dist-info/RECORD")}
    assert "phaseserve/kernels/__init__.py" in ours_files and "kernels/__init__.py" in theirs_files
    assert (site / "kernels" / "__init__.py").read_bytes() == hf_init  # not overwritten

    # the dependencies (torch, huggingface_hub, ...) from this environment, after the new one's own packages
    (site / "zz-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = run(python, "-c", "import kernels, phaseserve.kernels, phaseserve.gateway.app, phaseserve.stack.cli; "
                              "print(kernels.__file__); print(phaseserve.kernels.__file__); "
                              "print(hasattr(kernels, 'get_kernel'), hasattr(phaseserve.kernels, 'rms_norm'))",
                cwd=tmp_path).split()
    assert where == [str(site / "kernels" / "__init__.py"), str(site / "phaseserve" / "kernels" / "__init__.py"),
                     "True", "True"]
