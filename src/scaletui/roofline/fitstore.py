"""Where fitted cost models live: one YAML per (host, model, precision, kernels, mesh shape), in
`fits/` beside the `local` hardware spec (`$XDG_CONFIG_HOME/scaletui/hardware/`).

`scaletui calibrate --model M` writes with `save_fit`; `scaletui simulate`, `scaletui roofline
--fit` and the TUI read with `load_fit` / `find_fit`. A name carries the compute dtype alone when
weights and KV are stored in it (`box--small--f32--xla--tp1-dp1.yaml`, the form fits had before
the precision knobs), else all three (`box--small--bf16-wint8-kvbf16--xla--tp1-dp1.yaml`).

A stored fit carries `info.fit_version`; `find_fit` passes over one older than FIT_VERSION (or
without it), which is bumped whenever the engine's speed or what a fit measures changes, so a fit
of yesterday's engine is made again rather than trusted. It carries `info.versions` too (jax and
jaxlib as installed when it was made): XLA's code generation sets the engine's speed as much as
ours does, so a fit made under another JAX is passed over as well. A fit of the native kernels
carries `info.kernels_source` (a hash of `serve/engine/native/kernels.cc`, read as a file: roofline
imports nothing of serve), and is passed over once that source changes, bumped or not.
"""

from __future__ import annotations

import hashlib
import platform
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import yaml

from scaletui.roofline.costmodel import CostModel
from scaletui.specs import user_config_dir

__all__ = [
    "FIT_VERSION",
    "engine_versions",
    "find_fit",
    "fit_path",
    "fits_dir",
    "fit_version",
    "kernels_source",
    "load_fit",
    "precision_tag",
    "save_fit",
    "stale",
    "stored_fits",
    "stored_fits_for",
    "find_fit_for",
    "fit_path_for",
]

# 2: the native bf16 kernels stopped copying a table per generate call, the fit records the
# kernels auto resolved to, and prefill is timed into pages as the server runs it
# 3: every KV bucket timed at the server's slots: a fit of 2 interpolated there
# 4: a bf16 KV pool on CPU is written in place (kv_cache.pool_dtype): a paged prefill no longer
# rewrites the whole pool, so its time stopped growing with slots x max_seq_len
# 5: the native f32 dense kernel stopped prefetching at 1-2 rows on AVX2: steps at batch 1-2 run
# faster there (docs/history/benchmarks-2026-12.md has each change's figures)
FIT_VERSION = 5


ENGINE_PACKAGES = ("jax", "jaxlib")
KERNELS_SOURCE = Path(__file__).parents[1] / "serve" / "engine" / "native" / "kernels.cc"


def engine_versions() -> dict[str, str]:
    """The installed versions of the packages that compile the engine (from their metadata:
    roofline imports no JAX); a package not installed is left out."""
    out = {}
    for name in ENGINE_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def kernels_source(source: Path = KERNELS_SOURCE) -> str | None:
    """A short hash of the native kernels' C++ source (None: not readable). Their speed is the
    engine's speed when it runs them, so a fit records the source it timed."""
    try:
        return hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def fits_dir() -> Path:
    """`<user config>/hardware/fits`, beside `local.yaml`."""
    return user_config_dir() / "hardware" / "fits"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text) or "_"


def precision_tag(dtype: str, weight_dtype: str | None = None, kv_dtype: str | None = None) -> str:
    """'f32' when weights and KV are stored in the compute dtype (None: they are), else
    'f32-wint8-kvbf16'. Single dashes: '--' separates a name's fields."""
    w, kv = weight_dtype or dtype, kv_dtype or dtype
    return dtype if w == kv == dtype else f"{dtype}-w{w}-kv{kv}"


def fit_path(
    model: str,
    dtype: str,
    kernels: str,
    tp: int,
    dp: int,
    host: str | None = None,
    *,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
) -> Path:
    """The file for one server configuration on one host (default: this host's name)."""
    host = host or platform.node() or "host"
    tag = _safe(precision_tag(dtype, weight_dtype, kv_dtype))
    name = f"{_safe(host)}--{_safe(model)}--{tag}--{kernels}--tp{tp}-dp{dp}.yaml"
    return fits_dir() / name


