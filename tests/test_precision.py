"""The precision of real-model forwards (mergescope.precision): per task, refused where it cannot help, part of the job's
identity and of every cache key, and what it computes close to float32 but not the same numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mergescope import precision
from mergescope.errors import MergescopeError
from test_e2e import pair_args, runs


def _cfg(task: str, **prec) -> OmegaConf:
    return OmegaConf.create({"task": {"name": task}, "device": "cpu", "precision": {"default": "float32", **prec}})


@pytest.fixture()
def bf16_cpu(monkeypatch):
    """A CPU with bfloat16 units (this one has them; the tests must not depend on it)."""
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ("amx_bf16",))


def test_per_task_with_a_default_and_merges_never_in_bfloat16(bf16_cpu):
    assert precision.of(_cfg("measure")) == "float32"
    assert precision.of(_cfg("measure", measure="bfloat16")) == "bfloat16"
    assert precision.of(_cfg("quality", measure="bfloat16")) == "float32"
    assert precision.of(_cfg("quality", default="medium")) == "medium"
    # default=bfloat16: the forward-only tasks; a merging task stays float32 unless named (then refused)
    assert precision.of(_cfg("transport", default="bfloat16")) == "float32"
    assert precision.of(_cfg("routing", default="bfloat16")) == "bfloat16"
    with pytest.raises(MergescopeError, match="precision.transport=bfloat16: task=transport merges models.*use medium"):
        precision.of(_cfg("transport", transport="bfloat16"))
    assert precision.of(_cfg("transport", transport="medium")) == "medium"
    with pytest.raises(MergescopeError, match="precision.measure='fp8': choose one of float32, medium, bfloat16"):
        precision.of(_cfg("measure", measure="fp8"))
    with pytest.raises(MergescopeError, match="precision.mesure: not a task with model forwards"):
        precision.of(_cfg("measure", mesure="bfloat16"))
    # conf/config.yaml names every task with forwards, each null (= default)
    from mergescope.config import CONF_DIR

    node = OmegaConf.load(CONF_DIR / "config.yaml").precision
    assert list(node) == ["default", *precision.FORWARD_TASKS, *precision.MERGING_TASKS]
    assert node.default == "float32" and all(node[k] is None for k in list(node)[1:])


def test_refused_in_one_line_where_the_hardware_has_no_bfloat16_units(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ())
    for value in ("bfloat16", "medium"):
        with pytest.raises(MergescopeError, match=f"precision {value}: this CPU has no bfloat16 matrix units"):
            precision.of(_cfg("measure", measure=value))
    assert precision.of(_cfg("measure")) == "float32"  # float32 never asks


def test_in_the_identity_only_when_not_float32(bf16_cpu):
    from mergescope.config import job_hash

    keys = ["task"]
    h = {v: job_hash("measure", _cfg("measure", measure=v), keys) for v in precision.PRECISIONS}
    assert len(set(h.values())) == 3
    assert h["float32"] == job_hash("measure", OmegaConf.create({"task": {"name": "measure"}, "device": "cpu"}), keys)
    e = OmegaConf.create({"name_or_path": "x", "dtype": "float32"})
    assert [precision.dtype_tag(_cfg("measure", measure=v), e) for v in precision.PRECISIONS] == \
        ["float32", "float32+medium", "bfloat16"]
    assert precision.forward_entry(_cfg("measure", measure="bfloat16"), e).dtype == "bfloat16" and e.dtype == "float32"


def test_medium_is_set_around_the_forwards_and_restored(bf16_cpu):
    before = torch.get_float32_matmul_precision()
    with precision.active(_cfg("measure", measure="medium")) as v:
        assert v == "medium" and torch.get_float32_matmul_precision() == "medium"
    assert torch.get_float32_matmul_precision() == before
    with pytest.raises(RuntimeError):
        with precision.active(_cfg("measure", measure="medium")):
            raise RuntimeError("a failed forward")
    assert torch.get_float32_matmul_precision() == before


def test_a_bfloat16_measure_and_quality_run_close_to_float32_under_their_own_identity(tiny_models, compose_cfg, bf16_cpu):
    """The same pair measured in float32 and with the models held in bfloat16: two runs (two identities, two cache
    entries), CKA and NLL close (bfloat16's rounding) but not equal; the bfloat16 run's model really was bfloat16."""
    from mergescope.represent.job import run_measure, run_quality

    got = {}
    for v in ("float32", "bfloat16"):
        cfg, ov = compose_cfg(["task=measure", "metric=cka", *pair_args(tiny_models), f"precision.measure={v}",
                               "control.calibration_permutations=0"])
        got[v] = run_measure(cfg, ov)
    assert got["float32"].cfg_hash != got["bfloat16"].cfg_hash
    a, b = got["float32"].metrics["cka"], got["bfloat16"].metrics["cka"]
    assert a != b and abs(a - b) < 2e-2
    dtypes = sorted(p.name for p in (Path(cfg.paths.cache) / "reprs").rglob("*") if p.is_file())
    assert dtypes  # both precisions cached apart (the key's dtype differs)
    q = {}
    for v in ("float32", "bfloat16"):
        cfg, ov = compose_cfg(["task=quality", "model=custom", f"model.name_or_path={tiny_models['llama_pt']}",
                               "model.lang=por_Latn", f"precision.quality={v}", "data.max_sentences=24"])
        q[v] = run_quality(cfg, ov).metrics["nll"]
    assert q["float32"] != q["bfloat16"] and abs(q["float32"] - q["bfloat16"]) < 5e-2
    assert {r.info.status for r in runs(Path(cfg.paths.root))} == {"FINISHED"}


def test_verdicts_pass_an_arm_only_where_every_difference_is_below_the_tolerance():
    from mergescope.precision_check import verdicts

    rows = [{"criterion": "cka", "precision": "bfloat16", "ratio": 0.02}, {"criterion": "cka", "precision": "bfloat16", "ratio": 0.09},
            {"criterion": "nll", "precision": "bfloat16", "ratio": 0.05}, {"criterion": "nll", "precision": "bfloat16", "ratio": 0.4}]
    v = verdicts(rows, ["bfloat16"], 0.1)
    assert v["worst.cka.bfloat16"] == 0.09 and v["worst.nll.bfloat16"] == 0.4
    assert v["pass.measure.bfloat16"] == v["pass.shared_space.bfloat16"] == 1.0
    assert v["pass.quality.bfloat16"] == v["pass.routing.bfloat16"] == 0.0  # one model's NLL moved too much: all NLL arms stay float32
    rows.append({"criterion": "cka", "precision": "bfloat16", "ratio": float("nan")})  # not measurable: never a pass
    assert verdicts(rows, ["bfloat16"], 0.1)["pass.measure.bfloat16"] == 0.0


def test_the_precision_check_measures_each_arms_quantities_against_float32(tiny_models, compose_cfg, bf16_cpu):
    """Two tiny models on the same 32 English lines: a row per pair (CKA) and per model (NLL) and precision, the
    verdicts consistent with the rows, one FINISHED run, reused when run again."""
    import csv
    import io

    from mergescope.precision_check import run_precision_check

    a, b = tiny_models["neox_en"], tiny_models["llama_pt"]
    cfg, ov = compose_cfg(["task=precision_check", f"precision_check.models=[{a},{b}]", "precision_check.sentences=32"])
    res = run_precision_check(cfg, ov)
    m = res.metrics
    assert m["n_sentences"] == 32 and m["n_models"] == 2
    for p in ("medium", "bfloat16"):
        for arm in ("measure", "shared_space", "agreement"):
            assert m[f"pass.{arm}.{p}"] == float(m[f"worst.cka.{p}"] < 0.1)
        for arm in ("quality", "routing"):
            assert m[f"pass.{arm}.{p}"] == float(m[f"worst.nll.{p}"] < 0.1)
    assert m["pooled_rel_diff.neox_en.bfloat16"] > m["pooled_rel_diff.neox_en.medium"] >= 0
    assert 0 < m["pooled_rel_diff.neox_en.bfloat16"] < 0.05 and m["nll_diff.llama_pt.bfloat16"] != 0
    path = Path(cfg.paths.root) / "mlruns" / "artifacts" / "toy" / res.run_id / "artifacts" / "tables" / "precision_check.csv"
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert len(rows) == 2 * 1 + 2 * 2 and {r["criterion"] for r in rows} == {"cka", "nll"}
    for p in ("medium", "bfloat16"):
        worst = max(float(r["ratio"]) for r in rows if r["precision"] == p and r["criterion"] == "cka")
        assert worst == pytest.approx(m[f"worst.cka.{p}"], abs=1e-4)  # the table's 4 decimals
    assert {r.info.status for r in runs(Path(cfg.paths.root))} == {"FINISHED"}
    assert run_precision_check(cfg, ov).skipped  # the same check again: reused


def test_emulated_bfloat16_probes_have_their_own_identity(monkeypatch, compose_cfg):
    """merge=transport_released (follow=code: bfloat16 probes) on a CPU without bfloat16 units runs the emulation,
    whose numbers are not a native bfloat16 model's: its jobs' hashes say so; with units, or float32 probes, nothing."""
    from mergescope.transport.job import probe_compute

    cfg, _ = compose_cfg(["task=transport", "merge=transport_released"])
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ())
    assert probe_compute(cfg) == {"probe_compute": "bfloat16-emulated"}
    cfg32, _ = compose_cfg(["task=transport", "merge=transport_released", "merge.released.probe_dtype=float32"])
    assert probe_compute(cfg32) == {}
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ("avx512_bf16",))
    assert probe_compute(cfg) == {}
    assert probe_compute(compose_cfg(["task=transport", "merge=transport"])[0]) == {}
