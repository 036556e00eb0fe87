"""Import every dpar module and name each that fails: a quick check of a torch release dpar was not run on."""

import importlib
import pkgutil
import sys
import traceback

import dpar

failed = 0
for module in pkgutil.walk_packages(dpar.__path__, "dpar."):
    try:
        importlib.import_module(module.name)
    except Exception:  # report each and go on
        failed += 1
        print(f"{module.name}: {traceback.format_exc().splitlines()[-1]}")
print(f"{failed} of dpar's modules failed to import")
sys.exit(1 if failed else 0)
