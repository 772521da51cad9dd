"""checkpoints.evict_after: a hub model's measured revisions leave the local hub cache; main and zoo folders stay."""

from __future__ import annotations

from pathlib import Path



def _fake_hub_cache(root: Path, repo: str, refs: dict[str, str], size: int = 1000) -> Path:
    """The Hugging Face cache layout: blobs, snapshots/<commit>/<file> -> blob, refs/<branch> = commit."""
    base = root / f"models--{repo.replace('/', '--')}"
    for name, commit in refs.items():
        blob = base / "blobs" / f"{commit}blob"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(b"x" * size)
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        if not (snap / "model.safetensors").is_symlink():
            (snap / "model.safetensors").symlink_to(blob)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / name).write_text(commit)
    return base


def test_evict_revisions_frees_measured_revisions_and_keeps_main(tmp_path):
    from mergescope.hub import evict_revisions

    c1, c2, cm = "a" * 40, "b" * 40, "c" * 40
    base = _fake_hub_cache(tmp_path, "org/model", {"step1": c1, "step2": c2, "main": cm})
    freed = evict_revisions("org/model", ["step1", "step2"], cache_dir=str(tmp_path))
    assert freed == {"step1": 1000, "step2": 1000}
    assert not (base / "snapshots" / c1).exists() and not (base / "snapshots" / c2).exists()
    assert (base / "snapshots" / cm / "model.safetensors").read_bytes() == b"x" * 1000
    assert evict_revisions("org/other", ["step1"], cache_dir=str(tmp_path)) == {}


def test_a_revision_that_is_also_main_is_kept(tmp_path):
    from mergescope.hub import evict_revisions

    c = "d" * 40
    base = _fake_hub_cache(tmp_path, "org/m", {"step9": c, "main": c})
    assert evict_revisions("org/m", ["step9"], cache_dir=str(tmp_path)) == {}
    assert (base / "snapshots" / c).is_dir()


def test_zoo_checkpoints_are_never_evicted(tiny_models, compose_cfg):
    from mergescope.jobs import job
    from mergescope.native.arm import evict_checkpoints

    p = str(tiny_models["neox_en"])
    _, base = compose_cfg([])
    j = job("native", [*base, "pair=custom", f"pair.a.name_or_path={p}", "pair.a.revision=step1", "pair.a.lang=eng_Latn",
                       f"pair.b.name_or_path={p}", "pair.b.revision=step2", "pair.b.lang=eng_Latn"])
    assert evict_checkpoints([j]) == {}
    assert (Path(p) / "step1" / "config.json").is_file()
