"""The transport arms: ``transport`` (cross-architecture fusion in both directions of every pair, with its
random-plan control) and ``transport_sweep`` (a calibration study: transport settings over named directions)."""

from __future__ import annotations

from collections.abc import Mapping

from mergescope.arm import Arm, Phase, Report


def named_directions(plan) -> dict:
    """Both directions (target <- donor) of every pair by name ("target<-donor"), merge.target=a then b; with
    ``transport_directions``, only the ones it names, in its order."""
    from mergescope.errors import MergescopeError, did_you_mean
    from mergescope.jobs import job, key_of

    user_merge = any(key_of(o) == "merge" for o in plan.base)
    out: dict = {}
    for label, sel in plan.pairs.items():
        a, b = label.split("__", 1)
        for target, name in (("a", f"{a}<-{b}"), ("b", f"{b}<-{a}")):
            extra = [*([] if user_merge else ["merge=transport"]), f"merge.target={target}"]
            out[name] = job("transport", [*plan.base, *sel, *extra])
    keep = plan.cfg.get("transport_directions")
    if keep is None:
        return out
    unknown = [str(d) for d in keep if str(d).replace(" ", "") not in out]
    if unknown:
        raise MergescopeError(f"transport_directions names {unknown[0]!r}, not a direction (target<-donor) of this "
                              f"study's pairs: {did_you_mean(unknown[0].replace(' ', ''), list(out))}")
    return {str(d).replace(" ", ""): out[str(d).replace(" ", "")] for d in keep}  # listed order (transport_sweep: the first N)


def transport_directions(plan) -> list:
    return list(named_directions(plan).values())


def _setting_jobs(i: int, entry, names: dict, swept: list) -> tuple[list, list]:
    """One entry of ``transport_sweep.settings``: (its directions, its overrides)."""
    from mergescope.errors import MergescopeError, did_you_mean

    if not isinstance(entry, Mapping):
        return swept, list(entry)
    bad = [k for k in entry if k not in ("overrides", "directions")]
    if bad or "overrides" not in entry:
        raise MergescopeError(f"transport_sweep.settings[{i}]: a mapping takes overrides (a list) and directions "
                              f"(target<-donor names){f', not {bad[0]!r}' if bad else ''}")
    dirs = swept
    if entry.get("directions") is not None:
        want = [str(d).replace(" ", "") for d in entry.directions]
        unknown = [d for d in want if d not in names]
        if unknown:
            raise MergescopeError(f"transport_sweep.settings[{i}].directions names {unknown[0]!r}, not a transport "
                                  f"direction of this study: {did_you_mean(unknown[0], list(names))}")
        dirs = [names[d] for d in want]
    return dirs, list(entry.overrides)


def transport_sweep(plan) -> list:
    """``transport_sweep`` (a calibration study): the first ``directions`` transport directions (all when unset),
    once per entry of ``settings``, in the listed order. An entry is a list of overrides (e.g.
    ``[merge.epsilon=0.003]``: on every swept direction) or a mapping ``{overrides: [...], directions: [...]}`` whose
    ``directions`` names the transport directions (target<-donor) it runs on, the swept ones or not."""
    from mergescope.jobs import job

    sw = plan.cfg.get("transport_sweep")
    if not sw or "transport_sweep" not in plan.arms:
        return []
    names = named_directions(plan)
    every = list(names.values())
    swept = every[: int(sw.directions)] if sw.get("directions") else every
    out = []
    for i, entry in enumerate(sw.settings):
        dirs, extra = _setting_jobs(i, entry, names, swept)
        out += [job("transport", [*j.overrides, *(str(o) for o in extra)]) for j in dirs]
    return out


def _target(j) -> str:
    from mergescope.runs import model_label

    return model_label(j.cfg.pair[str(j.cfg.merge.target)])


def transport_text(j, r) -> str:
    from mergescope.runs import model_label

    t, d = (j.cfg.pair.a, j.cfg.pair.b) if str(j.cfg.merge.target) == "a" else (j.cfg.pair.b, j.cfg.pair.a)
    deltas = ", ".join(f"a={k.split('@')[1]}: {v:+.4f}" for k, v in r.metrics.items() if k.startswith("delta_target_lang@"))
    return f"transport {model_label(t)} <- {model_label(d)}: delta target {deltas}"


def _record_failure(j, exc: Exception) -> None:
    """A FAILED kind=transport run for a setting whose plans did not converge (they fail before the job's own runs
    exist): its config (merge.epsilon ...) as params, the reason as tag ``error``, for the calibration section."""
    from mergescope.errors import NotConverged
    from mergescope.runs import model_label
    from mergescope.tracking import Tracker

    target = str(j.cfg.merge.target)
    donor = "b" if target == "a" else "a"
    tags = {"kind": "transport", "target": model_label(j.cfg.pair[target]), "donor": model_label(j.cfg.pair[donor]),
            "outcome": NotConverged.outcome}
    Tracker(j.cfg).record_failed(j.cfg, f"transport {tags['target']} <- {tags['donor']} (did not converge)", tags, j.overrides, exc)


