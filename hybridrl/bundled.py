"""Where the data folders that ship with hybridrl live: `configs/` (YAML configs) and `launch/` (the sbatch
template and Ray start scripts a cluster user reads and edits).

In the source tree they are top-level folders next to the `hybridrl` package (the project's layout keeps
them there). A wheel installs them inside the package as `hybridrl/_bundled/configs` and
`hybridrl/_bundled/launch` (setup.py maps them), because nothing outside the package directory is
installed. This module is the one place that knows both spots.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# the sys.path entry hybridrl was imported from: a source checkout or site-packages
IMPORT_ROOT = PACKAGE_DIR.parent
BUNDLED = ("configs", "launch")


def bundled_dir(name: str) -> Path:
    """The folder `name` (configs | launch): the installed copy, else the source checkout's."""
    if name not in BUNDLED:
        raise ValueError(f"bundled folder {name!r} is unknown; choose one of {BUNDLED}")
    installed = PACKAGE_DIR / "_bundled" / name
    if installed.is_dir():
        return installed
    source = IMPORT_ROOT / name
    if source.is_dir():
        return source
    raise FileNotFoundError(f"hybridrl's {name}/ folder is missing (looked in {installed} and {source}); "
                            f"reinstall the package")


def source_checkout() -> Path | None:
    """The source checkout hybridrl runs from, or None for an installed wheel (no benchmarks/, tests/)."""
    return IMPORT_ROOT if (IMPORT_ROOT / "setup.py").is_file() and (IMPORT_ROOT / "hybridrl").is_dir() else None
