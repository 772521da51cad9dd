"""What an N-model merge merges (:class:`Spec`) and how a model is named in one (:func:`model_entry`): shared by
``task=merge`` on a list of models (:mod:`mergescope.native.multi`) and on a mergekit YAML
(:mod:`mergescope.native.mergekit_in`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mergescope.config import CONF_DIR
from mergescope.errors import MergescopeError, did_you_mean


@dataclass
class SliceSpec:
    """One output slice of a sliced merge: its inputs and base as :class:`mergescope.merge.passthrough.Source` (model
    = an index into :attr:`Spec.entries`) and the operator preset of this slice."""

    inputs: list[Any]
    base: Any | None
    preset: dict[str, Any]


@dataclass
class Spec:
    """What an N-model merge merges: the operator preset, the models, the base, and where it came from. ``slices``: a
    merge by layer slices (passthrough stacking, or an operator per slice; :mod:`mergescope.native.sliced`), its
    models all in ``entries`` and ``base`` None."""

    preset: dict[str, Any]
    entries: list[DictConfig]
    base: DictConfig | None
    source: str = "merge.models"
    notes: list[str] = field(default_factory=list)
    slices: list[SliceSpec] | None = None
    # mergekit's tokenizer_source: {"kind": "union" | "model", "source": index into entries or "base"}: every model
    # given that vocabulary by a transplant first (mergescope.native.transplant.transplant_group); None: no transplant
    tokenizer: dict[str, Any] | None = None



def model_entry(cfg: DictConfig, m: Any, what: str, lang: str | None = None) -> DictConfig:
    """A model given as a conf/model name, a folder path or hub id (``path@revision`` allowed), or a full entry ->
    a resolved model entry (``name_or_path``, ``revision``, ``lang``, ``dtype``)."""
    names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    if isinstance(m, str):
        if m in names:
            m = OmegaConf.load(CONF_DIR / "model" / f"{m}.yaml")
        else:
            path, _, rev = m.partition("@") if "@" in m and not Path(m).exists() else (m, "", "")
            if not (Path(path).expanduser().exists() or path.count("/") == 1):
                raise MergescopeError(f"{what}: '{m}' is neither a conf/model name ({did_you_mean(m, names)}) nor a model "
                                      "folder nor a hub id")
            m = {"name_or_path": path, "revision": rev or None}
    node = OmegaConf.create({"paths": OmegaConf.to_container(cfg.paths, resolve=True), "entry": m})
    e = OmegaConf.create(OmegaConf.to_container(node, resolve=True)["entry"])
    if not e.get("name_or_path"):
        raise MergescopeError(f"{what}: a model entry needs name_or_path")
    for key, default in (("revision", None), ("dtype", "float32"), ("lang", lang or cfg.merge.get("lang") or "eng_Latn")):
        if e.get(key) is None:
            e[key] = default
    return e
