"""The weight-space arms: ``native`` (the study's cross-model pairs that share a parameter space: merges, LMC
barriers, weight diagnostics) and ``checkpoints`` (every pair of listed revisions of one model)."""

from __future__ import annotations

import itertools

from mergescope.arm import Arm, Phase, Report


def _outside_sweep(plan) -> dict[str, list]:
    """``native_pairs`` outside the study's sweep (a family of its own): pair name -> its two model entries
    (``pair=<name>``); a name that is neither a sweep pair nor two conf/model names is one line."""
    from mergescope.errors import MergescopeError, did_you_mean
    from mergescope.jobs import composed

    out = {}
    for name in map(str, plan.cfg.get("native_pairs") or []):
        if name in plan.pairs:
            continue
        try:
            c = composed([*plan.base, f"pair={name}"])
        except Exception:  # noqa: BLE001 - Hydra's missing-option errors: refused in one line below
            raise MergescopeError(f"native_pairs names {name!r}, not a pair of this study nor two conf/model names a__b: "
                                  f"{did_you_mean(name, list(plan.pairs))}") from None
        out[name] = [c.pair.a, c.pair.b]
    return out


def native_outside_pairs(plan) -> list:
    """``native_pairs`` outside the sweep as (a, b) model entries."""
    return [tuple(pair) for pair in _outside_sweep(plan).values()]


def native_only_models(plan) -> list:
    """The models of ``native_pairs`` outside the sweep: trained when missing (a fine-tune of a real model), scored
    like the sweep's."""
    return [e for pair in _outside_sweep(plan).values() for e in pair]


def _pair_text(j) -> str:  # jobs imports torch: on use only
    from mergescope.jobs import pair_text

    return pair_text(j)


def native_pairs(plan) -> list:
    """The study's pairs that share a parameter space (decided from each model's config.json); ``native_pairs``
    (pair names ``a__b``) keeps only those."""
    from mergescope.jobs import job
    from mergescope.models import load_config, resolve
    from mergescope.native.weights import routes

    keep = None if plan.cfg.get("native_pairs") is None else set(map(str, plan.cfg.native_pairs))
    out = []
    outside = {name: [f"pair={name}"] for name in _outside_sweep(plan)}
    for label, sel in {**plan.pairs, **outside}.items():
        if keep is not None and label not in keep:
            continue
        j = job("native", [*plan.base, *sel])
        if routes(load_config(resolve(j.cfg.pair.a)), load_config(resolve(j.cfg.pair.b)))["native"]["defined"]:
            out.append(j)
    return out


def checkpoint_revisions(ck, name: str, model) -> list[str]:
    """The revisions of one model in the checkpoint arm, in step order (``all``: every stepN revision it has)."""
    from mergescope.models import resolve, step_revisions

    spec = ck.revisions_of(name)
    return step_revisions(resolve(model)) if spec == "all" else spec


def checkpoint_pairs(plan) -> list:
    """Every pair of the listed revisions of each listed model (``checkpoints.per_model`` overrides the shared
    ``checkpoints.revisions`` per model; ``all`` = every stepN revision the model has)."""
    from omegaconf import OmegaConf

    from mergescope.jobs import composed, job, pair_override
    from mergescope.native.settings import CheckpointSettings

    out = []
    if "checkpoints" not in plan.arms:
        return out
    ck = CheckpointSettings.from_cfg(plan.cfg)
    for m in ck.models:
        model = composed([*plan.base, f"model={m}"]).model
        entry = OmegaConf.to_container(model)
        for ra, rb in itertools.combinations(checkpoint_revisions(ck, m, model), 2):
            a, b = OmegaConf.create({**entry, "revision": ra}), OmegaConf.create({**entry, "revision": rb})
            out.append(job("native", [*plan.base, *pair_override(a, b), *ck.overrides]))
    return out


def evict_checkpoints(jobs: list) -> dict[str, int]:
    """Delete the revisions these (FINISHED) checkpoint jobs read from the local hub cache; print what was freed."""
    from mergescope.hub import evict_revisions
    from mergescope.models import resolve
    from mergescope.progress import status

    ref = resolve(jobs[0].cfg.pair.a)
    if ref.local:
        return {}
    revs = sorted({str(j.cfg.pair[s].revision) for j in jobs for s in ("a", "b")} | {str(jobs[0].cfg.native.base or "main")} - {"main", "None"})
    freed = evict_revisions(ref.location, revs)
    status.print(f"[bold]evicted[/] {len(freed)} revisions of {ref.location} from the hub cache: "
                  f"{sum(freed.values()) / 2**30:.2f} GiB freed ({', '.join(sorted(freed)) or 'none cached'})")
    return freed


