"""The packages' layout (everything else is in pyproject.toml).

The repository keeps one folder per service at its top (gateway/, scheduler/, workers/, kernels/) and the
composers in stack/; they install inside the one `phaseserve` import package (phaseserve.gateway, ...), so no
top-level name of ours can collide with another distribution's (Hugging Face's `kernels`, PyPI's
`scheduler`). pyproject.toml cannot map folders to dotted names by pattern, hence this file."""

from setuptools import find_packages, setup

MAPPED = ("gateway", "scheduler", "workers", "kernels", "stack")  # top-level folder -> phaseserve.<folder>

setup(
    packages=["phaseserve", *find_packages(include=["phaseserve.*"]),
              *(f"phaseserve.{p}" for folder in MAPPED for p in find_packages(include=[folder, f"{folder}.*"]))],
    package_dir={"phaseserve": "phaseserve", **{f"phaseserve.{folder}": folder for folder in MAPPED}},
)
