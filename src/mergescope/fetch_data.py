"""`make data` without ../shared/data: download the public sources where there is internet,
otherwise say exactly what to put where.

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
LAYOUT = f"""Put the parallel and training text here (plain UTF-8, one sentence per line):
  <dest>/flores200/dev/<lang>.dev and <dest>/flores200/devtest/<lang>.devtest   (FLORES-200, from {FLORES_URL})
  <dest>/mono_tatoeba/<lang>.txt and <lang>.in_pair_with_other_target.flags   (Tatoeba sentences, one 0/1 flag per line)
for <lang> in {", ".join(LANGS)}; or set MERGESCOPE_DATA=<folder with that layout>."""


def _online(timeout: float = 3.0) -> bool:
    try:
        urllib.request.urlopen("https://dl.fbaipublicfiles.com", timeout=timeout)
        return True
    except Exception:
        return False


def fetch_flores(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "flores200.tar.gz"
        print(f"downloading {FLORES_URL}")
        urllib.request.urlretrieve(FLORES_URL, archive)
        with tarfile.open(archive) as tar:
            for split in ("dev", "devtest"):
                (dest / "flores200" / split).mkdir(parents=True, exist_ok=True)
                for lang in LANGS:
                    member = tar.getmember(f"flores200_dataset/{split}/{lang}.{split}")
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    (dest / "flores200" / split / f"{lang}.{split}").write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dest = Path(argv[0] if argv else "data")
    if not _online():
        print("error: no ../shared/data here and no internet to download from.", file=sys.stderr)
        print(LAYOUT.replace("<dest>", str(dest)), file=sys.stderr)
        return 2
    fetch_flores(dest)
    print(f"FLORES-200 dev/devtest written under {dest}/flores200.")
    if not (dest / "mono_tatoeba").is_dir():
        print("Tatoeba training text is not downloaded automatically (it is assembled from the Tatoeba")
        print("Translation Challenge test sets, see shared/data/mono_tatoeba/README.md); the toy zoo needs it:")
        print(LAYOUT.replace("<dest>", str(dest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
