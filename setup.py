# Kept for `pip install -e .` with older tooling; all metadata lives in pyproject.toml.
from setuptools import setup

setup()