def run_sweep(plan, jobs: list) -> None:
    """The transport setting sweep (epsilon calibration, probe count). A setting whose plans do not converge is a
    result of the sweep, not a reason to stop it: its run is FAILED with the reason (tag ``error``), the report's
    calibration section counts it, and the sweep goes on."""
    from mergescope.errors import NotConverged
    from mergescope.jobs import done_note
    from mergescope.progress import console, phase_bar, status

    if not jobs:
        return
    with phase_bar() as pb:
        bar_id = pb.add_task("transport settings", total=len(jobs), note="")
        for i, j in enumerate(jobs, 1):
            try:
                r = j.run()
            except NotConverged as exc:
                status.print(f"[{i}/{len(jobs)}] [yellow]transport setting did not converge[/]: {str(exc)[:200]}")
                _record_failure(j, exc)
                pb.update(bar_id, advance=1)
                continue
            console.print(f"[{i}/{len(jobs)}] {transport_text(j, r)}{done_note(r)}")
            pb.update(bar_id, advance=1)



# ------------------------------------------------------------------ the counted cost of plan=true (mergescope.costs)


def _w_transport(c, cfg, w) -> None:
    from mergescope.costs import transport_plans
    from mergescope.transport.identity import fusion_key, sides
    from mergescope.transport.settings import TransportSettings

    t_entry, d_entry = sides(cfg)
    st, sd = c.shape(t_entry, w), c.shape(d_entry, w)
    if not (st and sd):
        return
    m = cfg.merge
    ts = TransportSettings.from_node(m)
    rel = ts.released  # the released method's own plans (None: mergescope's)
    transport_plans(w, st, sd, float(m.probe_sentences), c.k, int(m.layer_subsample), int(m.layer_topk),
                    None if rel is None else (rel.sublayers, rel.layer_pairs, int(rel.p_topk or 0), rel.solver), ts.top_k,
                    ts.control_seeds)
    n_eval = cfg.native.get("nll_sentences")
    tok = sum(c.tokens(cfg.data, lang, n_eval)[1] for lang in dict.fromkeys([t_entry.lang, d_entry.lang]))  # both languages
    alphas = len(m.get("alphas") or [])
    seeds = int(m.get("control_seeds") or 1)
    select = int(m.get("select_sentences") or 0)
    fused = fusion_key(cfg)  # the fusion's runs, adaptation apart: a job with the same ones reuses them
    reused = fused in c.seen
    c.seen.add(fused)
    if select and not reused:  # the selection split: FLORES dev lines after the probes, the OT fusion at each alpha and the unfused target
        from mergescope.transport.settings import probe_data

        probe_set = probe_data(cfg, TransportSettings.from_node(m))
        _, sel = c.tokens(probe_set, t_entry.lang, int(m.probe_sentences) + select)
        _, probes = c.tokens(probe_set, t_entry.lang, int(m.probe_sentences))
        w.add_forward(st, sel - probes, logits=True, passes=1 + alphas)
    tested = 1 if str(m.get("test_at") or "every") == "selected" else alphas
    if not reused:
        w.add_forward(st, tok, logits=True, passes=1 + tested * (2 + seeds))  # baseline; OT, shrink-only and each control seed
    if ts.adapt is not None:  # trained: the fused model, each adapted control seed's, the no-fusion baseline (and the released
        # mode's damped baseline), each a forward and backward per step, then each scored before and after
        adapted = seeds if ts.adapt.control_seeds is None else min(ts.adapt.control_seeds, seeds)
        runs = (2 + adapted + (1 if ts.adapt.mode == "released" else 0)) * (1 + len(ts.adapt.more_alphas))
        w.add_forward(st, float(ts.adapt.steps) * float(ts.adapt.batch_size) * c.k.probe_tokens_per_sentence, logits=True,
                      passes=runs * 3.0)
        w.add_forward(st, tok, logits=True, passes=2 * runs)
    w.held = [st]  # the donor is probed and freed before the target loads; fused from its files


_R, _S = "mergescope.transport.report", "mergescope.transport.report_settings"

ARMS = [
    Arm("transport", order=40, tasks={"transport": "mergescope.transport.job:run_transport"},
        work={"transport": _w_transport},
        phases=(Phase("transport", transport_directions, transport_text, workers=True, together=_target),),
        report=Report(sections={(70, 0): f"{_R}:transport", (70, 3): f"{_S}:epsilon_calibration", (70, 4): f"{_S}:probe_count"},
                      pair_rows=f"{_R}:pair_rows", pair_tables=f"{_R}:pair_tables", coverage={"transport": f"{_R}:coverage_cell"},
                      beside=f"{_R}:beside", pair_diagnostics=("transport_delta", "transport_ot_minus_rand"),
                      figures=(("transport_deltas", "transport fusion deltas with the control"),), summary={"transport": "Transport fusion"},
                      kinds={"transport": "transport fusion, one direction (target <- donor) at one alpha, with its random-plan control",
                             "transport_adapt": "post-fusion adaptation of a transport direction, and its no-fusion baseline "
                                                "(stage=baseline)"},
                      logical_keys={"transport": f"{_R}:transport_key", "transport_adapt": f"{_R}:transport_adapt_key"},
                      rejudge={"transport": "mergescope.transport.comparisons:rejudge_alpha",
                               "transport_adapt": "mergescope.transport.comparisons:rejudge_adapt"})),
    # one target's directions in one worker: its no-fusion baseline is made once
    Arm("transport_sweep", order=41, lap="transport", needs=("transport_sweep", lambda c: c.get("transport_sweep")),
        phases=(Phase("transport settings", transport_sweep, run=run_sweep),)),
]
