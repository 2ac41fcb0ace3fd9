"""Where fitted cost models live: one YAML per (host, model, dtype, kernels, mesh shape), in
`fits/` beside the `local` hardware spec (`$XDG_CONFIG_HOME/scaletui/hardware/`).

`scaletui calibrate --model M` (later) writes with `save_fit`; `scaletui simulate`, `scaletui
roofline --fit` and the TUI read with `load_fit` / `find_fit`.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import yaml

from scaletui.roofline.costmodel import CostModel
from scaletui.specs import user_config_dir

__all__ = ["find_fit", "fit_path", "fits_dir", "load_fit", "save_fit"]


def fits_dir() -> Path:
    """`<user config>/hardware/fits`, beside `local.yaml`."""
    return user_config_dir() / "hardware" / "fits"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text) or "_"


def fit_path(
    model: str,
    dtype: str,
    kernels: str,
    tp: int,
    dp: int,
    host: str | None = None,
) -> Path:
    """The file for one server configuration on one host (default: this host's name)."""
    host = host or platform.node() or "host"
    name = f"{_safe(host)}--{_safe(model)}--{dtype}--{kernels}--tp{tp}-dp{dp}.yaml"
    return fits_dir() / name


def save_fit(cost: CostModel, path: Path | None = None, host: str | None = None) -> Path:
    """Write `cost` as YAML (to its `fit_path` unless `path`); returns where."""
    path = path or fit_path(cost.model, cost.dtype, cost.kernels, cost.tp, cost.dp, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cost.to_dict(), sort_keys=False))
    return path


def load_fit(path: str | Path) -> CostModel:
    """Read a cost model YAML; ValueError naming the file when it is not one."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read cost model {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"cost model {path} should be a YAML mapping")
    try:
        return CostModel.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cost model {path}: {exc}") from exc


def find_fit(
    model: str,
    dtype: str,
    tp: int,
    dp: int,
    kernels: str = "auto",
    host: str | None = None,
) -> Path | None:
    """The stored fit for this configuration, or None. `kernels="auto"` takes whichever kernels
    were fitted (the newest file), as the server's auto resolves to one of them."""
    exact = fit_path(model, dtype, kernels, tp, dp, host)
    if exact.exists():
        return exact
    if kernels != "auto":
        return None
    pattern = exact.name.replace("--auto--", "--*--")
    found = sorted(exact.parent.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None
