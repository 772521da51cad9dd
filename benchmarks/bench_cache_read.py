"""Reading one verified representation entry: the cache's read (one read into one buffer, one checksum pass, the array a
view of that buffer, its values checked finite) against the plain way (read the bytes, slice off the header, hash them, parse a copy with
``np.load``, hash the array's bytes again for its metadata), on an entry the size of Qwen2.5-Coder-1.5B's all-layer
states over FLORES devtest (29 x 1012 x 1536 float64, 361 MB). Prints seconds per read and the ratio; both reads are
checked to give the same array.

    python benchmarks/bench_cache_read.py [--layers 29 --n 1012 --d 1536 --repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import tempfile
import time
from pathlib import Path

import numpy as np


def plain_read(npy: Path, array_sha: str) -> np.ndarray:
    from mergescope.integrity import _HEAD, entry_problem

    blob = npy.read_bytes()
    assert entry_problem(blob) is None
    X = np.load(io.BytesIO(blob[_HEAD:]), allow_pickle=False)
    assert hashlib.sha256(X.tobytes()).hexdigest() == array_sha  # the metadata's record of the array
    return X


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=29)
    ap.add_argument("--n", type=int, default=1012)
    ap.add_argument("--d", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from mergescope.represent.cache import ReprCache, ReprKey

    X = np.random.default_rng(0).standard_normal((a.layers, a.n, a.d))
    with tempfile.TemporaryDirectory() as tmp:
        cache = ReprCache(tmp)
        key = ReprKey(model="bench", data="bench", lang="zho_Hans", split="devtest", pooling="mean", layer=-1,
                      dtype="float32", max_length=512)
        cache.put(key, X, {})
        npy, _ = cache._paths(key)
        array_sha = hashlib.sha256(X.tobytes()).hexdigest()
        times = {"cache": [], "plain": []}
        for _ in range(a.repeats):
            for name in times:
                t0 = time.perf_counter()
                got = cache.get(key)[0] if name == "cache" else plain_read(npy, array_sha)
                times[name].append(time.perf_counter() - t0)
                assert np.array_equal(got, X)
                del got
    best = {k: min(v) for k, v in times.items()}
    print(f"entry {X.nbytes / 1e6:.0f} MB ({a.layers} x {a.n} x {a.d} float64), best of {a.repeats} reads each")
    print(f"  cache read (one buffer, one checksum pass): {best['cache']:.3f} s")
    print(f"  plain read (copies, two checksum passes):    {best['plain']:.3f} s")
    print(f"  ratio plain / cache: {best['plain'] / best['cache']:.2f}x")


if __name__ == "__main__":
    main()
