"""The packages of a wheel or an install, found rather than listed: every package under gpg_vl/ (setuptools'
find_packages, so a new sub-package is never left out), and the built-in tasks of tasks/ as gpg_vl_tasks (the folder's
name is not its import name, which pyproject.toml's [tool.setuptools.packages.find] cannot map). Everything else is
in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["gpg_vl", "gpg_vl.*"]), "gpg_vl_tasks"], package_dir={"gpg_vl_tasks": "tasks"})
