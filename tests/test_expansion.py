"""task=expansion (the function check of dimensional adaptation) on a tiny Llama: Expand(zero) with the eps rule keeps
the logits to float64 rounding and its control (the source's eps) does not; Expand(repeat) keeps them; Truncate(slots)
gives the tensors back; a broken operator is caught; bad input is refused before any run; the report's tables."""

from __future__ import annotations

import pytest

from conftest import save_tiny
from mergescope.errors import MergescopeError

WIDE = "{mode:zero,changes:{hidden_size:72,num_attention_heads:6,num_key_value_heads:3,intermediate_size:128,num_hidden_layers:4}}"
REPEAT = "{mode:repeat,changes:{intermediate_size:192,hidden_size:96,num_attention_heads:8,num_key_value_heads:4}}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("exp") / "llama", "llama", "eng_Latn", seed=4)


def _cfg(compose_cfg, llama, target: str, *extra: str):
    return compose_cfg(["task=expansion", "model=custom", f"model.name_or_path={llama}", "model.lang=eng_Latn",
                        f"expansion.target={target}", "expansion.sentences=6", *extra])


def test_expand_zero_keeps_the_function_and_the_eps_rule_is_what_keeps_it(llama, compose_cfg):
    from mergescope.adapt.kept import run_expansion
    from mergescope.tracking import Tracker

    cfg, ov = _cfg(compose_cfg, llama, WIDE)
    m = run_expansion(cfg, ov).metrics
    assert m["max_abs_logit_diff"] < 1e-12 and m["argmax_agree"] == 1.0 and m["kept"] == 1.0
    assert m["nll_expanded"] == pytest.approx(m["nll_source"], abs=1e-12)
    assert m["max_abs_logit_diff_eps_kept"] > 1e3 * max(m["max_abs_logit_diff"], 1e-15)  # the rule's control
    assert m["roundtrip_max_abs"] < 1e-15 and m["roundtrip_tensors_bitwise"] >= m["roundtrip_tensors"] - 8  # norms: 1 ulp
    assert m["n_params_target"] > m["n_params_source"] and m["tokens"] > 6
    run = Tracker(cfg).runs("tags.kind = 'expansion'")[0]
    assert run.data.tags["mode"] == "zero" and "h=72" in run.data.tags["target"]
    note = run.data.tags["mlflow.note.content"]  # the headline metric at the top of the run's page
    assert note.startswith("expansion zero") and f"**max_abs_logit_diff = {m['max_abs_logit_diff']:.6g}** (headline)" in note
    assert float(run.data.params["target_rms_norm_eps"]) == pytest.approx(float(run.data.params["source_rms_norm_eps"]) * 48 / 72)
    assert run_expansion(cfg, ov).skipped


def test_expand_repeat_keeps_the_function(llama, compose_cfg):
    from mergescope.adapt.kept import run_expansion

    cfg, ov = _cfg(compose_cfg, llama, REPEAT)
    m = run_expansion(cfg, ov).metrics
    assert m["max_abs_logit_diff"] < 1e-12 and m["kept"] == 1.0
    assert "roundtrip_max_abs" not in m and "max_abs_logit_diff_eps_kept" not in m  # repeat keeps the eps


def test_a_broken_operator_is_caught(llama, compose_cfg, monkeypatch):
    """The norm scale c switched off (a planted bug): the check reports the function NOT kept."""
    import mergescope.adapt.ops.expand as ex
    from mergescope.adapt.kept import run_expansion

    monkeypatch.setattr(ex, "norm_factor", lambda *a, **k: 1.0)
    cfg, ov = _cfg(compose_cfg, llama, WIDE)
    m = run_expansion(cfg, ov).metrics
    assert m["kept"] == 0.0 and m["max_abs_logit_diff"] > 1e-6


@pytest.mark.parametrize("target, message", [
    ("{mode:zero,changes:{rope_theta:5.0}}", "not a shape field"),
    ("{mode:repeat,changes:{intermediate_size:100}}", "not an integer multiple"),
    ("{mode:zero,changes:{hidden_size:24}}", "smaller"),
    ("{mode:tile,changes:{intermediate_size:192}}", "choose one of zero, repeat"),
    ("{mode:zero,changes:{}}", "is empty"),
])
def test_bad_targets_are_refused_before_any_run(llama, compose_cfg, target, message):
    from mergescope.adapt.kept import run_expansion
    from mergescope.tracking import Tracker

    cfg, ov = _cfg(compose_cfg, llama, target)
    with pytest.raises(MergescopeError, match=message):
        run_expansion(cfg, ov)
    assert Tracker(cfg).runs("", status=None) == []


def test_report_tables_and_finding():
    from mergescope.adapt.report import expansion_tables
    from mergescope.analysis.records import Rec

    metrics = {"max_abs_logit_diff": 2.4e-13, "max_abs_logit_diff_as_run": 5.6e-5, "max_abs_logit_diff_eps_kept": 1.7e-2,
               "argmax_agree": 1.0, "nll_source": 4.5198, "nll_expanded": 4.5198, "kept": 1.0, "n_params_source": 1e8,
               "n_params_target": 2e8, "roundtrip_max_abs": 2.2e-16, "roundtrip_tensors_bitwise": 212.0,
               "roundtrip_tensors": 273.0, "wall_s": 56.0, "peak_rss_gb": 5.05}
    rec = Rec("abcdef1234", 0, {"kind": "expansion", "mode": "zero", "model": "m", "target": "llama h=768", "dtype": "float64"},
              metrics, {})
    tables, finding = expansion_tables([rec])
    assert tables[0].rows[0][3:7] == ["2.4e-13", "5.6e-05", "1.7e-02", "1.0000"] and tables[0].rows[0][8] == "yes"
    assert tables[1].rows[0][4:6] == ["2.2e-16", "212 of 273"]
    assert finding.startswith("Expand(zero) of m into llama h=768 keeps its function") and "abcdef12" in finding
    assert "1.7e-02 without the eps rule" in finding
