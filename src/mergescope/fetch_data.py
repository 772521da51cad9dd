"""`make data` without ../shared/data: download what can be downloaded, then check that the folder holds everything
the default study reads; where it does not, one line naming what to put where, and exit 2 (never 0 with a set the
study cannot use).

The default study reads, for each of its five languages: FLORES-200 dev and devtest (the parallel evaluation text)
with the metadata of both splits (each sentence's article URL and domain: the intervals resample whole articles), and
the monolingual Tatoeba training text of the toy zoo with its translation-overlap flags. FLORES-200 and its metadata
come in one public archive (CC BY-SA 4.0, no gate), downloaded where the machine reaches it. The Tatoeba text is
assembled from the Tatoeba Translation Challenge test sets (CC BY 2.0 FR; its README in the offline data says how):
there is no single download of it, so it is put in place by hand or read from ``MERGESCOPE_DATA``.

    python -m mergescope.fetch_data <dest>
"""

from __future__ import annotations

import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

LANGS = ("eng_Latn", "zho_Hans", "por_Latn", "pol_Latn", "ita_Latn")
FLORES_URL = "https://dl.fbaipublicfiles.com/nllb/flores200_dataset.tar.gz"
SPLITS = ("dev", "devtest")


def required(dest: Path) -> list[Path]:
    """Every file the default study reads under ``dest``."""
    out = [dest / "flores200" / f"metadata_{s}.tsv" for s in SPLITS]
    out += [dest / "flores200" / s / f"{lang}.{s}" for s in SPLITS for lang in LANGS]
    out += [dest / "mono_tatoeba" / f"{lang}{ext}" for lang in LANGS for ext in (".txt", ".in_pair_with_other_target.flags")]
    return out


def problem(dest: Path) -> str | None:
    """None when ``dest`` holds every file the default study reads, else one line naming the first missing piece,
    where it goes and where it comes from."""
    missing = [p for p in required(dest) if not p.is_file() or p.stat().st_size == 0]
    if not missing:
        return None
    first = missing[0]
    if first.parent.name == "mono_tatoeba":
        where = (f"the toy zoo's Tatoeba training text ({first.name} and its siblings, one sentence per line, with "
                 "<lang>.in_pair_with_other_target.flags) under " + str(first.parent))
    else:
        where = f"FLORES-200 ({first.name}: from {FLORES_URL}) under {first.parent}"
    return (f"error: {len(missing)} data file(s) missing, first {first}: put {where}, or set MERGESCOPE_DATA to a "
            "folder that holds the offline data's layout")


def _online(timeout: float = 3.0) -> bool:
    try:
        urllib.request.urlopen("https://dl.fbaipublicfiles.com", timeout=timeout)
        return True
    except Exception:  # noqa: BLE001 - any failure means: no download here
        return False


def fetch_flores(dest: Path) -> None:
    """FLORES-200 dev and devtest of the five languages and both splits' metadata, from the public archive."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "flores200.tar.gz"
        print(f"downloading {FLORES_URL}")
        urllib.request.urlretrieve(FLORES_URL, archive)
        with tarfile.open(archive) as tar:
            for split in SPLITS:
                (dest / "flores200" / split).mkdir(parents=True, exist_ok=True)
                for lang in LANGS:
                    data = tar.extractfile(tar.getmember(f"flores200_dataset/{split}/{lang}.{split}")).read()  # type: ignore[union-attr]
                    (dest / "flores200" / split / f"{lang}.{split}").write_bytes(data)
                meta = tar.extractfile(tar.getmember(f"flores200_dataset/metadata_{split}.tsv")).read()  # type: ignore[union-attr]
                (dest / "flores200" / f"metadata_{split}.tsv").write_bytes(meta)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dest = Path(argv[0] if argv else "data")
    flores = [p for p in required(dest) if p.parent.name != "mono_tatoeba"]
    if not all(p.is_file() for p in flores) and _online():
        fetch_flores(dest)
        print(f"FLORES-200 dev/devtest and their metadata written under {dest}/flores200")
    said = problem(dest)
    if said is not None:
        print(said, file=sys.stderr)
        return 2
    print(f"{dest} holds every file the default study reads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
