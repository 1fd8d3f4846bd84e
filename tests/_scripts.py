"""Loading a file of scripts/ as a module, for the tests of its functions (scripts/ is not a
package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(filename: str) -> ModuleType:
    """``scripts/<filename>`` executed as module ``_az_<stem>`` (registered in sys.modules, which
    dataclasses defined in it look their module up in)."""
    spec = importlib.util.spec_from_file_location(f"_az_{Path(filename).stem}", SCRIPTS / filename)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod
