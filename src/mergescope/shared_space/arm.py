"""The shared-space arm: per probe set (``shared.data_sets``), cross-model agreement on every pair at every depth and
one GPA shared space over ``shared.models``; routing on the first probe set."""

from __future__ import annotations

from mergescope.arm import Arm, Phase, Report


def agreement_sides(plan) -> dict[str, list[str]]:
    """Each pair's selection for the agreement jobs, with each side on the language the shared space reads it in (its
    ``shared.models`` entry's): where a study puts the sweep's sides on other languages (``languages:``, each model on
    its own), the agreement beside the space still reads the space's sides (unchanged where the two agree)."""
    from mergescope.runs import model_label

    space = {model_label(e): str(e.lang) for e in shared_models(plan)}
    out = {}
    for label, sel in plan.pairs.items():
        extra = [f"pair.{side}.lang={space[name]}" for side, name in zip("ab", label.split("__", 1))
                 if name in space and name in plan.entries and str(plan.entries[name].lang) != space[name]]
        out[label] = [*sel, *extra]
    return out


def shared_jobs(plan) -> list:
    from mergescope.jobs import job

    s = plan.cfg.shared
    if "shared_space" not in plan.arms:
        return []
    out = []
    sides = agreement_sides(plan)
    for k, data in enumerate(s.data_sets):
        out += [job("agreement", [*plan.base, *sel, f"data={data}"]) for sel in sides.values()]
        out += [job(t, [*plan.base, f"data={data}"]) for t in (["shared_space", "routing"] if k == 0 else ["shared_space"])]
    return out


def shared_models(plan) -> list:
    """The shared space's models (study=real: the real model beside the English toy family, which its sweep does not
    otherwise train)."""
    from mergescope.jobs import composed

    if "shared_space" not in plan.arms:
        return []
    return [composed([*plan.base, f"model={name}"]).model for name in plan.cfg.shared.models]


def _text(j, r) -> str:
    from mergescope.jobs import pair_text

    what = pair_text(j) if j.task == "agreement" else "all models"
    return f"{j.task} {what} on {j.cfg.data.name}"



# ------------------------------------------------------------------ the counted cost of plan=true (mergescope.costs)


def _w_shared(c, cfg, w) -> None:
    from mergescope.shared_space.reprs import model_entries
    from mergescope.shared_space.settings import SharedSettings

    sh = cfg.shared
    for e in model_entries(cfg, SharedSettings.from_cfg(cfg)):
        s = c.shape(e, w)
        for pooling in {str(sh.pooling), *[str(p) for p in sh.get("poolings") or []]}:
            c.extraction(cfg, e, s, w, key=("shared", pooling))
        if s:
            w.held = [s]


ARMS = [Arm(
    "shared_space", order=50, uses=("represent",), settings=("shared",), models=shared_models, models_order=40,
    tasks={"agreement": "mergescope.shared_space.job:run_agreement",
           "shared_space": "mergescope.shared_space.job:run_shared_space",
           "routing": "mergescope.shared_space.job:run_routing"},
    work={"shared_space": _w_shared, "agreement": _w_shared, "routing": _w_shared},
    peak_kind={"shared_space": "quality", "agreement": "quality", "routing": "quality"},
    phases=(Phase("shared space", shared_jobs, _text, workers=True),),
    report=Report(sections={(70, 2): "mergescope.shared_space.report:shared_space_section"},
                  beside="mergescope.shared_space.report:beside", summary={"shared_space": "Shared space"},
                  kinds={"agreement": "probe-level agreement (RSA, nearest neighbours) with permutation nulls, per depth",
                         "shared_space": "GPA shared space and pairwise maps, per depth and fold",
                         "routing": "routing by the shared space"}),
)]
