from setuptools import setup

# Metadata lives in pyproject.toml; this file only names the cffi build.
setup(cffi_modules=["src_c/build.py:ffibuilder"])
