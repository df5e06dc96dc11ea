"""Run the unit tests as configured in the [tool.c2test] table of the project file."""
import importlib, sys, tomllib

with open("pyproject.toml", "rb") as f:
    cfg = tomllib.load(f)["tool"]["c2test"]
sys.path.insert(0, ".")
importlib.import_module(cfg["module"])  # the code under test first, before unittest imports its own helpers
import unittest

suite = unittest.defaultTestLoader.discover(cfg["start-dir"], pattern=cfg["pattern"], top_level_dir=".")
if suite.countTestCases() == 0:
    sys.exit("no tests found")
result = unittest.TextTestRunner(verbosity=1).run(suite)
sys.exit(0 if result.wasSuccessful() else 1)
