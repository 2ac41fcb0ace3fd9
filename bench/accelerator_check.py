"""The accelerator kit's environment stage: versions, devices, and every module imported.

Prints the interpreter, the versions of the packages the project needs (and where each was
imported from: the image or the carried wheels), JAX's backend and devices, whether the native
CPU kernels build against this jaxlib, and imports every `scaletui` module. Exit 1 when a
module or a needed package fails to import, naming it.

    PYTHONPATH=src python bench/accelerator_check.py
"""

from __future__ import annotations

import importlib
import pkgutil
import platform
import sys
import traceback
from importlib import metadata

NEEDED = ["jax", "jaxlib", "numpy", "aiohttp", "yaml", "orjson", "prometheus_client",
          "tokenizers", "safetensors", "psutil", "textual", "textual_plotext", "plotext",
          "rich"]  # fmt: skip
OPTIONAL = ["uvloop", "jax_cuda13_plugin", "jax_cuda12_plugin"]


def _version(name: str) -> str:
    mod = importlib.import_module(name)
    where = getattr(mod, "__file__", None) or "?"
    try:
        version = metadata.version("pyyaml" if name == "yaml" else name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        version = getattr(mod, "__version__", "?")
    return f"{version}  ({where.rsplit('/', 2)[0]})"


def main() -> int:
    failed: list[str] = []
    print(f"python {platform.python_version()} ({sys.executable}) on {platform.machine()}")
    for name in NEEDED + OPTIONAL:
        try:
            print(f"  {name:<18} {_version(name)}")
        except ImportError as e:
            print(f"  {name:<18} missing: {e}")
            if name in NEEDED:
                failed.append(name)
    import jax

    print(f"jax backend {jax.default_backend()}: {jax.devices()}")
    import scaletui

    for mod in pkgutil.walk_packages(scaletui.__path__, "scaletui."):
        if mod.name.endswith("__main__"):  # it would start the TUI
            continue
        try:
            importlib.import_module(mod.name)
        except Exception:
            failed.append(mod.name)
            print(f"import {mod.name} failed:\n{traceback.format_exc()}")
    from scaletui.serve.engine import native

    print(f"native CPU kernels: {native.unavailable_reason() or 'built and registered'}")
    print(f"imports: {'failed: ' + ', '.join(failed) if failed else 'all ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