def save_fit(cost: CostModel, path: Path | None = None, host: str | None = None) -> Path:
    """Write `cost` as YAML (to its `fit_path`, by its precision, unless `path`); returns where."""
    path = path or fit_path(
        cost.model,
        cost.dtype,
        cost.kernels,
        cost.tp,
        cost.dp,
        host,
        weight_dtype=cost.weight_dtype,
        kv_dtype=cost.kv_dtype,
    )
    data = cost.to_dict()
    made = {"fit_version": FIT_VERSION, "versions": engine_versions()}
    if cost.kernels == "native" and kernels_source():
        made["kernels_source"] = kernels_source()
    data["info"] = {**made, **(data.get("info") or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _info(path: Path) -> dict:
    """A stored fit's `info` ({} when it has none or is not readable as a fit)."""
    try:
        info = (yaml.safe_load(path.read_text()) or {}).get("info") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return {}
    return info if isinstance(info, dict) else {}


def fit_version(path: Path) -> int:
    """The fit_version a stored fit was written with (0: none, or not readable as a fit)."""
    return _version(_info(path))


def stale(path: Path) -> str | None:
    """Why a stored fit is not trusted ('fit version 1, now 2 ...'; 'made under jax 0.10.2,
    now 0.11.0'; 'made with native kernels source 0a1b..., now 2c3d...'), or None when it is
    current."""
    info = _info(path)
    version = _version(info)
    if version < FIT_VERSION:
        return f"fit version {version}, now {FIT_VERSION} (the engine or the fit changed since)"
    other = _other_engine(info)
    if other:
        return f"made under {other}"
    made, now = info.get("kernels_source"), kernels_source()
    if made and now and str(made) != now:
        return f"made with native kernels source {made}, now {now} (kernels.cc changed since)"
    return None


def _version(info: dict) -> int:
    try:
        return int(info.get("fit_version") or 0)
    except (TypeError, ValueError):
        return 0


def _other_engine(info: dict) -> str | None:
    made, now = info.get("versions") or {}, engine_versions()
    if not isinstance(made, dict):
        return None
    differ = [
        f"{k} {made[k]}, now {now[k]}"
        for k in ENGINE_PACKAGES
        if k in made and k in now and str(made[k]) != now[k]
    ]
    return "; ".join(differ) or None


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
    *,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
) -> Path | None:
    """The stored fit for this configuration and precision (weights and KV: None means
    `dtype`), or None. `kernels="auto"` takes whichever kernels were fitted (the newest file),
    as the server's auto resolves to one of them. A fit older than FIT_VERSION, or made under
    another jax / jaxlib, is not found."""
    found = stored_fits(model, dtype, tp, dp, kernels, host, weight_dtype, kv_dtype)
    return next((p for p, why in found if why is None), None)


def stored_fits(
    model: str,
    dtype: str,
    tp: int,
    dp: int,
    kernels: str = "auto",
    host: str | None = None,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
) -> list[tuple[Path, str | None]]:
    """Every stored fit file for this configuration (`find_fit`'s arguments), newest first
    under kernels auto, each with why it is not trusted (`stale`; None: current)."""
    exact = fit_path(
        model, dtype, kernels, tp, dp, host, weight_dtype=weight_dtype, kv_dtype=kv_dtype
    )
    if kernels != "auto":
        found = [exact] if exact.exists() else []
    else:
        pattern = exact.name.replace("--auto--", "--*--")
        found = sorted(exact.parent.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    return [(p, stale(p)) for p in found]


def fit_path_for(key: Mapping, host: str | None = None) -> Path:
    """`fit_path` for a server shape's `fit_key()` (shape.FIT_KEYS: model, dtypes, tp, dp,
    kernels): where a fit of that shape is stored."""
    k = key
    dtypes = {"weight_dtype": k["weight_dtype"], "kv_dtype": k["kv_dtype"]}
    return fit_path(k["model"], k["dtype"], k["kernels"], k["tp"], k["dp"], host, **dtypes)


def stored_fits_for(key: Mapping, host: str | None = None) -> list[tuple[Path, str | None]]:
    """`stored_fits` for a server shape's `fit_key()`."""
    k = key
    dtypes = (k["weight_dtype"], k["kv_dtype"])
    return stored_fits(k["model"], k["dtype"], k["tp"], k["dp"], k["kernels"], host, *dtypes)


def find_fit_for(key: Mapping, host: str | None = None) -> Path | None:
    """`find_fit` for a server shape's `fit_key()`."""
    return next((p for p, why in stored_fits_for(key, host) if why is None), None)