def run_checkpoints(plan, jobs: list) -> None:
    """The checkpoint pairs, model by model; with ``checkpoints.evict_after`` each hub model's revisions are
    deleted from the local hub cache once all its pairs are FINISHED (a zoo folder is never touched)."""
    from mergescope.jobs import pair_text, run_all, workers_of
    from mergescope.native.settings import CheckpointSettings
    from mergescope.runs import model_label

    by_model: dict[str, list] = {}
    for j in jobs:
        by_model.setdefault(str(j.cfg.pair.a.name_or_path), []).append(j)
    evict = CheckpointSettings.from_cfg(plan.cfg).evict_after
    for group in by_model.values():
        run_all(group, lambda j, r: f"checkpoint pair {pair_text(j)}: barrier={r.metrics.get('lmc_barrier', float('nan')):.3f}",
                workers_of(plan.cfg), phase=f"checkpoints {model_label(group[0].cfg.pair.a)}")
        if evict:
            evict_checkpoints(group)



# ------------------------------------------------------------------ the counted cost of plan=true (mergescope.costs)


def _native_nll(cfg) -> int | None:
    n = cfg.get("native", {}).get("nll_sentences")
    return int(n) if n else None


def outcome_tokens(c, cfg, n: int | None, data=None) -> float:
    """The tokens a pair's merge is scored on (of ``data``, default ``cfg.data``): the host's language's first ``n``,
    and b's too under ``native.outcome=both``."""
    langs = [cfg.pair.a.lang]
    if (cfg.get("native") or {}).get("outcome") == "both" and str(cfg.pair.b.lang) != str(cfg.pair.a.lang):
        langs.append(cfg.pair.b.lang)
    return sum(c.tokens(cfg.data if data is None else data, lang, n)[1] for lang in langs)


def _w_native(c, cfg, w) -> None:
    sa, sb = c.shape(cfg.pair.a, w), c.shape(cfg.pair.b, w)
    if not (sa and sb):
        return
    n = _native_nll(cfg)
    tok = outcome_tokens(c, cfg, n)
    nat = cfg.native
    merges = len(nat.get("merges") or []) * len(nat.get("mix") or [0.5]) * max(1, int(nat.get("merge_seeds") or 1))
    merges *= 2 if nat.get("select_split") else 1  # each merge also on native.select_split (about as many tokens)
    for s in (sa, sb, sa):  # host, donor, base streamed
        w.add_load(s)
    w.add_forward(sa, tok, logits=True, passes=float(nat.get("lmc_points") or 0) + merges + 2)
    w.held = [sa]


def _w_merge(c, cfg, w) -> None:
    entries = list(cfg.merge.get("models") or []) if cfg.get("merge") is not None and cfg.merge.get("models") else []
    if entries:
        from mergescope.native.multi import model_entry

        entries = [model_entry(cfg, m, f"merge.models[{i}]") for i, m in enumerate(entries)]
    else:
        entries = [cfg.pair.a, cfg.pair.b]
    shapes = [c.shape(e, w) for e in entries]
    if not all(shapes):
        return
    for s in shapes:
        w.add_load(s)
    from mergescope.native.multi import is_multi

    select = not is_multi(cfg) and (cfg.get("native") or {}).get("select_split")  # the pair form's val_nll
    tok = outcome_tokens(c, cfg, _native_nll(cfg)) if not is_multi(cfg) else c.tokens(cfg.data, entries[0].lang, _native_nll(cfg))[1]
    w.add_forward(shapes[0], tok, logits=True, passes=2.0 if select else 1.0)
    w.held = [shapes[0]]


_R, _C = "mergescope.native.report", "mergescope.native.report_checkpoint"

ARMS = [
    Arm("native", order=20, uses=("represent",), tasks={"native": "mergescope.native.job:run_native", "merge": "mergescope.native.job:run_merge"},
        settings=("native",), models=native_only_models, models_order=30, work={"native": _w_native, "merge": _w_merge},
        phases=(Phase("native", native_pairs, lambda j, r: f"native pair {_pair_text(j)}", workers=True),),
        report=Report(sections={(60, 0): f"{_R}:native_pair"}, pair_rows=f"{_R}:pair_rows", pair_tables=f"{_R}:pair_tables",
                      coverage={"native": f"{_R}:native_cell", "transplant": f"{_R}:transplant_cell"},
                      summary={"native_pair": "Native cross-model pair"}, kinds={"merge": "one merged model's NLL (native route)"},
                      rejudge={"merge": "mergescope.native.comparisons:rejudge_merge",
                               "measure": "mergescope.native.comparisons:rejudge_pair"})),
    Arm("checkpoints", order=30, settings=("checkpoints",),
        needs=("checkpoints.models", lambda c: (c.get("checkpoints") or {}).get("models")),
        phases=(Phase("checkpoints", checkpoint_pairs, run=run_checkpoints),),
        report=Report(sections={(50, 0): f"{_C}:checkpoint_arm", (80, 1): f"{_C}:correlations_checkpoint"},
                      figures=(("correlations_checkpoint", "correlation heatmap, checkpoint arm"),
                               ("checkpoint_vs_distance", "checkpoint merge results vs trajectory distance")),
                      summary={"checkpoint": "Checkpoint merging", "corr_checkpoint": "Diagnostics, checkpoint arm"})),
]
